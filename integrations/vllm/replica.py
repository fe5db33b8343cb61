"""MLA under tensor parallelism: one stored copy of the latent, loaded by every rank.

MLA's latent cache is not sharded across tensor-parallel ranks: every rank
computes the same pages, from replicated projections of an all-reduced
input. So one copy is enough. Rank 0 alone runs a cache engine: it stores,
answers the scheduler and holds the reservations. When it loads a hit, it
sends each chunk it copies into its own pages to the other ranks (a
broadcast over a private gloo group), and they copy it into theirs.

Why the copies agree: the latent is byte-identical on every rank at
``tensor_parallel_size=2`` (a two-term all-reduce sums the same two values on
both ranks), which the TP=2 end-to-end test confirms as outputs equal to vLLM
without the connector. With more ranks the all-reduce may add the partial
sums in another order on each rank; that is not proven, so it is refused
(:func:`~.connector.check_tensor_parallel`).

Collective order: every rank gets the same step metadata, so it builds the
same load jobs and runs their stages in the same forward order on its
pipeline thread. Per stage, rank 0 broadcasts a header (per job: how many
chunks it sends, the first one's start, the last one's end), then all of
those chunks packed in one buffer. A rank whose copy of a chunk fails stops
copying that job and reports the blocks from that chunk on; vLLM takes the
union of every rank's failed blocks and recomputes them on all ranks. A failed
broadcast (a peer gone, :data:`GROUP_TIMEOUT` passed) ends sharing for good:
this rank copies nothing more, and rank 0 then answers every lookup with a
miss (:attr:`LatentBroadcast.broken`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from kvengine.chunks.layout import ChunkLayout

if TYPE_CHECKING:
    from .pipeline import LoadJob

logger = logging.getLogger("vllm.kvengine")

#: how long a rank waits for a broadcast before it gives sharing up (a peer that is gone)
GROUP_TIMEOUT = timedelta(seconds=60)

#: ``copy_in(stage, job, tensor, chunk_start) -> ok``: one chunk's pages of one stage into the job's blocks
CopyIn = Callable[[int, "LoadJob", torch.Tensor, int], bool]


class LatentBroadcast:
    """Rank 0's loaded chunks, shared with the other tensor-parallel ranks (see the module docs).

    ``group`` is a gloo process group over every rank (:meth:`create`); ``rank`` is this process's
    rank in it, and rank 0 is the source. Used from the pipeline thread only.
    """

    def __init__(self, group: Any, rank: int, layout: ChunkLayout) -> None:
        self._group = group
        self.rank = rank
        self._layout = layout
        #: a broadcast failed: nothing is shared any more (rank 0 serves no hit)
        self.broken = False

    @classmethod
    def create(cls, rank: int, layout: ChunkLayout, timeout: timedelta = GROUP_TIMEOUT) -> LatentBroadcast:
        """A private gloo group over all ranks. Every rank must call this, in the same order relative to
        every other group vLLM creates (``register_kv_caches`` runs at the same point on every worker).
        It is never used from vLLM's own threads, whose collectives on its groups it would otherwise
        interleave with."""
        import torch.distributed as dist

        return cls(dist.new_group(backend="gloo", timeout=timeout), rank, layout)

    @property
    def is_source(self) -> bool:
        return self.rank == 0

    def _share(self, tensor: torch.Tensor) -> bool:
        """Broadcast ``tensor`` from rank 0 (in place on the others); False once sharing is broken."""
        if self.broken:
            return False
        import torch.distributed as dist

        try:
            dist.broadcast(tensor, group=self._group, group_src=0)
        except Exception as exc:  # a peer gone or timed out: never raised into the forward
            self.broken = True
            logger.error("kvengine: sharing MLA chunks between tensor-parallel ranks failed (%s: %s); rank %d "
                         "loads nothing more from the cache", type(exc).__name__, exc, self.rank)
            return False
        return True

    def _header(self, stage: int, jobs: Sequence[LoadJob]) -> list[tuple[int, int, int]] | None:
        """Per job (count, first chunk's start, last chunk's end) of the chunks rank 0 sends at ``stage``."""
        rows = [(0, 0, 0)] * len(jobs)
        if self.is_source:
            rows = [self._sendable(stage, job) for job in jobs]
        header = torch.tensor(rows, dtype=torch.int64).reshape(len(jobs), 3)
        return [tuple(r) for r in header.tolist()] if self._share(header) else None

    def _sendable(self, stage: int, job: LoadJob) -> tuple[int, int, int]:
        """What rank 0 sends of ``job`` at ``stage``: its loaded views past what vLLM already holds, up to the
        first whose shape is not the one the other ranks receive into (none are, for views of this layout)."""
        views = [v for v in job.views[: job.loaded] if v.token_range[1] > job.spec.start]
        count = 0
        for view in views:
            lo, hi = view.token_range
            if view.tensors[stage].shape != self._layout.shapes(hi - lo)[stage]:
                break
            count += 1
        return (count, views[0].token_range[0], views[count - 1].token_range[1]) if count else (0, 0, 0)

    def load_stage(self, stage: int, jobs: Sequence[LoadJob], copy_in: CopyIn) -> None:
        """Share and copy in ``stage`` of every job; cut each job's ``loaded`` (in chunks) to what this rank
        copied in whole. The stage's chunks travel as one broadcast (a few large messages move several times
        faster over gloo than many chunk-sized ones); rank 0 packs them, the others receive into one buffer.
        A failed copy stops only that job's copies on this rank: what is sent, and so every rank's next
        broadcast, never depends on a copy."""
        header = self._header(stage, jobs)
        chunk, dtype = self._layout.chunk_size, self._layout.tensors[stage].dtype
        plan = []  # (job, first chunk index, [(chunk start, shape)]) per job
        for n, job in enumerate(jobs):
            count, lo0, hi_last = header[n] if header is not None else (0, job.spec.start, 0)
            starts = [lo0 + k * chunk for k in range(count)]
            plan.append((job, lo0 // chunk, [(lo, self._layout.shapes(min(lo + chunk, hi_last) - lo)[stage])
                                              for lo in starts]))
        sizes = [shape.numel() for _, _, chunks in plan for _, shape in chunks]
        flat = self._pack(stage, plan, sum(sizes), dtype) if sizes else None
        received = flat is not None and self._share(flat)
        pieces = iter(flat.split(sizes) if received and flat is not None else ())
        for job, first, chunks in plan:
            copied = 0
            for k, (lo, shape) in enumerate(chunks):
                piece = next(pieces, None)
                if piece is None:
                    break
                tensor = job.views[first + k].tensors[stage] if self.is_source else piece.view(shape)
                if copied == k and copy_in(stage, job, tensor, lo):
                    copied += 1
            job.loaded = min(job.loaded, first + copied)

    def _pack(self, stage: int, plan: list[tuple[LoadJob, int, list[tuple[int, torch.Size]]]], numel: int,
              dtype: torch.dtype) -> torch.Tensor:
        """The stage's chunks in one buffer: rank 0 fills it from its views, the others receive into it."""
        flat = torch.empty(numel, dtype=dtype)
        if self.is_source:
            offset = 0
            for job, first, chunks in plan:
                for k, (_, shape) in enumerate(chunks):
                    flat[offset:offset + shape.numel()].view(shape).copy_(job.views[first + k].tensors[stage])
                    offset += shape.numel()
        return flat
