"""``kvengine host``: the host cache service, one memory tier for every engine on this machine.

Engines attach with ``memory: {service: unix:///PATH}`` in their configuration
(docs/host.md). The service runs until SIGINT or SIGTERM; the first line on
stdout says what it serves::

    kvengine host: 4.0GiB (lru) on /run/kvengine/kvengine.sock

Only processes of this user (and ``--allow-uid``) may attach: the socket file
is created with ``--mode`` (default 0600) and each connection's credentials are
checked.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvengine.cli.arguments import EXIT_USAGE, OneLineParser, byte_size, one_line
from kvengine.config import MemoryConfig
from kvengine.errors import KVEngineError


def _mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"not a file mode (octal, e.g. 0660): {text!r}")
    return mode


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or OneLineParser(prog="kvengine host", description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True, metavar="PATH", help="Unix socket to serve on (required)")
    p.add_argument("--capacity", type=byte_size, default=int(MemoryConfig().capacity_bytes), metavar="SIZE",
                   help="the shared memory tier's size (default 2GiB)")
    p.add_argument("--slab-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="allocation slab; every chunk must fit one (default capacity/16 within [1MiB, 256MiB])")
    p.add_argument("--eviction", choices=("lru", "fifo"), default="lru")
    p.add_argument("--prefault", action="store_true",
                   help="make the whole arena resident at start (clients then map it in at once: no page faults "
                        "on their first copies)")
    p.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                   help="another user allowed to attach (repeatable; the socket's --mode must let it in too)")
    p.add_argument("--mode", type=_mode, default=0o600, help="the socket file's permissions (octal, default 0600)")
    return p


def run(args: argparse.Namespace) -> int:
    from kvengine.host.service import HostService  # torch: imported only when the command runs

    try:
        memory = MemoryConfig(capacity_bytes=args.capacity, slab_bytes=args.slab_bytes, eviction=args.eviction,
                              prefault=args.prefault)
    except ValueError as exc:
        print(f"kvengine host: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        service = HostService(memory, args.socket, allow_uids=args.allow_uid, mode=args.mode)
        service.start()
    except KVEngineError as exc:
        print(f"kvengine host: {one_line(exc)}", file=sys.stderr)
        return 1
    print(f"kvengine host: {memory.capacity_bytes.human_readable()} ({args.eviction}) on {args.socket}", flush=True)
    try:
        stop.wait()
    finally:
        stats = service.stats()
        service.close()
        print(f"kvengine host: stopped ({stats.chunks} chunks, {stats.evictions} evictions, "
              f"{stats.released_pins} pins and {stats.aborted_stores} stores released from closed connections)",
              flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
