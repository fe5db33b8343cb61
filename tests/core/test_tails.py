"""Tails: hits that end at the last whole block (kvengine.core.tails), in memory and from a lower tier."""

from __future__ import annotations

import pytest
import torch

from kvengine import CacheEngine, ChunkKey, Namespace
from kvengine.chunks.hashing import prefix_hashes, tail_hashes
from kvengine.errors import InvalidRequestError

from ..conftest import CHUNK, FakeKV, copier, make_config
from .test_tiering import DictTransport, make_engine

STEP = 4  # tokens per tail step (an engine's block)


async def memory_engine(layout, chunks: int = 8) -> tuple[CacheEngine, object]:
    eng = CacheEngine(make_config(capacity=chunks * layout.nbytes()))
    await eng.start()
    return eng, eng.bind(Namespace(model="m"), layout, tail_step=STEP)


def tail_key(binding, tokens: list[int], end: int) -> ChunkKey:
    return ChunkKey(binding.digest, prefix_hashes(tokens[:end], CHUNK, binding.digest, partial=True)[-1])


async def loaded(eng: CacheEngine, res, kv: FakeKV) -> list[torch.Tensor]:
    out = [torch.zeros_like(x) for x in kv.layers]
    result = await eng.load(res, copier(out))
    assert result.loaded_tokens == res.tokens
    return out


def test_tail_hashes_equal_the_partial_chain():
    toks = list(range(3 * CHUNK))
    seed = b"s" * 16
    full = prefix_hashes(toks, CHUNK, seed)
    got = tail_hashes(toks, full[1], 2 * CHUNK, [2 * CHUNK + 4, 2 * CHUNK + 12])
    assert got == [prefix_hashes(toks[:end], CHUNK, seed, partial=True)[-1] for end in (2 * CHUNK + 4, 2 * CHUNK + 12)]
    with pytest.raises(InvalidRequestError, match="ascend"):
        tail_hashes(toks, full[1], 2 * CHUNK, [2 * CHUNK + 4, 2 * CHUNK + 4])


async def test_a_longer_prompt_hits_to_the_last_whole_block(layout):
    eng, b = await memory_engine(layout)
    history = list(range(1000, 1000 + 2 * CHUNK + 9))  # 2 chunks, then 9 tokens: 2 whole steps
    kv = FakeKV(2 * CHUNK + 20)
    stored = await eng.store(b, history, kv.source)
    assert stored.stored_chunks == 3  # 2 chunks and the tail [32, 40)
    assert eng.memory.contains(tail_key(b, history, 2 * CHUNK + 8))
    follow_up = history + [7] * 11  # the next turn: the history, then new tokens
    res = await eng.lookup(b, "turn2", follow_up)
    assert res.tokens == 2 * CHUNK + 8
    out = await loaded(eng, res, kv)
    for o, k in zip(out, kv.layers):
        assert torch.equal(o[:, :, : 2 * CHUNK + 8], k[:, :, : 2 * CHUNK + 8])
    assert eng.metrics.value("kvengine_tail_hit_tokens_total") == 8
    # a prompt that leaves the history inside the tail (at token 38) gets the whole chunks only
    branch = history[: 2 * CHUNK + 6] + [5] * 10
    assert (await eng.lookup(b, "branch", branch)).tokens == 2 * CHUNK
    # without a tail step, the same store keeps whole chunks only
    plain = eng.bind(Namespace(model="plain"), layout)
    await eng.store(plain, history, kv.source)
    assert (await eng.lookup(plain, "p", follow_up)).tokens == 2 * CHUNK
    await eng.close()


async def test_lookup_is_stable_and_leaves_no_pin(layout):
    eng, b = await memory_engine(layout)
    toks = list(range(CHUNK + 7))
    await eng.store(b, toks, FakeKV(len(toks)).source)
    first = await eng.lookup(b, "r", toks + [1, 2])
    again = await eng.lookup(b, "r", toks + [1, 2])
    assert again.reservation is first.reservation and first.tokens == CHUNK + 4
    assert eng.memory.total_pins() == 2  # the chunk and the tail, once
    resident = eng.lookup_resident(b, "other", toks + [1, 2])
    assert resident is not None and resident.tokens == CHUNK + 4
    await eng.release(first)
    await eng.release(resident)
    assert eng.memory.total_pins() == 0
    await eng.close()


async def test_a_tail_inside_the_first_chunk_and_vllms_own_hit(layout):
    eng, b = await memory_engine(layout)
    toks = list(range(50, 50 + 13))
    kv = FakeKV(CHUNK)
    await eng.store(b, toks, kv.source)
    res = await eng.lookup(b, "r", toks + [9] * 5, from_token=6)  # the caller holds 6 tokens already
    assert res.tokens == 12 and res.reservation.first_token == 0
    out = await loaded(eng, res, kv)
    assert all(torch.equal(o[:, :, :12], k[:, :, :12]) for o, k in zip(out, kv.layers))
    # the one tail stored ends past the cap: no shorter one was stored, so nothing is hit
    assert (await eng.lookup(b, "short", toks[:11], max_tokens=11)).tokens == 0
    await eng.close()


async def test_storing_further_supersedes_shorter_tails(layout):
    eng, b = await memory_engine(layout)
    toks = list(range(3 * CHUNK))
    kv = FakeKV(len(toks))
    await eng.store(b, toks[: 2 * CHUNK + 5], kv.source)
    await eng.store(b, toks[: 2 * CHUNK + 13], kv.source)  # decode went on: the tail grows
    assert not eng.memory.contains(tail_key(b, toks, 2 * CHUNK + 4))
    assert eng.memory.contains(tail_key(b, toks, 2 * CHUNK + 12))
    assert len(eng.memory) == 3
    await eng.store(b, toks, kv.source)  # the chunk completes: its tails are gone
    assert not eng.memory.contains(tail_key(b, toks, 2 * CHUNK + 12))
    assert len(eng.memory) == 3
    assert eng.metrics.value("kvengine_tails_superseded_total") == 2
    res = await eng.lookup(b, "r", toks + [1])
    assert res.tokens == 3 * CHUNK
    await eng.release(res)
    await eng.close()


async def test_a_reserved_tail_outlives_the_chunk_that_supersedes_it(layout):
    eng, b = await memory_engine(layout)
    toks = list(range(2 * CHUNK))
    kv = FakeKV(len(toks))
    await eng.store(b, toks[: CHUNK + 9], kv.source)
    res = await eng.lookup(b, "r", toks[: CHUNK + 9] + [0])
    assert res.tokens == CHUNK + 8
    await eng.store(b, toks, kv.source)
    assert eng.memory.contains(tail_key(b, toks, CHUNK + 8))  # pinned by the reservation: kept
    out = await loaded(eng, res, kv)
    assert all(torch.equal(o[:, :, : CHUNK + 8], k[:, :, : CHUNK + 8]) for o, k in zip(out, kv.layers))
    assert eng.memory.total_pins() == 0
    await eng.close()


async def test_a_tail_memory_lacks_is_read_from_below(layout):
    """With or without its chunks in memory: a hit does not depend on what memory happens to hold."""
    t = DictTransport()
    eng = await make_engine(t, memory={"capacity_bytes": 8 * layout.nbytes()})
    b = eng.bind(Namespace(model="m"), layout, tail_step=STEP)
    toks = list(range(2 * CHUNK + 10))
    kv = FakeKV(len(toks))
    await eng.store(b, toks, kv.source)
    await eng.flush()
    assert len(t.blobs) == 3
    tail = tail_key(b, toks, 2 * CHUNK + 8)
    assert eng.memory.discard(tail)
    # every whole chunk in memory, the tail below: memory alone cannot answer, the engine's loop does
    assert eng.lookup_resident(b, "warm", toks + [3]) is None
    res = await eng.lookup(b, "warm", toks + [3])
    assert res.tokens == 2 * CHUNK + 8
    await eng.release(res)
    for key in list(t.blobs):
        eng.memory.discard(key)
    res = await eng.lookup(b, "cold", toks + [3])  # the chunks, then the tail
    assert res.tokens == 2 * CHUNK + 8
    out = await loaded(eng, res, kv)
    assert all(torch.equal(o[:, :, : 2 * CHUNK + 8], k[:, :, : 2 * CHUNK + 8]) for o, k in zip(out, kv.layers))
    assert eng.memory.total_pins() == 0
    # a prompt whose tail is stored nowhere: memory cannot tell, the lower tier says so
    other = toks[: 2 * CHUNK] + [9] * 10
    assert eng.lookup_resident(b, "other", other) is None
    res = await eng.lookup(b, "other", other)
    assert res.tokens == 2 * CHUNK
    await eng.release(res)
    await eng.close()


async def test_a_tail_below_is_found_with_one_exists_for_all_candidates(layout):
    """A lookup whose chain breaks mid-chunk asks the lower tier about every tail candidate of that chunk at
    once (3 here, 15 with 16-token blocks), not once per candidate, and reads only the longest it holds."""

    class Counting(DictTransport):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[int] = []

        async def exists(self, keys):
            self.asked.append(len(keys))
            return await super().exists(keys)

    t = Counting()
    eng = await make_engine(t, memory={"capacity_bytes": 8 * layout.nbytes()})
    b = eng.bind(Namespace(model="m"), layout, tail_step=STEP)
    toks = list(range(CHUNK + 6))  # a chunk and a tail of one step (4 tokens)
    await eng.store(b, toks, FakeKV(len(toks)).source)
    await eng.flush()
    assert eng.memory.discard(tail_key(b, toks, CHUNK + STEP))
    t.asked.clear()
    prompt = toks + list(range(500, 500 + CHUNK))  # the second chunk's candidates end at 20, 24 and 28
    res = await eng.lookup(b, "r", prompt)
    assert res.tokens == CHUNK + STEP
    assert t.asked == [1, 3, 1]  # the second whole chunk; its three tail candidates at once; the one read
    await eng.release(res)
    t.asked.clear()
    miss = toks[:CHUNK] + [7] * CHUNK  # no tail of it anywhere
    res = await eng.lookup(b, "miss", miss)
    assert res.tokens == CHUNK and t.asked == [1, 3]
    await eng.release(res)
    assert eng.memory.total_pins() == 0
    await eng.close()


async def test_a_tail_record_at_another_position_is_not_served(layout):
    """A lower tier's record under a tail's key must cover exactly the tail's tokens."""
    from kvengine.chunks.record import descriptors_for, encode_header, unpack_record

    t = DictTransport()
    eng = await make_engine(t, memory={"capacity_bytes": 8 * layout.nbytes()})
    b = eng.bind(Namespace(model="m"), layout, tail_step=STEP)
    toks = list(range(CHUNK + 8))
    await eng.store(b, toks, FakeKV(len(toks)).source)
    await eng.flush()
    tail = tail_key(b, toks, CHUNK + 8)
    header, payload = unpack_record(t.blobs[tail])
    # the tail's bytes, claiming tokens [0, 8): they verify, at another position
    t.blobs[tail] = encode_header(tail, (0, 8), descriptors_for(layout, 8), codec_id=0, raw_length=header.raw_length,
                                  payload=payload) + bytes(payload)
    for key in list(t.blobs):
        eng.memory.discard(key)
    res = await eng.lookup(b, "r", toks + [1])
    assert res.tokens == CHUNK
    assert eng.metrics.value("kvengine_integrity_failures_total", reason="wrong_position") == 1
    await eng.release(res)
    await eng.close()


async def test_tail_step_is_checked_when_bound(layout):
    eng = CacheEngine(make_config())
    await eng.start()
    for bad in (5, CHUNK, 2 * CHUNK, -4):
        with pytest.raises(InvalidRequestError, match="tail_step"):
            eng.bind(Namespace(model="m"), layout, tail_step=bad)
    await eng.close()
