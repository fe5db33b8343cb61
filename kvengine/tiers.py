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


def build_transports(config: EngineConfig) -> list[ChunkTransport]:
    """The transports the configuration asks for, in lookup order (disk first)."""
    transports: list[ChunkTransport] = []
    if config.disk.path is not None:
        factories = transport_factories()
        if "local_disk" not in factories:
            raise ConfigError("disk.path is set but the local_disk transport is not installed")
        factory = factories["local_disk"].load()  # type: ignore[attr-defined]
        transports.append(factory(config.disk.model_dump()))
    return transports
