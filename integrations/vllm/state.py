"""Recurrent (Mamba / linear-attention) state at chunk boundaries, for hybrid models such as Qwen3-Next.

A hybrid model's prefix of ``N`` tokens is resumable only from the
attention pages of ``[0, N)`` *and* the recurrent state at ``N``. vLLM
keeps that state only where it materialized it: with prefix caching on it
runs in ``mamba_cache_mode='align'``, splits prefills at block-aligned ends,
and after a step whose computed prefix ends at ``E`` (a multiple of the
block size ``B``) the state group's block ``E / B - 1`` holds the state at
``E`` and is not written again (vLLM frees it a couple of steps later unless
it caches it). So the connector stores a state only at such an ``E`` that is
also a chunk boundary, in the step that reached it, and a hit is offered
only up to a boundary whose state is stored. The state of a hit is written
into block ``ceil(N / B) - 1`` of the request's state group, the block vLLM
resumes from for an (asynchronous) external hit of ``N`` tokens.

A prefill step may also end, or begin, inside a block: vLLM cuts one at the
prompt's last ``prefix_match_unit`` boundary before its last token (with
partial prefix hits), and resumes one where a hit ended. The state there is in
block ``ceil(N / B) - 1`` too, until the next step's forward overwrites it;
vLLM copies it out before that forward and offers the copy to producers, where
a handed-off prompt's state is read (:mod:`.handoff`, ``SchedulerSide``).

States are keyed chunks (:mod:`kvengine.keyed`) in a namespace of their own,
keyed by the prefix hash of the tokens before the boundary (the chunk's hash
where it is a chunk boundary), so they go through the same tiers, record
format and verification as the chunks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvengine.chunks.hashing import prefix_end_hash, prefix_hashes
from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
from kvengine.facade import KVEngine
from kvengine.keyed import SyncKeyedStore, keyed_namespace
from kvengine.transport import ReadScope
from kvengine.types import ModelBinding

from .layout import BlockIds, GroupPlan, PagedLayout

#: Key scheme of the state namespace (see :func:`kvengine.keyed.keyed_namespace`).
STATE_SCHEME = "vllm-boundary-state"

BoundaryState = tuple[torch.Tensor, ...]


def state_block(group: GroupPlan, block_ids: BlockIds, boundary: int, null: int) -> int | None:
    """The block of the request's state group that holds (or receives) the state at ``boundary``."""
    blocks = block_ids[group.group_id]
    index = -(-boundary // group.block_size) - 1
    return blocks[index] if 0 <= index < len(blocks) and blocks[index] != null else None


class BoundaryStates:
    """Store, find and install per-layer recurrent states at chunk boundaries (see the module docs)."""

    def __init__(self, engine: KVEngine, layout: PagedLayout, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.engine = engine
        self._chunk = layout.chunk.chunk_size
        self._layers = layout.states
        self._caches = [kv_caches[t.layer] for t in layout.states]
        self._layout = ChunkLayout(self._chunk, tuple(
            TensorSpec(name=t.layer, group=t.group_id, category=KVCategory.LINEAR_STATE, dtype=torch.uint8,
                       shape=(t.nbytes,), token_dim=None) for t in layout.states))
        self._stores: dict[bytes, SyncKeyedStore] = {}

    def binding(self, binding: ModelBinding) -> ModelBinding:
        """The states' binding beside the chunks' ``binding``."""
        return self._store(binding).binding

    def _store(self, binding: ModelBinding) -> SyncKeyedStore:
        store = self._stores.get(binding.digest)
        if store is None:
            keyed = self.engine.bind(keyed_namespace(binding.namespace, STATE_SCHEME), self._layout)
            store = self._stores[binding.digest] = SyncKeyedStore(self.engine, keyed)
        return store

    def _keys(self, binding: ModelBinding, tokens: np.ndarray, boundaries: list[int]) -> list[bytes]:
        """Chunk boundaries: the chunk's chain hash; another boundary: that of the partial chunk before it."""
        if any(b % self._chunk for b in boundaries):
            return [bytes(prefix_end_hash(tokens, self._chunk, binding.digest, b)) for b in boundaries]
        hashes = prefix_hashes(tokens[: max(boundaries)], self._chunk, binding.digest)
        return [bytes(hashes[b // self._chunk - 1]) for b in boundaries]

    def _views(self, block_id: int) -> list[torch.Tensor]:
        return [cache[block_id].view(-1)[: t.nbytes].view(torch.uint8) for cache, t in zip(self._caches, self._layers)]

    def save(self, binding: ModelBinding, tokens: np.ndarray, block_id: int) -> bool:
        """Store the state at ``len(tokens)`` held in ``block_id``."""
        (key,) = self._keys(binding, tokens, [len(tokens)])
        views = self._views(block_id)
        return self._store(binding).put([key], lambda _i: views)[0].ok

    def find(self, binding: ModelBinding, tokens: np.ndarray, limit: int) -> tuple[int, BoundaryState | None]:
        """The largest chunk boundary ``N <= limit`` whose state is stored, and a copy of that state
        (``(0, None)`` if none). The copy is the caller's: later evictions cannot change it."""
        boundaries = list(range(limit // self._chunk * self._chunk, 0, -self._chunk))
        if not boundaries:
            return 0, None
        keys = self._keys(binding, tokens, boundaries)
        for n, key, present in zip(boundaries, keys, self._store(binding).exists(keys)):
            if present and (state := self._get(binding, key, None)) is not None:
                return n, state
        return 0, None

    def at(self, binding: ModelBinding, tokens: np.ndarray, boundary: int,
           reads: ReadScope | None = None) -> BoundaryState | None:
        """A copy of the state at exactly ``boundary`` (any position), read as ``reads`` says; None: not
        stored, or it did not verify."""
        (key,) = self._keys(binding, tokens, [boundary])
        return self._get(binding, key, reads)

    def _get(self, binding: ModelBinding, key: bytes, reads: ReadScope | None) -> BoundaryState | None:
        got: list[BoundaryState] = []

        def keep(_i: int, tensors: Sequence[torch.Tensor]) -> None:
            got.append(tuple(t.clone() for t in tensors))

        return got[0] if self._store(binding).get([key], keep, reads=reads)[0].ok else None

    def install(self, state: BoundaryState, block_id: int) -> None:
        """Write a found state into ``block_id`` of the request's state group."""
        for view, tensor in zip(self._views(block_id), state):
            view.copy_(tensor)
