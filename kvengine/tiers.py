"""Building the tiers below memory from configuration.

:func:`build_tiers` is the one builder: the :class:`~kvengine.KVEngine`
facade, the vLLM and SGLang integrations and ``kvengine serve`` all use it,
so one configuration means the same tiers everywhere. A configured tier is
built or refused with a :class:`ConfigError`, never silently left out.

Transports are found by name (:func:`transport_factory`): registered under
the ``kvengine.transports`` entry-point group (how another package adds
one, see ``tiers`` in :class:`~kvengine.config.EngineConfig`), else bundled
with kvengine (so a source checkout without installed metadata works).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from kvengine.chunks.keys import NamespaceDigest
from kvengine.config import EngineConfig
from kvengine.errors import ConfigError
from kvengine.transport import ChunkTransport

ENTRY_POINT_GROUP = "kvengine.transports"
#: Transports that ship with kvengine: name -> module whose ``create_transport`` builds one from plain
#: options (the entry-point seam), and ``from_section`` from its typed config section (build_tiers).
_BUNDLED = {
    "local_disk": "kvengine.transports.local_disk",
    "peers_zmq": "kvengine.transports.peers.zmq",
    "peers_ucx": "kvengine.transports.peers.ucx",
    "peers_tcp": "kvengine.transports.peers.tcp",
    "mooncake": "kvengine.transports.mooncake_store",
}

#: ``factory(options) -> transport``; raises ConfigError for options it cannot use.
TransportFactory = Callable[[Mapping[str, Any]], ChunkTransport]


@dataclass(frozen=True, slots=True)
class Tier:
    """A tier below memory: its transport and the name of the codec its records are written with."""

    transport: ChunkTransport
    codec: str
    #: The configuration key that chose ``codec``, for error messages.
    setting: str = "codec"


def transport_names() -> list[str]:
    """Every transport that can be built by name: registered ones and the bundled ones."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | set(_BUNDLED))


def transport_factory(name: str) -> TransportFactory:
    """The factory of the transport called ``name``: a registered entry point first, else a bundled one."""
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        factory: TransportFactory = ep.load()
        return factory
    if name in _BUNDLED:
        module = importlib.import_module(_BUNDLED[name])
        bundled: TransportFactory = module.create_transport
        return bundled
    raise ConfigError(f"no transport named {name!r} is installed (available: {', '.join(transport_names())}); "
                      f"a package provides one by registering it under the {ENTRY_POINT_GROUP!r} entry-point group")


def build_transport(name: str, options: Mapping[str, Any], *, setting: str) -> ChunkTransport:
    """Build one transport; its failures become a :class:`ConfigError` naming ``setting``."""
    factory = transport_factory(name)
    return _built(name, setting, lambda: factory(options))


def _bundled(name: str, *, setting: str, section: Any, **typed: Any) -> ChunkTransport:
    """A bundled tier built from its typed config section (``from_section`` of its module): no options
    dumped to a dict and parsed again. Its failures become a :class:`ConfigError` naming ``setting``."""
    module = importlib.import_module(_BUNDLED[name])
    return _built(name, setting, lambda: module.from_section(section, **typed))


def _built(name: str, setting: str, make: Callable[[], object]) -> ChunkTransport:
    """``make()``'s transport; whatever goes wrong is a :class:`ConfigError` naming ``setting``."""
    try:
        transport = make()
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{setting}: the {name} transport could not be built ({type(exc).__name__}: {exc})") \
            from exc
    if not isinstance(transport, ChunkTransport):
        raise ConfigError(f"{setting}: the {name} transport factory returned {type(transport).__name__}, "
                          "not a ChunkTransport")
    return transport


def build_tiers(config: EngineConfig, *, namespaces: Sequence[NamespaceDigest] = (),
                disk_options: Mapping[str, Any] | None = None) -> list[Tier]:
    """The tiers ``config`` asks for, in lookup order: disk, peers, Mooncake, then ``config.tiers``.

    ``namespaces`` restricts the disk tier's index to those namespaces (an
    engine that serves one model's rank, as SGLang's); ``disk_options`` adds
    local-disk options beyond :class:`~kvengine.config.DiskConfig`.
    """
    tiers: list[Tier] = []
    if config.disk.path is not None:
        disk = _bundled("local_disk", setting="disk", section=config.disk, namespaces=namespaces,
                        extra=disk_options)
        tiers.append(Tier(disk, config.disk.codec, "disk.codec"))
    peers = config.peers
    if peers.peers or peers.peers_file is not None:
        tiers.append(Tier(_bundled(f"peers_{peers.transport}", setting="peers", section=peers), peers.codec,
                          "peers.codec"))
    if config.mooncake.master is not None:
        tiers.append(Tier(_bundled("mooncake", setting="mooncake", section=config.mooncake), config.mooncake.codec,
                          "mooncake.codec"))
    for i, extra in enumerate(config.tiers):
        setting = f"tiers[{i}]"
        tiers.append(Tier(build_transport(extra.transport, extra.options, setting=setting), extra.codec,
                          f"{setting}.codec"))
    return tiers
