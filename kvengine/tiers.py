"""Building the tiers below memory from configuration."""

from __future__ import annotations

from importlib.metadata import entry_points

from .config import EngineConfig
from .errors import ConfigError
from .transport import ChunkTransport

ENTRY_POINT_GROUP = "kvengine.transports"


def transport_factories() -> dict[str, object]:
    """Transport factories registered by kvengine and third parties."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load(name: str, why: str) -> object:
    factories = transport_factories()
    if name not in factories:
        raise ConfigError(f"{why} but the {name} transport is not installed")
    return factories[name].load()  # type: ignore[attr-defined]


def build_transports(config: EngineConfig) -> list[ChunkTransport]:
    """The transports the configuration asks for, in lookup order (disk, then peers)."""
    transports: list[ChunkTransport] = []
    if config.disk.path is not None:
        factory = _load("local_disk", "disk.path is set")
        transports.append(factory(config.disk.model_dump()))  # type: ignore[operator]
    peers = config.peers
    if peers.peers or peers.peers_file is not None:
        factory = _load(f"peers_{peers.transport}", f"peers.transport={peers.transport!r}")
        options = peers.model_dump(exclude={"transport"}, exclude_none=True)
        transports.append(factory(options))  # type: ignore[operator]
    return transports
