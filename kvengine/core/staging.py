"""A store filled piecewise: slots prepared for a prompt's new chunks, written by the caller, then committed.

Inference engines that save KV layer by layer (vLLM's ``save_kv_layer``)
fill each chunk's slot one tensor group at a time while the forward pass
runs; :meth:`kvengine.core.engine.CacheEngine.store` is the same thing done in one
call from a :data:`~kvengine.types.ChunkSource`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvengine.chunks.keys import ChunkKey
from kvengine.core.memory_tier import MemoryEntry
from kvengine.types import ChunkView, ModelBinding


@dataclass(slots=True, eq=False)
class StagedStore:
    """Memory slots for the chunks of one store that are not cached yet.

    ``chunks`` are writable views of the slots, in token order (``index`` is
    the chunk's position in the prompt), valid until the store is committed.
    The slots are pinned and invisible to lookups until then, so an
    abandoned or half-written chunk is never served.
    """

    binding: ModelBinding
    chunks: tuple[ChunkView, ...]
    present_chunks: int
    rejected_chunks: int
    entries: tuple[MemoryEntry, ...]
    committed: bool = False
    #: Leading entries already committed and handed to the tier writes while the rest was filled.
    published: int = 0
    #: Per entry, the tails it supersedes (:mod:`kvengine.core.tails`): discarded from memory once it is committed.
    supersedes: tuple[tuple[ChunkKey, ...], ...] = ()
