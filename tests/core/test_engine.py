"""CacheEngine: the scheduler contract (lookup / load / release / lease) and stores."""

from __future__ import annotations

import pytest
import torch

from kvengine import CacheEngine, CapacityError, InvalidRequestError, Namespace
from kvengine.errors import InvalidRequestError as IRE

from ..conftest import CHUNK, FakeKV, copier, make_config, make_layout


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def engine():
    clock = Clock()
    eng = CacheEngine(make_config(capacity=8 * make_layout().nbytes(), lease_seconds=10), clock=clock)
    eng.clock = clock  # type: ignore[attr-defined]
    await eng.start()
    yield eng
    await eng.close()


async def test_store_lookup_load_round_trip(engine, layout, namespace):
    """Stored full chunks come back bit-identical; the partial tail is not stored."""
    b = engine.bind(namespace, layout)
    kv = FakeKV(3 * CHUNK + 5)
    toks = list(range(3 * CHUNK + 5))
    st = await engine.store(b, toks, kv.source)
    assert (st.stored_chunks, st.present_chunks) == (3, 0)
    res = await engine.lookup(b, "r1", toks)
    assert res.tokens == 3 * CHUNK
    out = [torch.zeros_like(t) for t in kv.layers]
    result = await engine.load(res, copier(out))
    assert result.ok and result.loaded_tokens == 3 * CHUNK
    for o, k in zip(out, kv.layers):
        assert torch.equal(o[:, :, : 3 * CHUNK], k[:, :, : 3 * CHUNK])
    assert engine.memory.total_pins() == 0 and len(engine.reservations) == 0


async def test_lookup_is_idempotent(engine, layout, namespace):
    """Asking again returns the same reservation and pins/counts nothing twice."""
    b = engine.bind(namespace, layout)
    toks = list(range(2 * CHUNK))
    await engine.store(b, toks, FakeKV(2 * CHUNK).source)
    r1 = await engine.lookup(b, "r", toks)
    pins = engine.memory.total_pins()
    hits = engine.metrics.value("kvengine_hit_tokens_total")
    r2 = await engine.lookup(b, "r", toks)
    assert r2.reservation is r1.reservation and r2.tokens == r1.tokens
    assert engine.memory.total_pins() == pins == 2
    assert engine.metrics.value("kvengine_hit_tokens_total") == hits
    assert engine.metrics.value("kvengine_lookups_total") == 1
    await engine.release(r1)
    assert engine.memory.total_pins() == 0


async def test_changed_question_replaces_reservation(engine, layout, namespace):
    """The same request asking with another max_tokens gets a new reservation; the old one's pins are dropped."""
    b = engine.bind(namespace, layout)
    toks = list(range(2 * CHUNK))
    await engine.store(b, toks, FakeKV(2 * CHUNK).source)
    r1 = await engine.lookup(b, "r", toks)
    r2 = await engine.lookup(b, "r", toks, max_tokens=CHUNK + 3)
    assert r2.reservation is not r1.reservation and r2.tokens == CHUNK
    assert engine.memory.total_pins() == 1 and len(engine.reservations) == 1


async def test_unscheduled_request_is_reclaimed_after_lease(engine, layout, namespace):
    """A lookup never followed by load/release is reclaimed and counted; pins return to zero."""
    b = engine.bind(namespace, layout)
    toks = list(range(2 * CHUNK))
    await engine.store(b, toks, FakeKV(2 * CHUNK).source)
    res = await engine.lookup(b, "abandoned", toks)
    engine.clock.now += 5
    assert await engine.reclaim_expired() == 0
    engine.clock.now += 6
    assert await engine.reclaim_expired() == 1
    assert engine.memory.total_pins() == 0
    assert engine.metrics.value("kvengine_reservations_reclaimed_total") == 1
    late = await engine.load(res, lambda v: None)
    assert late.loaded_tokens == 0 and late.failed_chunks == (0, 1)


async def test_partial_load_failure_reports_exact_chunks(engine, layout, namespace):
    """If the sink fails on chunk 1, chunk 0 is loaded and chunks 1.. are reported for recompute."""
    b = engine.bind(namespace, layout)
    toks = list(range(3 * CHUNK))
    await engine.store(b, toks, FakeKV(3 * CHUNK).source)
    res = await engine.lookup(b, "r", toks)

    def sink(view):
        if view.index == 1:
            raise RuntimeError("destination block vanished")

    result = await engine.load(res, sink)
    assert (result.loaded_tokens, result.failed_chunks) == (CHUNK, (1, 2))
    assert result.failed_token_range == (CHUNK, 3 * CHUNK)
    assert engine.memory.total_pins() == 0


async def test_reserved_chunks_are_not_evicted(engine, layout, namespace):
    """Filling memory while a reservation is live never evicts the reserved chunks."""
    b = engine.bind(namespace, layout)
    toks = list(range(4 * CHUNK))
    kv = FakeKV(4 * CHUNK, seed=1)
    await engine.store(b, toks, kv.source)
    res = await engine.lookup(b, "r", toks)
    for j in range(6):  # 6 more prompts of 4 chunks into an 8-chunk pool
        other = [10_000 + j * 100 + t for t in range(4 * CHUNK)]
        await engine.store(b, other, FakeKV(4 * CHUNK, seed=j + 2).source)
    out = [torch.zeros_like(t) for t in kv.layers]
    result = await engine.load(res, copier(out))
    assert result.ok and all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    assert engine.memory.used_bytes <= engine.memory.capacity_bytes
    assert engine.metrics.value("kvengine_evictions_total", tier="memory") > 0


async def test_store_is_deduplicated(engine, layout, namespace):
    """Storing a cached prompt again copies nothing and calls the source for no chunk."""
    b = engine.bind(namespace, layout)
    toks = list(range(2 * CHUNK))
    await engine.store(b, toks, FakeKV(2 * CHUNK).source)
    calls = []
    st = await engine.store(b, toks, lambda i, s, e: calls.append(i) or FakeKV(2 * CHUNK).source(i, s, e))
    assert (st.stored_chunks, st.present_chunks, calls) == (0, 2, [])


@pytest.mark.parametrize("bad", [
    lambda kv: (lambda i, s, e: [t[:, :, s:e].to(torch.float16) for t in kv.layers]),   # wrong dtype
    lambda kv: (lambda i, s, e: [t[:, :1, s:e] for t in kv.layers]),                    # wrong shape (broadcastable!)
    lambda kv: (lambda i, s, e: kv.source(i, s, e)[:1]),                                  # missing tensor
    lambda kv: (lambda i, s, e: ["not a tensor"] * 2),
])
async def test_bad_tensors_raise_and_leave_pool_clean(engine, layout, namespace, bad):
    """A source giving the wrong dtype, shape, tensor count or non-tensors raises and leaves memory empty and
    unpinned; a correct store then succeeds."""
    b = engine.bind(namespace, layout)
    kv = FakeKV(2 * CHUNK)
    with pytest.raises(IRE):
        await engine.store(b, list(range(2 * CHUNK)), bad(kv))
    assert len(engine.memory) == 0 and engine.memory.used_bytes == 0 and engine.memory.total_pins() == 0
    st = await engine.store(b, list(range(2 * CHUNK)), kv.source)
    assert st.stored_chunks == 2


async def test_namespaces_are_isolated(engine, layout):
    """Chunks stored under one namespace never match a lookup under another (here: another cache salt)."""
    a = engine.bind(Namespace(model="a"), layout)
    b = engine.bind(Namespace(model="a", cache_salt="tenant2"), layout)
    toks = list(range(2 * CHUNK))
    await engine.store(a, toks, FakeKV(2 * CHUNK).source)
    assert (await engine.lookup(b, "r", toks)).tokens == 0
    assert (await engine.lookup(a, "r", toks)).tokens == 2 * CHUNK


async def test_layout_is_part_of_identity(engine, namespace):
    """The same model bound with another layout never sees the first layout's chunks."""
    a = engine.bind(namespace, make_layout(dim=4))
    b = engine.bind(namespace, make_layout(dim=8))
    toks = list(range(CHUNK))
    await engine.store(a, toks, FakeKV(CHUNK).source)
    assert (await engine.lookup(b, "r", toks)).tokens == 0


async def test_bad_requests(engine, layout, namespace):
    """Empty tokens, an empty request id or a negative token id raise; a layout of another chunk size is refused
    at bind."""
    b = engine.bind(namespace, layout)
    with pytest.raises(InvalidRequestError):
        await engine.lookup(b, "r", [])
    with pytest.raises(InvalidRequestError):
        await engine.lookup(b, "", [1, 2])
    with pytest.raises(InvalidRequestError):
        await engine.lookup(b, "r", [1, -1])
    with pytest.raises(InvalidRequestError):
        engine.bind(namespace, make_layout(chunk=32))


async def test_huge_request_beyond_capacity_is_a_clean_partial_store(engine, layout, namespace):
    """A prompt larger than the pool stores its head and rejects the tail, never evicting its own head."""
    b = engine.bind(namespace, layout)
    n = 20 * CHUNK
    st = await engine.store(b, list(range(n)), FakeKV(n).source)
    assert (st.stored_chunks, st.rejected_chunks) == (8, 12)
    assert engine.memory.used_bytes <= engine.memory.capacity_bytes
    assert engine.memory.total_pins() == 0
    res = await engine.lookup(b, "r", list(range(n)))
    assert res.tokens == 8 * CHUNK
    await engine.release(res)


async def test_chunk_bigger_than_slab_is_refused_at_bind(namespace):
    """Binding a layout whose chunk does not fit in one slab is a CapacityError naming the slab."""
    eng = CacheEngine(make_config(capacity=1 << 20, memory={"capacity_bytes": 1 << 20, "slab_bytes": 1024}))
    with pytest.raises(CapacityError, match="slab"):
        eng.bind(namespace, make_layout())
