"""Values that cross the engine's API: bindings, chunk views and results."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from kvengine.chunks.keys import ChunkKey, Namespace, NamespaceDigest
from kvengine.chunks.layout import ChunkLayout
from kvengine.errors import InvalidRequestError
from kvengine.trust.quarantine import root_digest


@dataclass(frozen=True, slots=True)
class ModelBinding:
    """A model's namespace and chunk layout, validated by :meth:`CacheEngine.bind`."""

    namespace: Namespace
    layout: ChunkLayout
    #: Seeds the hash chain: the namespace digest combined with the layout
    #: fingerprint, so chunks of different layouts never meet.
    digest: NamespaceDigest
    #: The namespace's model identity, the unit of quarantine (:func:`~kvengine.trust.quarantine.root_digest`).
    root: str = ""
    #: Tokens per tail step: a store also keeps the partial chunk up to its last whole step, so hits end
    #: there (:mod:`kvengine.core.tails`); 0: whole chunks only. Not part of the digest: a tail's key is the
    #: hash of its exact tokens, whoever stored it.
    tail_step: int = 0

    @classmethod
    def create(cls, namespace: Namespace, layout: ChunkLayout, tail_step: int = 0) -> ModelBinding:
        seed = xxhash.xxh3_128_digest(namespace.digest() + layout.fingerprint.encode())
        return cls(namespace, layout, NamespaceDigest(seed), root_digest(namespace), tail_step)

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    def require_block_multiple(self, block_size: int) -> None:
        """Refuse to attach when chunks do not align with an engine's KV blocks/pages."""
        if block_size <= 0 or self.chunk_size % block_size:
            raise InvalidRequestError(
                f"chunk_size {self.chunk_size} must be a positive multiple of the engine's "
                f"block size {block_size}; set chunk_size to e.g. {max(block_size, 1) * max(1, self.chunk_size // max(block_size, 1))}"
            )


@dataclass(frozen=True, slots=True)
class ChunkView:
    """One reserved chunk handed to a load sink.

    ``tensors`` are views of host memory in layout order, valid only for the
    duration of the sink call: copy out, do not keep references.
    """

    index: int
    key: ChunkKey
    token_range: tuple[int, int]
    tensors: tuple[torch.Tensor, ...]
    layout: ChunkLayout


#: ``source(chunk_index, token_start, token_end)`` returns a chunk's tensors, or None to end the store
#: there (the chunks before it are stored; the source is not called again).
ChunkSource = Callable[[int, int, int], Sequence[torch.Tensor] | None]
#: ``sink(view)`` copies one chunk out of the cache.
ChunkSink = Callable[[ChunkView], None]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load delivered. Tokens from ``loaded_tokens`` on must be recomputed (those before a reservation's
    ``first_token`` are the caller's own: a lookup ``from_token``)."""

    promised_tokens: int
    loaded_tokens: int
    failed_chunks: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.loaded_tokens == self.promised_tokens

    @property
    def failed_token_range(self) -> tuple[int, int] | None:
        return None if self.ok else (self.loaded_tokens, self.promised_tokens)


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Chunks of a store: newly stored, already cached, and not stored (no room, or left unfilled).

    ``tier_failures``: of the stored chunks, how many did not reach every lower tier (known only in
    ``write_through`` mode, where a store returns once each chunk's tier writes ended; such a chunk
    is in memory only).
    """

    stored_chunks: int
    present_chunks: int
    rejected_chunks: int
    tier_failures: int = 0
