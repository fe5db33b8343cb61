"""kvengine: an embeddable KV-cache offload engine for LLM inference.

Start with :class:`KVEngine` (blocking, thread-safe) or :class:`CacheEngine`
(asyncio). Describe a model with a :class:`Namespace` and a
:class:`ChunkLayout`, bind it, then ``lookup`` (a :class:`LookupResult`) / ``load`` / ``store``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace, NamespaceDigest
    from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
    from kvengine.config import DiskConfig, EngineConfig, MemoryConfig, load_config
    from kvengine.core.engine import CacheEngine
    from kvengine.core.reservations import Reservation, ReservationState
    from kvengine.core.staging import StagedStore
    from kvengine.errors import (
        AttachError,
        CapacityError,
        ConfigError,
        EngineClosedError,
        IntegrityError,
        InvalidRequestError,
        KVEngineError,
        TransportError,
        UnsupportedModelError,
    )
    from kvengine.facade import KVEngine
    from kvengine.lookups import LookupOutcome, LookupResult
    from kvengine.transport import ReadScope
    from kvengine.types import ChunkSink, ChunkSource, ChunkView, LoadResult, ModelBinding, StoreResult

#: Public name -> the module that defines it. Imported on first use (PEP 562): ``import kvengine``
#: and the ``kvengine`` command stay fast, torch is loaded only when an engine is.
_EXPORTS = {
    **dict.fromkeys(("ChunkHash", "ChunkKey", "Namespace", "NamespaceDigest"), "kvengine.chunks.keys"),
    **dict.fromkeys(("ChunkLayout", "KVCategory", "TensorSpec"), "kvengine.chunks.layout"),
    **dict.fromkeys(("DiskConfig", "EngineConfig", "MemoryConfig", "load_config"), "kvengine.config"),
    "CacheEngine": "kvengine.core.engine",
    **dict.fromkeys(("Reservation", "ReservationState"), "kvengine.core.reservations"),
    "StagedStore": "kvengine.core.staging",
    **dict.fromkeys(("AttachError", "CapacityError", "ConfigError", "EngineClosedError", "IntegrityError",
                     "InvalidRequestError", "KVEngineError", "TransportError", "UnsupportedModelError"), "kvengine.errors"),
    "KVEngine": "kvengine.facade",
    **dict.fromkeys(("LookupOutcome", "LookupResult"), "kvengine.lookups"),
    "ReadScope": "kvengine.transport",
    **dict.fromkeys(("ChunkSink", "ChunkSource", "ChunkView", "LoadResult", "ModelBinding", "StoreResult"),
                    "kvengine.types"),
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvengine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__version__ = "0.1.0"

__all__ = [
    "AttachError", "CacheEngine", "CapacityError", "ChunkHash", "ChunkKey", "ChunkLayout", "ChunkSink",
    "ChunkSource", "ChunkView", "ConfigError", "DiskConfig", "EngineClosedError", "EngineConfig", "IntegrityError",
    "InvalidRequestError", "KVCategory", "KVEngine", "KVEngineError", "LoadResult", "LookupOutcome",
    "LookupResult", "MemoryConfig",
    "ModelBinding", "Namespace", "NamespaceDigest", "ReadScope", "Reservation", "ReservationState", "StagedStore", "StoreResult",
    "TensorSpec", "TransportError", "UnsupportedModelError", "load_config",
]
