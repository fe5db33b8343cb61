"""Building the tiers below memory from configuration."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points

from .config import EngineConfig
from .errors import ConfigError
from .transport import ChunkTransport

ENTRY_POINT_GROUP = "kvengine.transports"


@dataclass(frozen=True, slots=True)
class Tier:
    """A tier below memory: its transport and the name of the codec its records are written with."""

    transport: ChunkTransport
    codec: str
    #: The configuration key that chose ``codec``, for error messages.
    setting: str = "codec"


def transport_factories() -> dict[str, object]:
    """Transport factories registered by kvengine and third parties."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load(name: str, why: str) -> object:
    factories = transport_factories()
    if name not in factories:
        raise ConfigError(f"{why} but the {name} transport is not installed")
    return factories[name].load()  # type: ignore[attr-defined]


def build_tiers(config: EngineConfig) -> list[Tier]:
    """The tiers the configuration asks for, in lookup order (disk, then peers)."""
    tiers: list[Tier] = []
    if config.disk.path is not None:
        factory = _load("local_disk", "disk.path is set")
        tiers.append(Tier(factory(config.disk.model_dump()), config.disk.codec, "disk.codec"))  # type: ignore[operator]
    peers = config.peers
    if peers.peers or peers.peers_file is not None:
        factory = _load(f"peers_{peers.transport}", f"peers.transport={peers.transport!r}")
        options = peers.model_dump(exclude={"transport", "codec"}, exclude_none=True)
        tiers.append(Tier(factory(options), peers.codec, "peers.codec"))  # type: ignore[operator]
    return tiers
