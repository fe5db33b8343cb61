"""Layer-by-layer copies between vLLM's paged caches and kvengine chunks, between or beside the forward's layers.

Where the KV cache lives on an accelerator, one background thread runs a step's copies in the order they
were queued, overlapping the forward. Where it lives in host memory (vLLM's CPU backend), the copies run
in the calling thread instead, as they are queued: there the forward's OpenMP threads hold every core, and
a copy thread beside them takes one, so the forward's other threads wait for it at their next barrier
(measured with ``benchmarks/step_timeline.py``: cold prompts ran 5.6% longer, the machine idle 6.7% of the
run against 0.01% without the connector). In the calling thread a copy uses the cores the forward just
released, and the order of copies is the same.

A *stage* is one cached tensor of the chunk layout: one layer's pages (or
several layers' when they share a cache). Every load stage is queued when
the step starts, in forward order, so the forward computes layer ``l``
while layer ``l + 1`` is copied in; ``wait_layer`` blocks only until the
layer about to run is in. Save stages are queued as the forward finishes
each layer (``save_kv_layer``) and copy that layer's pages of the step's
complete chunks into staged engine slots. Since loads are queued first, a
save never reads a block a load of the same step is still writing.

``end_loads`` and ``end_saves`` wait for everything queued, so no copy
outlives its step (vLLM may hand the blocks to another request next step).
A failing copy never raises into the forward: it marks that chunk and every
later chunk of the request failed, whatever the layer.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from kvengine.core.staging import StagedStore
from kvengine.lookups import LookupResult
from kvengine.threads import executor
from kvengine.types import ChunkView

from .paging import PagedCopier

if TYPE_CHECKING:  # importable without vLLM (unit tests in the main environment)
    from .copy_specs import LoadSpec, SaveSpec
    from .handoff import PromptTail
    from .replica import LatentBroadcast

logger = logging.getLogger("vllm.kvengine")

_J = TypeVar("_J")


@dataclass(eq=False)
class LoadJob:
    """One request's load this step: its hit's views, and how many chunks every stage copied."""

    spec: LoadSpec
    hit: LookupResult | None
    views: tuple[ChunkView, ...]
    null_block_id: int
    #: hybrid models: the recurrent state at the hit's end (installed by the worker once all pages are in)
    state: tuple[torch.Tensor, ...] | None = None
    #: a handed-off prompt's partial last chunk, after the views (:mod:`.handoff`)
    tail: PromptTail | None = None
    loaded: int = 0
    #: whether every stage copied the tail in
    tail_loaded: bool = True

    def __post_init__(self) -> None:
        self.loaded = len(self.views)

    @classmethod
    def mirrored(cls, spec: LoadSpec, null_block_id: int) -> LoadJob:
        """A job on a rank that loads the chunks rank 0 sends it (:mod:`.replica`): as many as come."""
        job = cls(spec, None, (), null_block_id)
        job.loaded = sys.maxsize
        return job


@dataclass(eq=False)
class SaveJob:
    """One request's save this step: staged slots, of which the first ``filled`` get every stage."""

    spec: SaveSpec
    staged: StagedStore
    null_block_id: int
    filled: int


class LayerPipeline:
    """Runs the copies of one step at a time, on a background thread or in line (see the module docs)."""

    def __init__(self, copier: PagedCopier, forward_order: Sequence[int],
                 broadcast: LatentBroadcast | None = None, *, beside_forward: bool | None = None) -> None:
        """``beside_forward``: copies on a background thread (default: where the caches are not in host
        memory; see the module docs)."""
        self._copier = copier
        self._order = tuple(forward_order)
        #: MLA under tensor parallelism: loads are shared from rank 0 (:mod:`.replica`)
        self._broadcast = broadcast
        if beside_forward is None:
            beside_forward = copier.device(0).type != "cpu"
        self._executor = executor(1, "kvengine-layers") if beside_forward else None
        self._loads: dict[int, Future[None]] = {}
        self._load_jobs: list[LoadJob] = []
        self._saves: dict[int, Future[None]] = {}
        self._save_jobs: list[SaveJob] | None = None

    @property
    def shares_loads(self) -> bool:
        """Whether loads are shared from rank 0 (MLA under tensor parallelism)."""
        return self._broadcast is not None

    # -- loads -------------------------------------------------------------------------
    def begin_loads(self, jobs: list[LoadJob]) -> None:
        """Queue every stage of ``jobs``, in forward order."""
        self._load_jobs = jobs
        self._loads = {i: self._submit(self._load_stage, i, jobs) for i in self._order}

    def wait_layer(self, stage: int | None) -> bool:
        """Block until ``stage`` is loaded (None: every stage); whether there was a load to wait for."""
        futures = list(self._loads.values()) if stage is None else [self._loads[stage]] if stage in self._loads else []
        for future in futures:
            future.result()
        return bool(futures)

    def end_loads(self) -> list[LoadJob]:
        """Wait for the step's loads; their jobs, with final counts (and forget them)."""
        self.wait_layer(None)
        jobs, self._load_jobs, self._loads = self._load_jobs, [], {}
        return jobs

    def _load_stage(self, i: int, jobs: list[LoadJob]) -> None:
        if self._broadcast is not None:
            self._broadcast.load_stage(i, jobs, self._copy_in)
            return
        for job in jobs:
            for view in job.views[: job.loaded]:
                if view.token_range[1] > job.spec.start and not self._copy_in(i, job, view.tensors[i],
                                                                               view.token_range[0]):
                    job.loaded = min(job.loaded, view.index)
                    break
            tail = job.tail
            if tail is not None and job.tail_loaded and job.loaded == len(job.views) and tail.end > job.spec.start:
                job.tail_loaded = self._copy_in(i, job, tail.tensors[i], tail.start)

    def _copy_in(self, i: int, job: LoadJob, tensor: torch.Tensor, start: int) -> bool:
        """Stage ``i`` of the chunk starting at token ``start`` into the job's blocks (the part vLLM lacks)."""
        spec = job.spec
        try:
            self._copier.scatter_tensor(i, tensor, start, spec.block_ids, job.null_block_id, max(start, spec.start),
                                        min(start + self._copier.layout.chunk.chunk_size, spec.end))
        except Exception as exc:  # a fault is a recompute, never an error in the forward
            logger.warning("kvengine: load of %s failed at token %d (%s: %s); recomputed from there",
                           spec.request_id, start, type(exc).__name__, exc)
            return False
        return True

    # -- saves -------------------------------------------------------------------------
    @property
    def saves_begun(self) -> bool:
        """Whether this step's save jobs are set (:meth:`begin_saves`), until :meth:`end_saves`."""
        return self._save_jobs is not None

    def begin_saves(self, jobs: list[SaveJob]) -> None:
        self._save_jobs = jobs

    def save_layer(self, stage: int | None) -> bool:
        """Queue the copy of ``stage`` (the layer the forward just finished) into the staged slots;
        whether it was queued now (not before, and there are saves)."""
        if stage is None or stage in self._saves or not self._save_jobs:
            return False
        self._saves[stage] = self._submit(self._save_stage, stage, self._save_jobs)
        return True

    def end_saves(self) -> tuple[list[SaveJob], int]:
        """Queue the stages no ``save_layer`` asked for, wait for all; the jobs (now forgotten) and
        how many stages were left for this call."""
        late = sum(self.save_layer(stage) for stage in self._order)
        for future in self._saves.values():
            future.result()
        jobs, self._save_jobs, self._saves = self._save_jobs or [], None, {}
        return jobs, late

    def _save_stage(self, i: int, jobs: list[SaveJob]) -> None:
        for job in jobs:
            for n, view in enumerate(job.staged.chunks[: job.filled]):
                try:
                    self._copier.gather_into(i, view.token_range[0], job.spec.block_ids, job.null_block_id,
                                             view.tensors[i], end=view.token_range[1])
                except Exception as exc:
                    logger.warning("kvengine: save of %s stopped at chunk %d (%s: %s)",
                                   job.spec.request_id, view.index, type(exc).__name__, exc)
                    job.filled = n
                    break

    def _submit(self, stage: Callable[[int, list[_J]], None], i: int, jobs: list[_J]) -> Future[None]:
        """Run ``stage(i, jobs)`` on the copy thread, or here and now (a done future) without one."""
        if self._executor is not None:
            return self._executor.submit(stage, i, jobs)
        done: Future[None] = Future()
        try:
            stage(i, jobs)
            done.set_result(None)
        except Exception as exc:  # delivered at result(), where the copy thread's would be
            done.set_exception(exc)
        return done

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
