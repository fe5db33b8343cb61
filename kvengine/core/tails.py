"""Tails: hits that end at an engine's last whole block, not at the last whole chunk.

Only whole chunks match a longer prompt (:mod:`kvengine.chunks.hashing`), so a
hit ends at the last whole chunk and the 0 to ``chunk_size - 1`` tokens after
it are recomputed, every turn of a chat. A binding with a ``tail_step`` (an
inference engine's block size, a proper divisor of the chunk size) also
stores, after a prompt's whole chunks, its **tail**: the partial chunk up to
the last whole step, a record keyed as ``prefix_hashes(..., partial=True)``
keys it (the chain hash of its exact tokens). A lookup whose chain of whole
chunks breaks at chunk ``c`` then asks for chunk ``c``'s tails, longest
first, so the hit ends at the last whole block some earlier request stored.

Invariants:

* a tail is found only by a prompt holding its exact tokens at its exact
  positions after the same chain of chunks (its key is their hash);
* storing a chunk supersedes its shorter tails (a whole chunk: all of them):
  they are discarded from memory when it is committed, where nothing pins
  them (the upgrade). Lower tiers keep them until their own eviction;
* a tail takes a whole chunk's slot in memory (one size class per layout,
  :meth:`~kvengine.core.memory_tier.MemoryTier.prepare`), so each request
  leaves at most one such slot: its last.

A tail memory lacks is looked for in the lower tiers (which keep superseded
tails), so a hit does not depend on what memory happens to hold: the lookup
then takes the engine's loop, as a promotion of chunks does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvengine.chunks.hashing import TokenInput, chunk_tails, prefix_hashes, tail_hashes, token_bytes
from kvengine.chunks.keys import ChunkHash, ChunkKey
from kvengine.types import ChunkView, ModelBinding


def stored_extent(binding: ModelBinding, n_tokens: int) -> int:
    """How many of ``n_tokens`` a store covers: all of them without a tail step, else down to a whole step."""
    step = binding.tail_step
    return n_tokens // step * step if step else n_tokens


def store_hashes(binding: ModelBinding, tokens: TokenInput, partial: bool) -> tuple[list[ChunkHash], int]:
    """The chain hashes a store of ``tokens`` keys its chunks by, tail last, and the tokens they cover.

    ``partial``: the engine's ``store_partial_chunks`` (a trailing partial chunk of any length; without a
    tail step)."""
    if not binding.tail_step:
        hashes = prefix_hashes(tokens, binding.chunk_size, binding.digest, partial=partial)
        return hashes, min(len(tokens), len(hashes) * binding.chunk_size)
    end = stored_extent(binding, len(tokens))
    if end == 0:
        return [], 0
    return prefix_hashes(tokens, binding.chunk_size, binding.digest, partial=True, max_tokens=end), end


def candidates(binding: ModelBinding, tokens: TokenInput, hashes: Sequence[ChunkHash], chunk: int,
               asked: int) -> list[tuple[int, ChunkKey]]:
    """The tails of chunk number ``chunk`` a lookup of ``asked`` tokens may use, longest first: (end, key).

    ``hashes``: the prompt's whole chunks' chain hashes (at least the ``chunk`` before it)."""
    return [(end, ChunkKey(binding.digest, h)) for end, h in
            chunk_tails(tokens, hashes, binding.digest, binding.chunk_size, binding.tail_step, chunk, asked)]


def superseded(binding: ModelBinding, tokens: TokenInput, hashes: Sequence[ChunkHash],
               chunks: Sequence[ChunkView]) -> tuple[tuple[ChunkKey, ...], ...]:
    """Per staged chunk, the shorter tails of the same chunk it supersedes once committed (see the module
    docs); empty without a tail step."""
    step, size = binding.tail_step, binding.chunk_size
    if not step:
        return tuple(() for _ in chunks)
    tokens = np.frombuffer(token_bytes(tokens), dtype="<u4")  # validated and converted once, not per chunk
    out = []
    for view in chunks:
        start, end = view.token_range
        ends = list(range(start + step, end, step))
        parent = hashes[start // size - 1] if start else binding.digest
        out.append(tuple(ChunkKey(binding.digest, h) for h in tail_hashes(tokens, parent, start, ends))
                   if ends else ())
    return tuple(out)
