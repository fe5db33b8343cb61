"""``host:port`` network addresses, parsed once for every place that takes one (peers, servers, masters)."""

from __future__ import annotations

import ipaddress

from kvengine.errors import ConfigError


def split_host_port(text: str, *, any_port: bool = True) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``, ``[v6]:port`` or ``tcp://host:port``.

    ``any_port``: port 0 (the OS picks one, for a server binding) is allowed; else the port must be one a
    client can dial (1-65535).

    :raises ConfigError: not of that form (the text named).
    """
    raw = text.strip().removeprefix("tcp://")
    host, sep, port = raw.rpartition(":")
    lowest = 0 if any_port else 1
    if not sep or not host.strip("[]") or not port.isdigit() or not lowest <= int(port) <= 65535:
        raise ConfigError(f"address must be 'host:port', got {text!r}")
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    """``host:port``, brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def offset_port(address: str, offset: int) -> str:
    """``address`` with its port moved up by ``offset`` (a server per tensor-parallel rank: port + rank).

    :raises ConfigError: not ``host:port``, or the port moved out of range.
    """
    if offset == 0:
        return address
    host, port = split_host_port(address)
    if not 0 < port + offset <= 65535:
        raise ConfigError(f"port {port} of {address!r} + {offset} is not a port")
    return format_address(host, port + offset)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is provably this machine (a loopback address, or ``localhost``): where a peer, server
    or master may go without a secret or an encrypted wire."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: resolved elsewhere, so not provably local
        return False
