"""Caller-driven stores and loads (begin/commit, begin/finish), as vLLM's layer-wise hooks use them."""

from __future__ import annotations

import pytest
import torch

from kvengine import InvalidRequestError, KVEngine, Namespace

from ..conftest import CHUNK, FakeKV, copier, make_layout

LAYERS = 2


def engine(**extra: object) -> KVEngine:
    return KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 16 * make_layout().nbytes()}, **extra})


def fill_layer_by_layer(staged, kv: FakeKV, chunks: int | None = None) -> None:
    """Write each staged chunk's tensors one layer at a time (layer 0 of every chunk first)."""
    for layer in range(LAYERS):
        for view in staged.chunks[:chunks]:
            s, e = view.token_range
            view.tensors[layer].copy_(kv.layers[layer][:, :, s:e])


def load_all(eng: KVEngine, binding, toks: list[int], kv: FakeKV) -> tuple[int, bool]:
    res = eng.lookup(binding, "check", toks)
    out = [torch.zeros_like(t) for t in kv.layers]
    result = eng.load(res, copier(out))
    n = result.loaded_tokens
    return n, all(torch.equal(o[:, :, :n], k[:, :, :n]) for o, k in zip(out, kv.layers))


def test_store_filled_layer_by_layer_is_served_exactly():
    """A staged store filled layer by layer and committed stores every chunk, loads back exactly, leaves no pin."""
    kv, toks = FakeKV(3 * CHUNK, seed=1), list(range(3 * CHUNK))
    with engine() as eng:
        binding = eng.bind(Namespace(model="m"), make_layout())
        staged = eng.begin_store(binding, toks)
        assert [v.index for v in staged.chunks] == [0, 1, 2]
        fill_layer_by_layer(staged, kv)
        result = eng.commit_store(staged, 3)
        assert (result.stored_chunks, result.present_chunks, result.rejected_chunks) == (3, 0, 0)
        assert load_all(eng, binding, toks, kv) == (3 * CHUNK, True)
        assert eng._core.memory.total_pins() == 0


def test_staged_chunks_are_invisible_until_committed_and_unfilled_ones_never_served():
    """Staged chunks are no hit before commit; committing 2 of 3 stores 2 and rejects the unfilled one; a
    second commit raises."""
    kv, toks = FakeKV(3 * CHUNK, seed=2), list(range(3 * CHUNK))
    with engine() as eng:
        binding = eng.bind(Namespace(model="m"), make_layout())
        staged = eng.begin_store(binding, toks)
        fill_layer_by_layer(staged, kv, chunks=2)
        probe = eng.lookup(binding, "early", toks)
        assert probe.tokens == 0  # half-written slots are not cached chunks
        eng.release(probe)
        result = eng.commit_store(staged, 2)
        assert (result.stored_chunks, result.rejected_chunks) == (2, 1)
        assert load_all(eng, binding, toks, kv) == (2 * CHUNK, True)
        assert eng._core.memory.total_pins() == 0
        with pytest.raises(InvalidRequestError, match="already committed"):
            eng.commit_store(staged, 2)


def test_cached_chunks_are_not_staged_again():
    """A staged store covers only the chunks not yet cached, reporting the cached ones as present."""
    kv, toks = FakeKV(2 * CHUNK, seed=3), list(range(2 * CHUNK))
    with engine() as eng:
        binding = eng.bind(Namespace(model="m"), make_layout())
        eng.store(binding, toks[:CHUNK], kv.source)
        staged = eng.begin_store(binding, toks)
        assert [v.index for v in staged.chunks] == [1] and staged.present_chunks == 1
        fill_layer_by_layer(staged, kv)
        assert eng.commit_store(staged, 1).stored_chunks == 1
        assert load_all(eng, binding, toks, kv) == (2 * CHUNK, True)


def test_committed_staged_store_reaches_the_disk_tier(tmp_path):
    """With write-through, a committed staged store is on disk: a restarted engine loads it exactly."""
    kv, toks = FakeKV(2 * CHUNK, seed=4), list(range(2 * CHUNK))
    cfg = {"write_mode": "write_through", "disk": {"path": str(tmp_path)}}
    with engine(**cfg) as eng:
        staged = eng.begin_store(eng.bind(Namespace(model="m"), make_layout()), toks)
        fill_layer_by_layer(staged, kv)
        eng.commit_store(staged, 2)
    with engine(**cfg) as eng:
        assert load_all(eng, eng.bind(Namespace(model="m"), make_layout()), toks, kv) == (2 * CHUNK, True)


def test_load_layer_by_layer_then_finish():
    """Chunks stay pinned while the caller copies them layer by layer; finish_load reports every token loaded,
    exactly, counts them and unpins."""
    kv, toks = FakeKV(3 * CHUNK, seed=5), list(range(3 * CHUNK))
    with engine() as eng:
        binding = eng.bind(Namespace(model="m"), make_layout())
        eng.store(binding, toks, kv.source)
        res = eng.lookup(binding, "r", toks)
        views = eng.begin_load(res)
        out = [torch.zeros_like(t) for t in kv.layers]
        for layer in range(LAYERS):
            for view in views:
                s, e = view.token_range
                out[layer][:, :, s:e].copy_(view.tensors[layer])
        assert eng._core.memory.total_pins() == 3  # held while the caller copies
        result = eng.finish_load(res, len(views))
        assert result.ok and result.loaded_tokens == 3 * CHUNK
        assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
        assert eng._core.memory.total_pins() == 0
        assert eng.metrics.value("kvengine_loaded_tokens_total") == 3 * CHUNK


def test_partial_finish_reports_the_rest_failed_and_counts_once():
    """Finishing after 1 of 3 chunks loads 1 and reports 1-2 failed; a second finish counts nothing and an
    ended reservation cannot begin a load."""
    kv, toks = FakeKV(3 * CHUNK, seed=6), list(range(3 * CHUNK))
    with engine() as eng:
        binding = eng.bind(Namespace(model="m"), make_layout())
        eng.store(binding, toks, kv.source)
        res = eng.lookup(binding, "r", toks)
        assert len(eng.begin_load(res)) == 3
        result = eng.finish_load(res, 1)
        assert (result.loaded_tokens, result.failed_chunks) == (CHUNK, (1, 2))
        again = eng.finish_load(res, 3)  # a second finish loads nothing and counts nothing
        assert again.loaded_tokens == 0
        assert eng.metrics.value("kvengine_loaded_tokens_total") == CHUNK
        assert eng.metrics.value("kvengine_load_failed_tokens_total") == 2 * CHUNK
        assert eng.begin_load(res) == ()  # an ended reservation cannot be loaded again


async def test_expired_reservation_begins_no_load():
    """A reservation past its lease (the engine's clock moved on, no sleep) begins no load: nothing is
    delivered and its tokens are counted as failed loads."""
    from kvengine import CacheEngine

    from ..conftest import make_config

    now = [0.0]
    kv, toks = FakeKV(CHUNK, seed=7), list(range(CHUNK))
    eng = CacheEngine(make_config(capacity=16 * make_layout().nbytes(), lease_seconds=1.0), clock=lambda: now[0])
    await eng.start()
    binding = eng.bind(Namespace(model="m"), make_layout())
    await eng.store(binding, toks, kv.source)
    res = await eng.lookup(binding, "r", toks)
    now[0] = 1.5
    assert await eng.begin_load(res) == ()
    assert (await eng.finish_load(res, 1)).loaded_tokens == 0
    assert eng.metrics.value("kvengine_load_failed_tokens_total") == CHUNK
    await eng.close()


async def test_unfinished_loads_and_staged_stores_are_covered_by_the_lease():
    """Regression: a begin_load or begin_store never finished held its pins forever (no lease covered
    them). After ABANDON_AFTER_LEASES leases the reaper drops them, counted; a late finish_load reports
    nothing loaded (the caller recomputes) and a late commit_store is refused."""
    from kvengine import CacheEngine
    from kvengine.core.engine import ABANDON_AFTER_LEASES

    from ..conftest import make_config

    now = [0.0]
    eng = CacheEngine(make_config(capacity=16 * make_layout().nbytes(), lease_seconds=1.0), clock=lambda: now[0])
    await eng.start()
    b = eng.bind(Namespace(model="m"), make_layout())
    kv, toks = FakeKV(3 * CHUNK), list(range(3 * CHUNK))
    await eng.store(b, toks[:2 * CHUNK], kv.source)
    res = await eng.lookup(b, "loading", toks)
    assert len(await eng.begin_load(res)) == 2
    staged = await eng.begin_store(b, toks)
    assert len(staged.entries) == 1 and eng.memory.total_pins() == 3
    now[0] = ABANDON_AFTER_LEASES * 1.0 - 0.5  # a long forward: still in its load
    await eng.reclaim_expired()
    assert eng.memory.total_pins() == 3
    now[0] = ABANDON_AFTER_LEASES * 1.0 + 0.5
    await eng.reclaim_expired()
    assert eng.memory.total_pins() == 0 and len(eng.reservations) == 0
    assert eng.metrics.value("kvengine_abandoned_total", op="load") == 1
    assert eng.metrics.value("kvengine_abandoned_total", op="store") == 1
    assert (await eng.finish_load(res, 2)).loaded_tokens == 0
    with pytest.raises(InvalidRequestError, match="already committed"):
        await eng.commit_store(staged, 1)
    assert (await eng.lookup(b, "again", toks)).tokens == 2 * CHUNK  # the third was never published
    await eng.close()
