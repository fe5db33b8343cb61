"""A TCP port a child process can bind later without a race against port-0 binds.

A port the kernel hands out for ``bind(0)`` comes from its ephemeral range, so between
our check and the child's bind any other process (vLLM's own ZMQ sockets, gloo) may be
given the same one. Ports are therefore drawn from below that range, where no port-0 bind
lands, and checked free before they are returned.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other kernels differ, and the bind check still holds


def free_port(count: int = 1, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports on ``host`` that are free now and outside the kernel's
    ephemeral range."""
    low = min(_ephemeral_low(), 65536)
    candidates = list(range(max(1024, low - 12000), max(1025, low - count + 1)))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:500]:
        if all(_free(host, p) for p in range(port, port + count)):
            return port
    raise RuntimeError(f"no {count} free ports on {host} below the ephemeral range (from {low})")


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
