"""LayerPipeline: layer-by-layer loads and saves between paged caches and engine chunks (no engine process)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvengine import KVEngine, Namespace
from kvengine.integrations.vllm.copy_specs import LoadSpec, SaveSpec
from kvengine.integrations.vllm.paging import PagedCopier
from kvengine.integrations.vllm.pipeline import LayerPipeline, LoadJob, SaveJob

from .test_vllm_units import CHUNK, RATIO, fill, make_layout

TOKENS = list(range(2 * CHUNK))
SRC = ((1, 2, 3, 4), (5, 6, 7, 8))
DST = ((10, 11, 12, 13), (0, 0, 14, 15))  # out-of-window sliding blocks are null (0)


@pytest.fixture(params=[False, True], ids=["in-line", "beside"])
def beside(request):
    """Copies in the calling thread (host-memory caches) or on the copy thread (accelerator caches)."""
    return request.param


@pytest.fixture
def setup():
    layout, caches = make_layout()
    fill(caches["full"])
    copier = PagedCopier(layout, caches)
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"}}, transports=[]) as eng:
        yield layout, caches["full"], copier, eng, eng.bind(Namespace(model="pipeline"), layout.chunk)


def save(eng, binding, pipe: LayerPipeline, copier: PagedCopier, layers_done=()) -> SaveJob:
    staged = eng.begin_store(binding, TOKENS)
    usable = copier.usable_chunks([v.token_range for v in staged.chunks], SRC, 0)
    spec = SaveSpec(request_id="s", salt="", tokens=np.array(TOKENS, dtype="<u4").tobytes(), block_ids=SRC)
    pipe.begin_saves([SaveJob(spec, staged, 0, usable)])
    for stage in layers_done:
        assert pipe.save_layer(stage)
    (job,), late = pipe.end_saves()
    assert late == 2 - len(layers_done)  # make_layout has two stages
    eng.commit_store(job.staged, job.filled)
    return job


def load(eng, binding, pipe: LayerPipeline) -> LoadJob:
    res = eng.lookup(binding, "l", TOKENS)
    spec = LoadSpec(request_id="l", salt="", start=0, end=res.tokens, block_ids=DST,
                             asynchronous=False)
    pipe.begin_loads([LoadJob(spec, res, eng.begin_load(res), 0)])
    assert pipe.wait_layer(0)
    (job,) = pipe.end_loads()
    eng.finish_load(res, job.loaded)
    return job


def test_pages_saved_layer_by_layer_load_back_into_other_blocks(setup, beside):
    """Pages saved layer by layer (some during the forward, the rest at the end) load into other blocks stage by
    stage in forward order: full attention whole, the sliding window only within the window; no pin left."""
    layout, backing, copier, eng, binding = setup
    order: list[int] = []
    scatter = copier.scatter_tensor

    def recording(i, *args):
        order.append(i)
        scatter(i, *args)

    copier.scatter_tensor = recording  # type: ignore[method-assign]
    pipe = LayerPipeline(copier, forward_order=[1, 0], beside_forward=beside)
    try:
        job = save(eng, binding, pipe, copier, layers_done=[1])
        assert job.filled == 2
        job = load(eng, binding, pipe)
        assert not pipe.wait_layer(0)  # nothing left to wait for once the step's loads ended
    finally:
        pipe.close()
    assert job.loaded == 2
    assert order == [1, 1, 0, 0]  # stage by stage, in forward order
    assert torch.equal(backing[10 * RATIO:14 * RATIO], backing[1 * RATIO:5 * RATIO])  # full attention
    assert torch.equal(backing[14 * RATIO:16 * RATIO], backing[7 * RATIO:9 * RATIO])  # window of chunk 1
    assert eng._core.memory.total_pins() == 0


def test_a_failing_layer_copy_fails_that_chunk_and_later_ones_without_raising(setup, beside):
    """A layer copy failing on chunk 1 loads only chunk 0 (counted), raises nothing and leaves no pin."""
    layout, backing, copier, eng, binding = setup
    pipe = LayerPipeline(copier, forward_order=[0, 1], beside_forward=beside)
    try:
        save(eng, binding, pipe, copier)
        scatter = copier.scatter_tensor

        def failing(i, tensor, start, *args):
            if i == 1 and start == CHUNK:
                raise OSError("injected")
            scatter(i, tensor, start, *args)

        copier.scatter_tensor = failing  # type: ignore[method-assign]
        job = load(eng, binding, pipe)
    finally:
        pipe.close()
    assert job.loaded == 1
    assert eng.metrics.value("kvengine_loaded_tokens_total") == CHUNK
    assert eng._core.memory.total_pins() == 0


def test_a_failing_save_copy_commits_only_the_chunks_before_it(setup, beside):
    """A save copy failing on chunk 1 commits only chunk 0; the unfilled chunk is never published."""
    layout, backing, copier, eng, binding = setup
    gather_into = copier.gather_into

    def failing(i, start, *args, **kwargs):
        if start == CHUNK:
            raise RuntimeError("injected")
        gather_into(i, start, *args, **kwargs)

    copier.gather_into = failing  # type: ignore[method-assign]
    pipe = LayerPipeline(copier, forward_order=[0, 1], beside_forward=beside)
    try:
        assert save(eng, binding, pipe, copier).filled == 1
    finally:
        pipe.close()
    res = eng.lookup(binding, "check", TOKENS)
    assert res.tokens == CHUNK  # the unfilled chunk was never published
    eng.release(res)


def test_saves_of_a_chunk_whose_pages_were_freed_stop_there(setup):
    """A chunk whose full-attention block was freed cannot be saved, and neither can any chunk after it."""
    layout, backing, copier, eng, binding = setup
    staged = eng.begin_store(binding, TOKENS)
    holes = ((1, 2, 0, 4), (5, 6, 7, 8))  # full-attention block of chunk 1 freed
    assert copier.usable_chunks([v.token_range for v in staged.chunks], holes, 0) == 1
    eng.commit_store(staged, 0)


def test_copies_run_in_the_calling_thread_for_host_memory_caches_and_beside_it_otherwise(setup):
    """vLLM's CPU backend: a copy thread would take a core from the forward's OpenMP threads, so with host
    memory caches (the default derived from the caches' device) copies run where they are queued."""
    layout, _, copier, eng, _ = setup
    threads: list[str] = []
    gather = copier.gather_into

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        gather(*args, **kwargs)

    copier.gather_into = recording  # type: ignore[method-assign]
    seen = {}
    for beside_forward in (None, True):
        pipe = LayerPipeline(copier, forward_order=[0, 1], beside_forward=beside_forward)
        try:
            binding = eng.bind(Namespace(model=f"pipeline-{beside_forward}"), layout.chunk)  # nothing stored yet
            save(eng, binding, pipe, copier, layers_done=[0])
        finally:
            pipe.close()
        seen[beside_forward], threads[:] = set(threads), []
    assert seen[None] == {threading.current_thread().name}
    assert len(seen[True]) == 1 and next(iter(seen[True])).startswith("kvengine-layers")
