"""Copies between vLLM's paged KV caches and kvengine chunks, page by page.

A chunk of ``chunk_size`` tokens covers ``chunk_size / kernel_tokens``
kernel pages of every attention layer (see :mod:`.layout`). Position ``t``
of a request lives in vLLM block ``block_ids[group][t // block_size]``,
kernel page ``block * ratio + (t % block_size) // kernel_tokens``.

Blocks vLLM replaced by its *null block* (sliding-window groups drop blocks
that fell out of the window) are never written; when storing, they are
zero-filled for sliding-window layers (no load can need them: a load that
reaches past a chunk only reads the window before its own end) and make the
chunk unstorable for full-attention and MLA layers (:class:`MissingPage`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .layout import BlockIds, PagedLayout, PagedTensor


class MissingPage(Exception):
    """A page a chunk needs is not held by the request (freed by vLLM)."""


def _as_index(ids: list[int]) -> torch.Tensor | slice:
    """A slice when ``ids`` are consecutive (a view, no gather), else an index tensor."""
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])):
        return slice(ids[0], ids[-1] + 1)
    return torch.tensor(ids, dtype=torch.long)


class PagedCopier:
    """Moves one request's chunks in and out of the registered per-layer caches."""

    def __init__(self, layout: PagedLayout, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.layout = layout
        self._caches = [kv_caches[t.layer] for t in layout.tensors]
        self._block_size = {g.group_id: g.block_size for g in layout.groups}
        self._chunk = layout.chunk.chunk_size

    # -- pages of one chunk --------------------------------------------------------------
    def _pages(self, t: PagedTensor, start: int, block_ids: BlockIds,
               null: int, lo: int, hi: int) -> tuple[list[int], list[int]]:
        """(chunk page numbers, cache page numbers) of tokens [lo, hi) in the chunk starting at ``start``."""
        bs = self._block_size[t.group_id]
        kt = bs // t.kernel_ratio
        blocks = block_ids[t.group_id]
        src, dst = [], []
        for j in range(t.pages):
            pos = start + j * kt
            if pos < lo or pos >= hi:
                continue
            index = pos // bs
            if index >= len(blocks):
                raise MissingPage(f"{t.layer}: no block for position {pos} ({len(blocks)} blocks)")
            block = blocks[index]
            if block == null:
                if t.kind.every_block:
                    raise MissingPage(f"{t.layer}: block of position {pos} was freed")
                continue
            src.append(j)
            dst.append(block * t.kernel_ratio + (pos % bs) // kt)
        return src, dst

    def device(self, i: int) -> torch.device:
        """Where tensor ``i``'s cache lives (a gather's destination must be there too)."""
        return self._caches[i].device

    def usable_chunks(self, ranges: Sequence[tuple[int, int]], block_ids: BlockIds, null: int) -> int:
        """How many of the chunks of token ``ranges`` (in order; a tail's is shorter) hold every page a
        store needs.

        The first chunk that lacks one ends the count: a later chunk is
        unreachable without it.
        """
        for n, (start, end) in enumerate(ranges):
            try:
                for t in self.layout.tensors:
                    self._pages(t, start, block_ids, null, start, end)
            except MissingPage:
                return n
        return len(ranges)

    def gather_into(self, i: int, start: int, block_ids: BlockIds, null: int, out: torch.Tensor, *,
                    end: int | None = None) -> None:
        """Copy tensor ``i``'s pages of the chunk starting at token ``start`` into ``out``; with ``end``, only
        the pages holding tokens before it (a tail, :mod:`kvengine.core.tails`, or a handed-off prompt's
        partial last chunk, :mod:`.handoff`).

        Pages of freed sliding-window blocks, and pages from ``end`` on, are zero-filled.

        :raises MissingPage: if a full-attention or MLA page is gone (see :meth:`usable_chunks`).
        """
        t, cache = self.layout.tensors[i], self._caches[i]
        src, dst = self._pages(t, start, block_ids, null, start, start + self._chunk if end is None else end)
        n = len(src)
        if src == list(range(n)):  # every page up to ``end`` (a whole chunk, or a tail): no scatter
            idx = _as_index(dst)
            head = out[:n]
            if isinstance(idx, slice):
                head.copy_(cache[idx])
            elif n:
                torch.index_select(cache, 0, idx, out=head)
            out[n:].zero_()
            return
        out.zero_()
        out[torch.tensor(src)] = cache.index_select(0, torch.tensor(dst))

    def scatter_tensor(self, i: int, tensor: torch.Tensor, start: int, block_ids: BlockIds, null: int, lo: int,
                       hi: int) -> None:
        """Write the pages of ``tensor`` (tensor ``i`` of the chunk starting at token ``start``) that hold
        tokens in ``[lo, hi)`` into the request's blocks."""
        t, cache = self.layout.tensors[i], self._caches[i]
        src, dst = self._pages(t, start, block_ids, null, lo, hi)
        if not src:
            return
        d, s = _as_index(dst), _as_index(src)
        if isinstance(d, slice):
            cache[d].copy_(tensor[s] if isinstance(s, slice) else tensor.index_select(0, s))
        else:
            cache.index_copy_(0, d, tensor[s] if isinstance(s, slice) else tensor.index_select(0, s))


def blocks_in_range(block_ids: BlockIds, block_size: Mapping[int, int], groups: Sequence[int], lo: int,
                    hi: int, null: int) -> set[int]:
    """Block ids (of ``groups``) holding tokens ``[lo, hi)``."""
    out: set[int] = set()
    for g in groups:
        bs = block_size[g]
        for index in range(lo // bs, min(len(block_ids[g]), -(-hi // bs))):
            if block_ids[g][index] != null:
                out.add(block_ids[g][index])
    return out
