"""``kvengine serve``: a standalone peer server.

Serves chunk records to other nodes (get / exists / put / delete, see
:mod:`kvengine.transports.peers.protocol`) from process memory (LRU,
``--capacity``) or from a local-disk tier (``--disk DIR``), until SIGINT or
SIGTERM. The first line on stdout names the bound address::

    kvengine serve: tcp on 127.0.0.2:7000, store memory (4.0 GiB)

The wire is ``--transport tcp`` by default: kvengine's own framing, where
every bound (header size, announced payload, each client's share of the
receive budget, message deadline) holds before a byte is buffered.
``--transport zmq`` stays available for ZeroMQ clients, but libzmq buffers
each message whole before the server sees it, so there one admitted client
can make the server buffer a huge message or drain a flood of tiny frames
while the others wait (docs/security.md, "Bounded resources").

CURVE (ZeroMQ only): ``--curve-cert`` is the server's secret certificate
file and ``--curve-allow`` a directory of admitted clients' public
certificates, both in pyzmq's format
(``zmq.auth.create_certificates(dir, name)``). Clients configure the
server's public key.

TLS (``--transport tcp``): ``--tls-cert`` / ``--tls-key`` are the server's
certificate and key (PEM); ``--tls-ca`` the CA whose client certificates
are admitted (clients without one are refused).

Tenants (ZeroMQ with CURVE, or tcp with TLS and a client CA): ``--tenants
FILE`` grants client keys (CURVE public keys, or TLS certificate
fingerprints) to tenants, writing or read-only, and keeps each tenant to its
own namespaces (format in :mod:`kvengine.transports.peers.tenants`); over CURVE
only the keys it lists are admitted. Namespaces not pinned in the file belong to the first tenant that
writes them; those claims are kept in ``--claims FILE`` (default
``DIR/tenant-claims.json`` with ``--disk``, else in memory).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import ssl
import sys
from typing import TYPE_CHECKING, Any

from kvengine.chunks.keys import DIGEST_BYTES, NamespaceDigest
from kvengine.cli.arguments import EXIT_USAGE, OneLineParser, byte_size, one_line
from kvengine.errors import ConfigError, KVEngineError

if TYPE_CHECKING:
    from kvengine.sharing import WireOptions, WireSettingNames


class FileOptionError(ConfigError):
    """A file or directory an option names is missing or malformed (exit status 2, like an argument error)."""


def _namespace(text: str) -> NamespaceDigest:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != DIGEST_BYTES:
        raise argparse.ArgumentTypeError(f"not a namespace digest (32 hex digits): {text!r}")
    return NamespaceDigest(raw)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``serve`` options, added to ``parser`` (a CLI subcommand's) or to a parser of their own."""
    p = parser or OneLineParser(prog="kvengine serve", description=__doc__.split("\n")[0])
    p.add_argument("--bind", required=True, metavar="HOST:PORT", help="address to listen on (required; port 0: any free port)")
    p.add_argument("--transport", choices=("tcp", "zmq", "ucx"), default="tcp",
                   help="tcp (own framing, every bound holds before buffering; TLS), zmq (CURVE; libzmq buffers "
                        "each message whole before it can be checked) or ucx (default tcp)")
    p.add_argument("--disk", metavar="DIR", help="serve a local-disk tier in DIR instead of memory (default: memory)")
    p.add_argument("--capacity", type=byte_size, default=byte_size("4GiB"), help="store capacity (default 4GiB)")
    p.add_argument("--namespace", type=_namespace, action="append", metavar="HEX",
                   help="serve only this namespace digest (repeatable; default: all)")
    p.add_argument("--max-concurrent", type=int, default=8, help="requests served at once (default 8)")
    p.add_argument("--no-verify-puts", action="store_true", help="check put records' headers only, not payloads (default: verify payloads too)")
    p.add_argument("--secret-file", metavar="FILE",
                   help="the peer group's shared secret: puts must carry a record MAC that verifies under it "
                        "(required off loopback unless CURVE is on)")
    p.add_argument("--curve-cert", metavar="FILE", help="server secret certificate (turns CURVE on; default: off)")
    p.add_argument("--curve-allow", metavar="DIR", help="admit only clients whose public certificates are here (needs --curve-cert)")
    p.add_argument("--tls-cert", metavar="FILE", help="tcp: server certificate, PEM (turns TLS on; default: off)")
    p.add_argument("--tls-key", metavar="FILE", help="tcp: the certificate's private key, PEM (default: read from --tls-cert)")
    p.add_argument("--tls-ca", metavar="FILE", help="tcp: admit only clients with a certificate this CA signed")
    p.add_argument("--message-timeout", type=float, default=5.0, metavar="S",
                   help="tcp: a message must arrive whole within this time of its first byte (default 5)")
    p.add_argument("--tenants", metavar="FILE",
                   help="per-tenant access control by client key (needs --curve-cert, or --tls-ca with tcp)")
    p.add_argument("--claims", metavar="FILE", help="where tenants' namespace claims are kept (default DIR/tenant-claims.json with --disk, "
                                                       "else in memory)")
    return p


def _store(args: argparse.Namespace) -> tuple[Any, str]:
    if args.disk:
        from kvengine.tiers import build_transport

        return build_transport("local_disk", {"path": args.disk, "capacity_bytes": args.capacity},
                               setting="--disk"), f"disk {args.disk}"
    from kvengine.transports.peers.store import MemoryRecordStore

    return MemoryRecordStore(args.capacity), f"memory ({args.capacity / 2**30:.1f} GiB)"


def _flags() -> WireSettingNames:
    """``kvengine serve``'s flags, as a peer server's refusals name them."""
    from kvengine.sharing import WireSettingNames

    return WireSettingNames(bind="--bind", transport="--transport", secret="--secret-file",
                            tls="--tls-cert/--tls-key/--tls-ca", curve_keys="--curve-cert",
                            curve_allow="--curve-allow or --tenants")


def _server(args: argparse.Namespace, store: Any) -> Any:
    from pathlib import Path

    from kvengine.sharing import WireOptions, peer_server
    from kvengine.transports.peers.service import ServerOptions
    from kvengine.trust.secrets import read_secret_file

    try:
        secret = read_secret_file(args.secret_file, "--secret-file")
    except ConfigError as exc:
        raise FileOptionError(str(exc)) from None
    gate = _gatekeeper(args)
    options = ServerOptions(namespaces=frozenset(args.namespace) if args.namespace else None,
                            verify_puts=not args.no_verify_puts, max_concurrent=args.max_concurrent, secret=secret,
                            tenants=gate)
    if args.transport == "zmq":
        return peer_server(store, args.bind, options, _curve_wire(args, gate), names=_flags())
    cert, key, ca = (Path(v) if v else None for v in (args.tls_cert, args.tls_key, args.tls_ca))
    if cert is not None:
        from kvengine.transports.peers.tcp import TlsConfig

        try:  # load the files now, so that a bad one is reported as such before anything starts
            TlsConfig(cert=cert, key=key, ca=ca).server_context()
        except (ConfigError, ssl.SSLError) as exc:
            raise FileOptionError(f"--tls-cert/--tls-key/--tls-ca: {one_line(exc)}") from None
    wire = WireOptions(transport=args.transport, tls_cert=cert, tls_key=key, tls_ca=ca,
                       message_timeout=args.message_timeout if args.transport == "tcp" else None)
    return peer_server(store, args.bind, options, wire, names=_flags())


def _curve_wire(args: argparse.Namespace, gate: Any) -> WireOptions:
    """The zmq wire's CURVE settings from ``--curve-cert`` / ``--curve-allow`` / ``--tenants``."""
    from kvengine.sharing import WireOptions

    if (args.curve_allow or args.tenants) and not args.curve_cert:
        raise ConfigError("--curve-allow and --tenants need --curve-cert")
    if not args.curve_cert:
        return WireOptions(transport="zmq")
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(args.curve_cert)
    except (OSError, ValueError, KeyError) as exc:
        raise FileOptionError(f"--curve-cert {args.curve_cert}: not a readable CURVE certificate ({exc})") \
            from None
    if secret is None:
        raise FileOptionError(f"--curve-cert {args.curve_cert} holds no secret key")
    allowed = gate.policy.client_keys if gate is not None else None
    if args.curve_allow:
        try:
            allowed = (allowed or frozenset()) | frozenset(zmq.auth.load_certificates(args.curve_allow))
        except (OSError, ValueError, KeyError) as exc:
            raise FileOptionError(f"--curve-allow {args.curve_allow}: cannot load client certificates "
                                  f"({exc})") from None
    return WireOptions(transport="zmq", curve_public_key=public, curve_secret_key=secret, curve_allow=allowed)


def _check_wire_options(args: argparse.Namespace) -> None:
    """Each wire's own options, and what tenants need on it; a mismatch is refused, never ignored."""
    curve, tls = args.curve_cert or args.curve_allow, args.tls_cert or args.tls_key or args.tls_ca
    if curve and args.transport != "zmq":
        raise ConfigError("--curve-cert/--curve-allow are ZeroMQ options: add --transport zmq (the default wire is "
                          "tcp)")
    if tls and args.transport != "tcp":
        raise ConfigError("--tls-cert/--tls-key/--tls-ca are options of --transport tcp")
    if (args.tls_key or args.tls_ca) and not args.tls_cert:
        raise ConfigError("--tls-key and --tls-ca need --tls-cert")
    if args.curve_allow and not args.curve_cert:
        raise ConfigError("--curve-allow needs --curve-cert")
    if args.tenants and not (args.curve_cert if args.transport == "zmq" else args.tls_ca):
        raise ConfigError({"zmq": "--tenants needs --curve-cert (CURVE proves each client's key)",
                           "tcp": "--tenants needs --tls-ca (client certificates prove each client)",
                           "ucx": "--tenants cannot be used with UCX (it cannot prove a client's identity)",
                           }[args.transport])


def _gatekeeper(args: argparse.Namespace) -> Any:
    if args.tenants is None:
        if args.claims:
            raise ConfigError("--claims needs --tenants")
        return None
    from kvengine.transports.peers.tenants import ClaimBook, Gatekeeper, load_tenants

    claims = args.claims or (os.path.join(args.disk, "tenant-claims.json") if args.disk else None)
    try:
        policy = load_tenants(args.tenants)
    except ConfigError as exc:
        raise FileOptionError(f"--tenants: {exc}") from None
    return Gatekeeper(policy, ClaimBook(claims))


async def _serve(args: argparse.Namespace) -> int:
    store, what = _store(args)
    server = _server(args, store)
    await server.start()
    print(f"kvengine serve: {args.transport} on {server.address}, store {what}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.close()
        close = getattr(store, "close", None)
        if close is not None:
            await close()
        counts = ", ".join(f"{k}={v}" for k, v in sorted(server.service.counts.items()))
        print(f"kvengine serve: stopped ({counts or 'no requests'})", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; ``args`` as parsed by :func:`build_parser`. Returns the exit status."""
    if args.max_concurrent < 1:
        print("kvengine serve: --max-concurrent must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        _check_wire_options(args)  # option combinations first: they name what is missing
        _check_files(args)
        return asyncio.run(_serve(args))
    except FileOptionError as exc:  # a missing or malformed file: the caller's to fix
        print(f"kvengine serve: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except ssl.SSLError as exc:  # certificate / key files that do not load
        files = ", ".join(f for f in (args.tls_cert, args.tls_key, args.tls_ca) if f)
        print(f"kvengine serve: TLS files {files} do not load: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (KVEngineError, OSError) as exc:
        print(f"kvengine serve: {one_line(exc)}", file=sys.stderr)
        return 1


def _check_files(args: argparse.Namespace) -> None:
    """Every file and directory option names one that exists, before anything starts (else
    :class:`FileOptionError`)."""
    for option, path, want_dir in (("--secret-file", args.secret_file, False), ("--curve-cert", args.curve_cert, False),
                                   ("--curve-allow", args.curve_allow, True), ("--tls-cert", args.tls_cert, False),
                                   ("--tls-key", args.tls_key, False), ("--tls-ca", args.tls_ca, False),
                                   ("--tenants", args.tenants, False)):
        if path is None:
            continue
        if want_dir and not os.path.isdir(path):
            raise FileOptionError(f"{option} {path}: no such directory")
        if not want_dir and not os.path.isfile(path):
            raise FileOptionError(f"{option} {path}: no such file")


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
