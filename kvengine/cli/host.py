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
from typing import TYPE_CHECKING

from pydantic import ByteSize

from kvengine.cli.arguments import EXIT_USAGE, OneLineParser, byte_size, one_line
from kvengine.config import MemoryConfig, check_tenant
from kvengine.errors import ConfigError, KVEngineError

if TYPE_CHECKING:
    from kvengine.core.host_tiers import HostTiers
    from kvengine.events import KVEventPublisher


def _mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"not a file mode (octal, e.g. 0660): {text!r}")
    return mode


def _quota(text: str) -> tuple[str, int]:
    name, sep, size = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"a quota is NAME=SIZE (e.g. team-a=16GiB), got {text!r}")
    try:
        check_tenant(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, byte_size(size)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or OneLineParser(prog="kvengine host", description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True, metavar="PATH", help="Unix socket to serve on (required)")
    p.add_argument("--capacity", type=byte_size, default=int(MemoryConfig().capacity_bytes), metavar="SIZE",
                   help="the shared memory tier's size (default 2GiB)")
    p.add_argument("--slab-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="allocation slab; every chunk must fit one (default capacity/16 within [1MiB, 256MiB])")
    p.add_argument("--eviction", choices=("lru", "fifo"), default="lru")
    p.add_argument("--prefault", action="store_true",
                   help="clients map the whole arena in when they attach (the arena is allocated at start either "
                        "way): no page faults on their first copies, page tables for all of it in each client")
    p.add_argument("--quota", type=_quota, action="append", default=[], metavar="TENANT=SIZE",
                   help="a share of the arena for the engines of TENANT (their memory.tenant): their stores evict "
                        "only their own chunks, and no one else's evict theirs (repeatable; the rest is shared)")
    p.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                   help="another user allowed to attach (repeatable; the socket's --mode must let it in too)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics (per tenant: chunks, bytes, evictions) on 127.0.0.1:PORT")
    p.add_argument("--mode", type=_mode, default=0o600, help="the socket file's permissions (octal, default 0600)")
    p.add_argument("--config", metavar="FILE",
                   help="a kvengine configuration (YAML) whose lower tiers (disk, peers, mooncake, tiers) the service "
                        "owns below the arena (clients then configure none, and a restarted service serves what they "
                        "hold) and whose events section publishes the arena's KV events; its memory section is not "
                        "used")
    return p


def run(args: argparse.Namespace) -> int:
    from kvengine.host.metrics import host_registry  # torch: imported only when the command runs
    from kvengine.host.service import HostService
    from kvengine.metrics import serve_registry

    try:
        memory = MemoryConfig(capacity_bytes=args.capacity, slab_bytes=args.slab_bytes, eviction=args.eviction,
                              prefault=args.prefault)
    except ValueError as exc:
        print(f"kvengine host: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    quotas = dict(args.quota)
    if len(quotas) != len(args.quota):
        print("kvengine host: --quota: a tenant is given two quotas", file=sys.stderr)
        return EXIT_USAGE
    stop_metrics = None
    try:
        lower, events = _configured(args.config)
    except KVEngineError as exc:
        print(f"kvengine host: {one_line(exc)}", file=sys.stderr)
        return 1
    try:
        service = HostService(memory, args.socket, quotas=quotas, allow_uids=args.allow_uid, mode=args.mode,
                              lower=lower, events=events)
        if args.metrics_port is not None:
            registry = host_registry(service)
            if lower is not None:  # the lower tiers' reads, writes and integrity failures, as an engine's
                registry.register(lower.metrics.registry)
            stop_metrics = serve_registry(registry, args.metrics_port)
        service.start()
    except KVEngineError as exc:
        if stop_metrics is not None:
            stop_metrics()
        if lower is not None:
            lower.close()
        print(f"kvengine host: {one_line(exc)}", file=sys.stderr)
        return 1
    shares = "".join(f", {name} {ByteSize(pool.capacity_bytes).human_readable()}"
                     for name, pool in service.stats().pools.items() if name)
    below = ("" if lower is None else f", over {lower.describe()}") + (
        "" if events is None else f", KV events on {events.endpoint}")
    print(f"kvengine host: {memory.capacity_bytes.human_readable()} ({args.eviction}{shares}{below}) on "
          f"{args.socket}", flush=True)
    try:
        stop.wait()
    finally:
        stats = service.stats()
        if stop_metrics is not None:
            stop_metrics()
        service.close()
        print(f"kvengine host: stopped ({stats.chunks} chunks, {stats.evictions} evictions, "
              f"{stats.released_pins} pins and {stats.aborted_stores} stores released from closed connections)",
              flush=True)
    return 0


def _configured(path: str | None) -> tuple[HostTiers | None, KVEventPublisher | None]:
    """The lower tiers and the KV event publisher the configuration file ``path`` configures, built (not
    started); neither without a file.

    :raises ConfigError: the file is not a configuration, configures neither, or sets a client's memory.
    """
    if path is None:
        return None, None
    from kvengine.config import load_config
    from kvengine.core.host_tiers import HostTiers
    from kvengine.events import KVEventPublisher
    from kvengine.tiers import build_tiers

    config = load_config(path, environ={})
    if config.memory.service is not None:
        raise ConfigError(f"--config {path}: memory.service is a client's setting; the service's own "
                          "configuration names its lower tiers and events")
    tiers = build_tiers(config)
    events = KVEventPublisher.from_config(config.events)
    if not tiers and events is None:
        raise ConfigError(f"--config {path}: the configuration has no lower tier (disk, peers, mooncake or tiers) "
                          "and no events section; without them, leave --config out")
    return (HostTiers(config, transports=tiers) if tiers else None), events


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
