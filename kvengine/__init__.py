"""kvengine: an embeddable KV-cache offload engine for LLM inference.

Start with :class:`KVEngine` (blocking, thread-safe) or :class:`CacheEngine`
(asyncio). Describe a model with a :class:`Namespace` and a
:class:`ChunkLayout`, bind it, then ``lookup`` / ``load`` / ``store``.
"""

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
    IntegrityError,
    InvalidRequestError,
    KVEngineError,
    TransportError,
    UnsupportedModelError,
)
from kvengine.facade import KVEngine
from kvengine.types import ChunkSink, ChunkSource, ChunkView, LoadResult, ModelBinding, StoreResult

__version__ = "0.1.0"

__all__ = [
    "AttachError", "CacheEngine", "CapacityError", "ChunkHash", "ChunkKey", "ChunkLayout", "ChunkSink",
    "ChunkSource", "ChunkView", "ConfigError", "DiskConfig", "EngineConfig", "IntegrityError",
    "InvalidRequestError", "KVCategory", "KVEngine", "KVEngineError", "LoadResult", "MemoryConfig",
    "ModelBinding", "Namespace", "NamespaceDigest", "Reservation", "ReservationState", "StagedStore", "StoreResult",
    "TensorSpec", "TransportError", "UnsupportedModelError", "load_config",
]
