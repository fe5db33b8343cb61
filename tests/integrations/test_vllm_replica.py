"""LatentBroadcast: rank 0's loaded MLA chunks shared with another rank over a real gloo group (two processes).

No vLLM: each process builds an MLA-like paged layout, and its load jobs as the worker does (rank 0 from
chunk views, rank 1 as mirrored jobs), then runs the same steps on a LayerPipeline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvengine.chunks.layout import ChunkLayout, TensorSpec
from kvengine.integrations.vllm.layout import GroupKind, GroupPlan, PagedLayout, PagedTensor
from kvengine.integrations.vllm.paging import PagedCopier
from kvengine.integrations.vllm.pipeline import LayerPipeline, LoadJob
from kvengine.integrations.vllm.replica import LatentBroadcast
from kvengine.types import ChunkView

BS, CHUNK, WIDTH, BLOCKS = 4, 8, 6, 16
LAYERS = ("l0", "l1")
SRC_CHUNKS = 3
DST = ((10, 11, 12, 13, 14, 15),)  # the request's blocks: 3 chunks of 2 blocks
TIMEOUT = timedelta(seconds=3)


def mla_layout() -> tuple[PagedLayout, dict[str, torch.Tensor]]:
    group = GroupPlan(group_id=0, kind=GroupKind.MLA, block_size=BS, layer_names=LAYERS)
    pages = CHUNK // BS
    specs = tuple(TensorSpec(name=n, group=0, category=group.category, dtype=torch.bfloat16,
                             shape=(pages, BS, WIDTH), token_dim=None) for n in LAYERS)
    tensors = tuple(PagedTensor(layer=n, group_id=0, kind=GroupKind.MLA, kernel_ratio=1, pages=pages) for n in LAYERS)
    caches = {n: torch.zeros(BLOCKS, BS, WIDTH, dtype=torch.bfloat16) for n in LAYERS}
    return PagedLayout(ChunkLayout(CHUNK, specs), tensors, (group,), "test-mla", "fp"), caches


def expected_pages(step: int, chunk: int, layer: int) -> float:
    """The value of every element of a chunk's pages (distinct and exact in bf16)."""
    return float(10 * step + 3 * chunk + layer + 1)


def chunk_views(layout: ChunkLayout, step: int, chunks: int) -> tuple[ChunkView, ...]:
    """Rank 0's reserved chunks: distinct values per step, chunk and layer."""
    out = []
    for c in range(chunks):
        tensors = tuple(torch.full(s.shape, expected_pages(step, c, i), dtype=s.dtype)
                        for i, s in enumerate(layout.tensors))
        out.append(ChunkView(c, None, (c * CHUNK, (c + 1) * CHUNK), tensors, layout))  # type: ignore[arg-type]
    return tuple(out)


def spec(step: int, start: int = 0, end: int = SRC_CHUNKS * CHUNK) -> Any:
    return SimpleNamespace(request_id=f"r{step}", salt="", start=start, end=end, block_ids=DST, asynchronous=False)


#: steps run by both ranks: (name, start, end, chunks rank 0 holds, (rank, stage, chunk) whose copy fails)
STEPS = (
    ("whole", 0, 24, 3, None),
    ("vllm_holds_chunk_0", 8, 24, 3, None),
    ("rank0_copy_fails", 0, 24, 3, (0, 1, 1)),
    ("rank1_copy_fails", 0, 24, 3, (1, 0, 1)),
    ("rank0_holds_less", 0, 24, 1, None),
    ("after_faults", 0, 24, 3, None),
)


def _rank(rank: int, store: str, mode: str, out: Any) -> None:
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        layout, caches = mla_layout()
        copier = PagedCopier(layout, caches)
        broadcast = LatentBroadcast.create(rank, layout.chunk, timeout=TIMEOUT)
        pipe = LayerPipeline(copier, [0, 1], broadcast)
        if mode != "in_step" and rank == (1 if mode == "peer_gone" else 0):
            os._exit(0)  # this rank is gone before the first load (it reports nothing)
        scatter = copier.scatter_tensor
        report = []
        for n, (name, start, end, held, fault) in enumerate(STEPS if mode == "in_step" else STEPS[:2]):
            def copy(i: int, tensor: torch.Tensor, chunk_start: int, *args: Any, _fault: Any = fault) -> None:
                if _fault is not None and _fault == (rank, i, chunk_start // CHUNK):
                    raise OSError("injected copy fault")
                scatter(i, tensor, chunk_start, *args)

            copier.scatter_tensor = copy  # type: ignore[method-assign]
            for cache in caches.values():
                cache.zero_()
            s = spec(n, start, end)
            job = LoadJob(s, None, chunk_views(layout.chunk, n, held), -1) if rank == 0 else LoadJob.mirrored(s, -1)
            began = time.monotonic()
            pipe.begin_loads([job])
            (job,) = pipe.end_loads()
            report.append({"step": name, "loaded": job.loaded, "seconds": time.monotonic() - began,
                           "broken": broadcast.broken, "caches": {k: v.float().numpy().copy() for k, v in caches.items()}})  # no torch sharing
        pipe.close()
        out.put((rank, "ok", report))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(tmp_path: Path, mode: str) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), mode, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs if mode == "in_step" else procs[1:]:
        rank, status, report = out.get(timeout=120)
        assert status != "error", report
        results[rank] = report
    for p in procs:
        p.join(30)
    return results




def test_every_rank_copies_in_what_rank_0_loads_and_stays_in_step_through_copy_faults(tmp_path):
    """Rank 1 ends each step with rank 0's chunk pages in the same blocks (only the part vLLM lacks); a copy
    fault on either rank cuts only that rank's count (vLLM recomputes the union) while both keep receiving,
    so the steps after a fault still load whole on both; rank 0 holding less cuts rank 1 to the same."""
    r = run_ranks(tmp_path, "in_step")
    for n, (name, start, _end, held, fault) in enumerate(STEPS):
        r0, r1 = r[0][n], r[1][n]
        assert not r0["broken"] and not r1["broken"], name
        want = {0: held, 1: held}
        if fault is not None:
            want[fault[0]] = fault[2]
        assert (r0["loaded"], r1["loaded"]) == (want[0], want[1]), name
        for layer, key in enumerate(LAYERS):
            for rank, report in ((0, r0), (1, r1)):
                cache = torch.from_numpy(report["caches"][key])
                for c in range(SRC_CHUNKS):
                    blocks = cache[10 + 2 * c:12 + 2 * c]
                    copied = c * CHUNK >= start and c < held and not (
                        fault is not None and fault[0] == rank and (fault[1] == layer and c >= fault[2]))
                    value = expected_pages(n, c, layer) if copied else 0.0
                    if fault is not None and fault[0] == rank and fault[1] != layer and c >= fault[2]:
                        continue  # the other stage of a chunk past the fault: copied or not, it is recomputed
                    assert torch.all(blocks == value), (name, rank, key, c)


@pytest.mark.parametrize("gone", ["peer_gone", "source_gone"])
def test_a_rank_that_is_gone_makes_a_miss_within_the_timeout_never_a_hang(tmp_path, gone):
    """A peer gone before a load: the rank left times out (no hang), counts nothing as loaded, copies
    nothing, stops sharing for good (the next step returns at once)."""
    r = run_ranks(tmp_path, gone)
    alive = 0 if gone == "peer_gone" else 1
    first, second = r[alive]
    assert first["broken"] and second["broken"]
    assert (first["loaded"], second["loaded"]) == (0, 1)  # nothing past what vLLM holds (chunk 0, step 2)
    assert first["seconds"] < 30 and second["seconds"] < 1
    assert all((c == 0).all() for step in (first, second) for c in step["caches"].values())
