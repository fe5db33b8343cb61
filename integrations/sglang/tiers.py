"""The lower tiers of the backend's engine: the local disk, indexed for this rank's namespace only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvengine.config import EngineConfig
from kvengine.tiers import transport_factories
from kvengine.transport import ChunkTransport
from kvengine.types import ModelBinding


def lower_tiers(config: EngineConfig, binding: ModelBinding,
                disk_options: Mapping[str, Any] | None = None) -> list[ChunkTransport]:
    """The disk tier when ``disk.path`` is set, restricted to ``binding``'s namespace.

    Each SGLang rank is its own process with its own engine; restricting the
    index to the rank's namespace keeps each one's capacity accounting to its
    own pages when ranks (or models) share a directory.
    """
    if config.disk.path is None:
        return []
    factory = _local_disk_factory()
    return [factory({**config.disk.model_dump(), **(disk_options or {}), "namespaces": [binding.digest.hex()]})]


def _local_disk_factory() -> Any:
    """The registered ``local_disk`` factory, or the bundled one when no entry point is installed."""
    registered = transport_factories().get("local_disk")
    if registered is not None:
        return registered.load()  # type: ignore[attr-defined]
    from kvengine.transports.local_disk import create_transport

    return create_transport
