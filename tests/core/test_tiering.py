"""Memory <-> lower tier paths of the engine, isolated with an in-memory transport.

The transport here is a unit-level stand-in (a dict); the real local-disk
transport has its own tests under tests/transports/.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import kvengine.core.tier_writer as tier_writer_module
from kvengine import CacheEngine, ChunkKey, ChunkLayout, Namespace
from kvengine.chunks.record import unpack_record
from kvengine.errors import ConfigError, InvalidRequestError, TransportError
from kvengine.transport import Capability
from kvengine.types import ModelBinding

from ..conftest import CHUNK, FakeKV, copier, make_config, make_layout


class DictTransport:
    name = "dict"

    def __init__(self) -> None:
        self.blobs: dict[ChunkKey, bytes] = {}
        self.fail_puts = False
        self.put_delay = 0.0
        self.deleted: list[ChunkKey] = []

    async def put(self, items: Sequence[tuple[ChunkKey, bytes]]) -> list[bool]:
        await asyncio.sleep(self.put_delay)
        if self.fail_puts:
            return [False] * len(items)
        for key, blob in items:
            self.blobs[key] = bytes(blob)
        return [True] * len(items)

    async def get(self, keys):
        return [self.blobs.get(k) for k in keys]

    async def exists(self, keys):
        return [k in self.blobs for k in keys]

    async def delete(self, keys):
        self.deleted += keys
        return [self.blobs.pop(k, None) is not None for k in keys]

    async def close(self) -> None:
        pass

    def in_prompt_order(self) -> list[ChunkKey]:
        """The keys held, by the first token position of their record."""
        return sorted(self.blobs, key=lambda k: unpack_record(self.blobs[k])[0].token_start)


async def make_engine(transport, *, clock: Callable[[], float] = time.monotonic, **cfg) -> CacheEngine:
    eng = CacheEngine(make_config(capacity=4 * make_layout().nbytes(), **cfg), transports=[transport], clock=clock)
    await eng.start()
    return eng


async def only_below(eng: CacheEngine, t: DictTransport) -> None:
    """Let queued tier writes finish, then drop every chunk ``t`` holds from memory: reads must go below."""
    await eng.flush()
    for key in list(t.blobs):
        assert eng.memory.discard(key)


async def prompt_below(t: DictTransport, layout: ChunkLayout, chunks: int,
                       **engine: Any) -> tuple[CacheEngine, ModelBinding, list[int], FakeKV]:
    """An engine over ``t`` (:func:`make_engine`'s ``engine`` options) that stored a prompt of ``chunks``
    chunks, now held by ``t`` alone."""
    eng = await make_engine(t, **engine)
    b = eng.bind(Namespace(model="m"), layout)
    toks = list(range(chunks * CHUNK))
    kv = FakeKV(len(toks))
    await eng.store(b, toks, kv.source)
    await only_below(eng, t)
    return eng, b, toks, kv


async def test_write_behind_then_promotion_from_lower_tier(layout):
    """A chunk evicted from memory is found below, verified, promoted and loaded exactly."""
    t = DictTransport()
    eng = await make_engine(t)
    b = eng.bind(Namespace(model="m"), layout)
    toks = list(range(3 * CHUNK))
    kv = FakeKV(3 * CHUNK)
    await eng.store(b, toks, kv.source)
    await eng.flush()
    assert len(t.blobs) == 3
    for k in list(t.blobs):
        assert eng.memory.discard(k)
    res = await eng.lookup(b, "r", toks)
    assert res.tokens == 3 * CHUNK
    out = [torch.zeros_like(x) for x in kv.layers]
    assert (await eng.load(res, copier(out))).ok
    assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    assert eng.metrics.value("kvengine_loaded_bytes_total", tier="dict") == 3 * layout.nbytes()
    assert eng.memory.total_pins() == 0
    await eng.close()


async def test_a_lookup_from_a_token_reads_only_the_chunks_from_the_one_holding_it(layout):
    """The caller holds the first tokens' KV (an engine's own prefix cache): chunks wholly before
    ``from_token`` are neither read nor needed (the first one is gone from every tier here); the
    reservation starts at the chunk holding ``from_token``, ends where a lookup from 0 would, and loads
    exactly; the same question is the same reservation, another ``from_token`` another one."""
    t = DictTransport()
    eng, b, toks, kv = await prompt_below(t, layout, 4)
    del t.blobs[t.in_prompt_order()[0]]
    res = await eng.lookup(b, "r", toks, from_token=CHUNK + 10)
    assert (res.reservation.first_token, res.tokens, res.reservation.num_chunks, res.reservation.reserved_tokens) == (CHUNK, 4 * CHUNK, 3, 3 * CHUNK)
    assert (await eng.lookup(b, "r", toks, from_token=CHUNK + 10)).reservation is res.reservation
    assert eng.metrics.value("kvengine_loaded_bytes_total", tier="dict") == 3 * layout.nbytes()
    out = [torch.zeros_like(x) for x in kv.layers]
    result = await eng.load(res, copier(out))
    assert (result.promised_tokens, result.loaded_tokens) == (4 * CHUNK, 4 * CHUNK)
    assert all(torch.equal(o[:, :, CHUNK:], k[:, :, CHUNK:]) for o, k in zip(out, kv.layers))
    assert all(not o[:, :, :CHUNK].any() for o in out)  # the caller's own: never written
    assert eng.metrics.value("kvengine_loaded_tokens_total") == 3 * CHUNK
    assert eng.metrics.value("kvengine_hit_tokens_total") == 3 * CHUNK
    again = await eng.lookup(b, "r", toks, from_token=0)  # asks for chunk 0 too: gone, so a miss
    assert again.reservation is not res.reservation and again.tokens == 0
    await eng.release(again)
    with pytest.raises(InvalidRequestError, match="from_token"):
        await eng.lookup(b, "r", toks, from_token=-1)
    past = await eng.lookup(b, "p", toks, from_token=10 * CHUNK)  # beyond the prompt: nothing to reserve
    assert (past.tokens, past.reservation.num_chunks) == (0, 0)
    await eng.release(past)
    assert eng.memory.total_pins() == 0
    await eng.close()


async def test_bytes_read_for_a_hit_the_caller_does_not_take_are_counted_unused(layout):
    """A reservation released (or expired) without a load counts the bytes its lookup read from lower tiers;
    a loaded one, and one that read nothing (memory held it), count none."""
    t = DictTransport()
    now = [0.0]
    eng, b, toks, _ = await prompt_below(t, layout, 2, clock=lambda: now[0], lease_seconds=1.0)
    await eng.release(await eng.lookup(b, "untaken", toks))
    assert eng.metrics.value("kvengine_unused_read_bytes_total") == 2 * layout.nbytes()
    await eng.release(await eng.lookup(b, "resident", toks))  # promoted by the first: in memory now
    await only_below(eng, t)
    res = await eng.lookup(b, "taken", toks)
    assert (await eng.load(res, lambda view: None)).ok
    assert eng.metrics.value("kvengine_unused_read_bytes_total") == 2 * layout.nbytes()
    await only_below(eng, t)
    await eng.lookup(b, "expires", toks)
    now[0] += 2.0
    assert await eng.reclaim_expired() == 1
    assert eng.metrics.value("kvengine_unused_read_bytes_total") == 4 * layout.nbytes()
    assert eng.memory.total_pins() == 0
    await eng.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
async def test_corrupt_lower_tier_record_is_a_counted_miss(layout, damage):
    """A damaged record below memory is never served: the prefix stops there and it is deleted."""
    t = DictTransport()
    eng = await make_engine(t)
    b = eng.bind(Namespace(model="m"), layout)
    toks = list(range(3 * CHUNK))
    await eng.store(b, toks, FakeKV(3 * CHUNK).source)
    await eng.flush()
    keys = t.in_prompt_order()
    for k in keys:
        eng.memory.discard(k)
    blob = bytearray(t.blobs[keys[1]])
    if damage == "flip":
        blob[-7] ^= 1
    elif damage == "truncate":
        del blob[-100:]
    else:
        blob = bytearray(t.blobs[keys[2]])  # a valid record, but of another chunk
    t.blobs[keys[1]] = bytes(blob)
    res = await eng.lookup(b, "r", toks)
    assert res.tokens == CHUNK
    assert keys[1] in t.deleted
    assert sum(eng.metrics.value("kvengine_integrity_failures_total", reason=r)
               for r in ("payload_checksum", "truncated_payload", "other_key")) == 1
    await eng.release(res)
    await eng.close()


async def test_failed_tier_writes_are_counted_and_memory_keeps_serving(layout):
    """Tier writes that fail are counted as dropped by reason, and memory still serves every chunk."""
    t = DictTransport()
    t.fail_puts = True
    eng = await make_engine(t)
    b = eng.bind(Namespace(model="m"), layout)
    toks = list(range(2 * CHUNK))
    await eng.store(b, toks, FakeKV(2 * CHUNK).source)
    await eng.flush()
    assert eng.metrics.value("kvengine_writes_dropped_total", reason="dict_failed") == 2
    res = await eng.lookup(b, "r", toks)
    assert res.tokens == 2 * CHUNK and eng.memory.total_pins() == 2
    await eng.release(res)
    await eng.close()


async def test_a_full_write_queue_makes_stores_wait_and_drops_nothing(layout, monkeypatch):
    """Regression (acknowledged but never written): a full write-behind queue dropped tier writes, so
    pages a caller had been told were stored went missing after a restart. Now the store waits for room
    (counted), every chunk reaches the tier, and only close(flush=False) drops what is queued, counted."""
    monkeypatch.setattr(tier_writer_module, "_WRITES_IN_FLIGHT", 1)
    t = DictTransport()
    t.put_delay = 0.05
    eng = await make_engine(t, max_pending_writes=1)
    b = eng.bind(Namespace(model="m"), layout)
    result = await eng.store(b, list(range(4 * CHUNK)), FakeKV(4 * CHUNK).source)
    assert result.stored_chunks == 4
    assert eng.metrics.value("kvengine_write_waits_total") >= 1
    assert eng.metrics.value("kvengine_writes_dropped_total", reason="backpressure") == 0
    await eng.flush()
    assert len(t.blobs) == 4
    await eng.store(b, list(range(100, 100 + 4 * CHUNK)), FakeKV(4 * CHUNK, seed=1).source)
    await eng.close(flush=False)
    shutdown = eng.metrics.value("kvengine_writes_dropped_total", reason="shutdown")
    assert len(t.blobs) + shutdown == 8
    assert eng.memory.total_pins() == 0


async def test_write_through_is_durable_on_return(layout):
    """Write-through: when store returns every chunk is in the lower tier, no tier failed and no pin is left."""
    t = DictTransport()
    eng = await make_engine(t, write_mode="write_through")
    b = eng.bind(Namespace(model="m"), layout)
    result = await eng.store(b, list(range(2 * CHUNK)), FakeKV(2 * CHUNK).source)
    assert len(t.blobs) == 2 and eng.memory.total_pins() == 0 and result.tier_failures == 0
    await eng.close()


async def test_write_through_reports_chunks_a_tier_refused(layout):
    """Regression: a write-through store on a read-only disk returned stored_chunks=4 and nothing else:
    "durable on return" broken silently. The result now says how many chunks no tier has (memory only)."""
    t = DictTransport()
    t.fail_puts = True
    eng = await make_engine(t, write_mode="write_through")
    b = eng.bind(Namespace(model="m"), layout)
    result = await eng.store(b, list(range(4 * CHUNK)), FakeKV(4 * CHUNK).source)
    assert (result.stored_chunks, result.tier_failures) == (4, 4) and not t.blobs
    staged = await eng.begin_store(b, list(range(50, 50 + CHUNK)))
    for view in staged.chunks:
        for v in view.tensors:
            v.fill_(1.0)
    assert (await eng.commit_store(staged, 1)).tier_failures == 1
    await eng.close()


async def test_gradient_tracking_sources_never_make_the_cache_track_gradients(layout):
    """Regression: storing tensors with requires_grad=True made the arena's views require grad for every
    later store and load. Stores copy as data; views handed out never track gradients."""
    eng = await make_engine(DictTransport())
    b = eng.bind(Namespace(model="m"), layout)
    kv = FakeKV(2 * CHUNK)
    for layer in kv.layers:
        layer.requires_grad_(True)
    await eng.store(b, list(range(2 * CHUNK)), kv.source)
    staged = await eng.begin_store(b, list(range(100, 100 + CHUNK)))
    for view in staged.chunks:  # a caller filling staged views without no_grad
        for v, src in zip(view.tensors, kv.layers):
            v.copy_(src[:, :, :CHUNK])
    await eng.commit_store(staged, 1)
    seen = []
    for toks in (list(range(2 * CHUNK)), list(range(100, 100 + CHUNK))):
        res = await eng.lookup(b, f"r{toks[0]}", toks)
        await eng.load(res, lambda view: seen.extend(t.requires_grad for t in view.tensors))
    assert seen and not any(seen)
    assert not any(eng.memory._alloc.typed(d).requires_grad for d in (torch.float32,))
    await eng.close()


async def test_a_reservation_is_usable_only_by_its_engine(layout):
    """Regression: engine A accepted and loaded a reservation engine B made, and B kept it forever."""
    a, b_eng = await make_engine(DictTransport()), await make_engine(DictTransport())
    b = b_eng.bind(Namespace(model="m"), layout)
    toks = list(range(2 * CHUNK))
    await b_eng.store(b, toks, FakeKV(2 * CHUNK).source)
    await b_eng.flush()  # the tier writes' pins are gone
    res = await b_eng.lookup(b, "r", toks)
    for call in (a.load(res, lambda _v: None), a.begin_load(res), a.release(res), a.finish_load(res, 0)):
        with pytest.raises(InvalidRequestError, match="another engine"):
            await call
    assert b_eng.memory.total_pins() == 2  # still B's, untouched
    await b_eng.release(res)
    assert b_eng.memory.total_pins() == 0 and len(b_eng.reservations) == 0
    await a.close()
    await b_eng.close()


async def test_unverified_namespace_never_reaches_verified_reader(layout):
    """Chunks written under the debug override live apart from verified ones."""
    t = DictTransport()
    eng = await make_engine(t)
    dbg = eng.bind(Namespace(model="m", verified=False), layout)
    ok = eng.bind(Namespace(model="m"), layout)
    toks = list(range(2 * CHUNK))
    await eng.store(dbg, toks, FakeKV(2 * CHUNK).source)
    await eng.flush()
    assert (await eng.lookup(ok, "r", toks)).tokens == 0
    await eng.close()


async def test_partial_chunks_when_enabled(layout):
    """With store_partial_chunks, an identical prompt matches its tail; a longer one only full chunks."""
    eng = CacheEngine(make_config(capacity=8 * layout.nbytes(), store_partial_chunks=True))
    await eng.start()
    b = eng.bind(Namespace(model="m"), layout)
    toks = list(range(2 * CHUNK + 5))
    kv = FakeKV(2 * CHUNK + 5)
    st = await eng.store(b, toks, kv.source)
    assert st.stored_chunks == 3
    res = await eng.lookup(b, "same", toks)
    assert res.tokens == 2 * CHUNK + 5
    out = [torch.zeros_like(x) for x in kv.layers]
    result = await eng.load(res, copier(out))
    assert result.loaded_tokens == 2 * CHUNK + 5 and all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    assert (await eng.lookup(b, "longer", toks + [7])).tokens == 2 * CHUNK
    await eng.close()


async def test_record_at_wrong_position_is_refused(layout):
    """A record whose bytes verify but whose token range is not the chunk's position is never served."""
    from kvengine.chunks.record import descriptors_for, encode_header, unpack_record

    t = DictTransport()
    eng = await make_engine(t)
    b = eng.bind(Namespace(model="m"), layout)
    toks = list(range(2 * CHUNK))
    await eng.store(b, toks, FakeKV(2 * CHUNK).source)
    await eng.flush()
    keys = t.in_prompt_order()
    for k in keys:
        eng.memory.discard(k)
    header, payload = unpack_record(t.blobs[keys[1]])
    forged = encode_header(keys[1], (0, CHUNK), descriptors_for(layout, CHUNK), codec_id=0,
                           raw_length=header.raw_length, payload=payload)
    t.blobs[keys[1]] = forged + bytes(payload)
    res = await eng.lookup(b, "r", toks)
    assert res.tokens == CHUNK
    assert eng.metrics.value("kvengine_integrity_failures_total", reason="wrong_position") == 1
    await eng.release(res)
    await eng.close()


def rewritten(blob: bytes, token_dims: list[int | None]) -> bytes:
    """``blob`` (a record) with its descriptors' token dims replaced, header resealed."""
    import dataclasses

    from kvengine.chunks.record import encode_header, unpack_record

    header, payload = unpack_record(blob)
    tensors = [dataclasses.replace(t, token_dim=dim) for t, dim in zip(header.tensors, token_dims)]
    return encode_header(header.key, (header.token_start, header.token_end), tensors, codec_id=header.codec_id,
                         raw_length=header.raw_length, payload=payload, flags=header.flags) + bytes(payload)


def as_version_2(blob: bytes) -> bytes:
    """``blob`` (a record) as a format-version-2 writer wrote it: the token dim byte was padding (zero)."""
    import struct

    import xxhash

    out = bytearray(rewritten(blob, [0] * len(unpack_record(blob)[0].tensors)))
    length = int.from_bytes(out[8:12], "little")
    struct.pack_into("<H", out, 4, 2)
    struct.pack_into("<Q", out, length - 8, xxhash.xxh3_64_intdigest(bytes(out[: length - 8])))
    return bytes(out)


async def test_records_written_before_token_dims_still_promote(layout):
    """A version-2 record (its descriptors carry no token dims) of a layout whose tensors have one is a
    hit, loaded exactly: promotion compares everything else."""
    t = DictTransport()
    eng, b, toks, kv = await prompt_below(t, layout, 2)
    for key in t.blobs:
        t.blobs[key] = as_version_2(t.blobs[key])
        assert all(d.token_dim is None for d in unpack_record(t.blobs[key])[0].tensors)
    res = await eng.lookup(b, "old", toks)
    assert res.tokens == 2 * CHUNK
    out = [torch.zeros_like(x) for x in kv.layers]
    await eng.load(res, copier(out))
    assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    assert eng.metrics.value("kvengine_integrity_failures_total", reason="layout_mismatch") == 0
    await eng.close()


async def test_record_whose_token_dim_disagrees_with_the_layout_is_a_layout_mismatch(layout):
    """A version-3 record whose descriptors name another token dim than the layout's is a
    layout_mismatch miss (only records that carry no token dims at all match without them)."""
    t = DictTransport()
    eng, b, toks, _ = await prompt_below(t, layout, 2)
    keys = t.in_prompt_order()
    assert [d.token_dim for d in unpack_record(t.blobs[keys[1]])[0].tensors] == [2, 2]
    t.blobs[keys[1]] = rewritten(t.blobs[keys[1]], [2, 1])
    res = await eng.lookup(b, "r", toks)
    assert res.tokens == CHUNK
    assert eng.metrics.value("kvengine_integrity_failures_total", reason="layout_mismatch") == 1
    await eng.release(res)
    await eng.close()


class GatheringTransport(DictTransport):
    """Takes records as parts, as the local-disk transport does; remembers where each payload lay."""

    name = "gathering"
    capabilities = frozenset({Capability.GATHERED_WRITES})

    def __init__(self) -> None:
        super().__init__()
        self.payload_addresses: list[int] = []

    async def put_parts(self, items):
        for key, parts in items:
            self.payload_addresses.append(torch.frombuffer(parts[-1], dtype=torch.uint8).data_ptr())
            self.blobs[key] = b"".join(bytes(p) for p in parts)
        return [True] * len(items)


async def test_a_gathering_tier_gets_raw_payloads_straight_from_memory_while_others_get_whole_records(layout):
    """With two raw tiers, the one that takes parts is handed each payload where it lies in the memory
    arena (no copy to join it to its header); the other gets whole records; both hold the same bytes,
    and a chunk promoted from the gathering tier loads exactly."""
    gathering, whole = GatheringTransport(), DictTransport()
    eng = CacheEngine(make_config(capacity=4 * layout.nbytes()), transports=[gathering, whole])
    await eng.start()
    b = eng.bind(Namespace(model="m"), layout)
    toks, kv = list(range(2 * CHUNK)), FakeKV(2 * CHUNK)
    await eng.store(b, toks, kv.source)
    await eng.flush()
    slots = []
    for entry in eng.memory.pin_prefix(list(gathering.blobs)):
        slots.append(eng.memory.raw(entry).data_ptr())
        eng.memory.unpin([entry])
    assert len(slots) == 2 and sorted(gathering.payload_addresses) == sorted(slots)
    assert gathering.blobs == whole.blobs and len(whole.blobs) == 2
    for key in list(gathering.blobs):
        eng.memory.discard(key)
    whole.blobs.clear()  # promote from the gathering tier only
    res = await eng.lookup(b, "r", toks)
    out = [torch.zeros_like(t) for t in kv.layers]
    assert res.tokens == 2 * CHUNK and (await eng.load(res, copier(out))).loaded_tokens == 2 * CHUNK
    assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    await eng.close()


class CountingTransport(DictTransport):
    """Records how many puts overlap."""

    def __init__(self) -> None:
        super().__init__()
        self.active = self.most_active = 0

    async def put(self, items):
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            return await super().put(items)
        finally:
            self.active -= 1


async def test_writes_overlap_up_to_the_in_flight_bound(layout, monkeypatch):
    """Queued chunks are written several at a time, never more than the bound, all of them in the end."""
    monkeypatch.setattr(tier_writer_module, "_WRITES_IN_FLIGHT", 3)
    t = CountingTransport()
    t.put_delay = 0.05
    eng = CacheEngine(make_config(capacity=16 * layout.nbytes()), transports=[t])
    await eng.start()
    b = eng.bind(Namespace(model="m"), layout)
    await eng.store(b, list(range(10 * CHUNK)), FakeKV(10 * CHUNK).source)
    await eng.flush()
    assert t.most_active == 3 and len(t.blobs) == 10 and eng.memory.total_pins() == 0
    await eng.close()


async def test_write_through_starts_each_chunks_writes_as_soon_as_it_is_copied(layout):
    """Write-through: the caller waits for the tiers anyway, so the first chunk reaches the lower tier
    while the store is still copying later ones; on return every chunk is below, no pin is left."""
    t = DictTransport()
    first_put = threading.Event()
    real_put = t.put

    async def put(items):
        try:
            return await real_put(items)
        finally:
            first_put.set()

    t.put = put  # type: ignore[method-assign]
    eng = await make_engine(t, write_mode="write_through")
    b = eng.bind(Namespace(model="m"), layout)
    kv = FakeKV(3 * CHUNK)
    seen_during_copy: list[bool] = []

    def source(index: int, start: int, end: int):
        if index == 2:  # on the copy thread; the event loop is free to run the first chunk's write
            seen_during_copy.append(first_put.wait(timeout=5))
        return kv.source(index, start, end)

    await eng.store(b, list(range(3 * CHUNK)), source)
    assert seen_during_copy == [True] and len(t.blobs) == 3 and eng.memory.total_pins() == 0
    await eng.close()


class RaisingTransport(DictTransport):
    """A tier whose reads raise (a broken disk, a closed transport, a peer's protocol error)."""

    name = "raising"

    def __init__(self, fail: str) -> None:
        super().__init__()
        self.fail = fail

    async def exists(self, keys):
        if self.fail == "exists":
            raise TransportError("exists failed")
        return await super().exists(keys)

    async def get(self, keys):
        if self.fail == "get":
            raise OSError("get failed")
        return await super().get(keys)


@pytest.mark.parametrize("fail", ["exists", "get"])
async def test_a_tier_that_raises_on_a_read_is_a_counted_miss(layout, fail):
    """Regression: a transport raising in exists/get made lookup (and keyed gets) raise. Now the lookup
    answers what memory holds, the fault is counted per tier and op, and nothing stays pinned."""
    from kvengine.keyed import GetOutcome, KeyedStore, keyed_namespace

    t = RaisingTransport(fail="")
    eng = await make_engine(t)
    b = eng.bind(Namespace(model="m"), layout)
    toks = list(range(3 * CHUNK))
    await eng.store(b, toks, FakeKV(3 * CHUNK).source)
    await eng.flush()
    keyed = KeyedStore(eng, eng.bind(keyed_namespace(Namespace(model="m"), "k"), layout))
    await keyed.put([b"x"], lambda _i: [x[:, :, :CHUNK] for x in FakeKV(CHUNK).layers])
    await eng.flush()
    for key in list(t.blobs):
        eng.memory.discard(key)
    t.fail = fail
    res = await eng.lookup(b, "r", toks)
    assert res.tokens == 0
    assert await keyed.get([b"x"], lambda _i, _t: None) == [GetOutcome.MISS]
    assert eng.metrics.value("kvengine_tier_errors_total", tier="raising", op=fail) >= 2
    await eng.release(res)
    assert eng.memory.total_pins() == 0
    await eng.close()


async def test_a_closed_disk_transport_is_a_counted_miss_not_an_exception(layout, tmp_path):
    """The real local-disk transport, closed under an engine (shutdown races): lookups miss, counted."""
    from kvengine.transports.local_disk import LocalDiskOptions, LocalDiskTransport

    disk = LocalDiskTransport(LocalDiskOptions(path=tmp_path, capacity_bytes=1 << 24))
    writer = await make_engine(disk)
    toks = list(range(2 * CHUNK))
    await writer.store(writer.bind(Namespace(model="m"), layout), toks, FakeKV(2 * CHUNK).source)
    await writer.flush()
    await disk.close()
    reader = await make_engine(disk)  # empty memory: every chunk would come from the closed disk
    res = await reader.lookup(reader.bind(Namespace(model="m"), layout), "r", toks)
    assert res.tokens == 0
    assert reader.metrics.value("kvengine_tier_errors_total", tier="local_disk", op="exists") == 1
    await reader.release(res)
    await reader.close()
    await writer.close()


class DeclinedCapabilities(DictTransport):
    """Has the optional methods but declares no capability: the engine must not use them."""

    name = "declined"

    async def get_into(self, key, place):
        raise AssertionError("get_into used although PLACED_READS is not declared")

    async def put_parts(self, items):
        raise AssertionError("put_parts used although GATHERED_WRITES is not declared")


async def test_capabilities_are_declared_not_inferred_from_methods(layout):
    """Regression (issue 14): the optional protocols were matched by isinstance alone, so a transport
    with ``get_into`` that did not offer placed reads still got them. Now only its ``capabilities`` count."""
    transport = DeclinedCapabilities()
    eng = await make_engine(transport, write_mode="write_through")
    b = eng.bind(Namespace(model="m"), layout)
    toks, kv = list(range(2 * CHUNK)), FakeKV(2 * CHUNK)
    assert (await eng.store(b, toks, kv.source)).tier_failures == 0
    await eng.close()
    eng = await make_engine(transport)
    b = eng.bind(Namespace(model="m"), layout)
    out = [torch.zeros_like(t) for t in kv.layers]
    result = await eng.load(await eng.lookup(b, "r", toks), copier(out))
    assert result.loaded_tokens == 2 * CHUNK and all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    await eng.close()


class ClaimsWithoutMethod(DictTransport):
    """Declares placed reads but has no ``get_into``."""

    name = "claims"
    capabilities = frozenset({Capability.PLACED_READS})


class ClaimsByName(DictTransport):
    """Declares its capabilities by their names, not as :class:`Capability` members."""

    name = "by_name"
    capabilities = frozenset({"placed_reads"})


@pytest.mark.parametrize("transport, says", [(ClaimsWithoutMethod(), "declares PLACED_READS without the method "
                                                                     "\\(get_into\\)"),
                                             (ClaimsByName(), "must be a set of kvengine.transport.Capability")])
async def test_a_capability_declared_wrongly_is_refused_at_start(transport, says):
    """A capability listed without its method, or not as a Capability, refuses the engine's start, naming
    the transport: never a read that fails later or a declaration silently ignored."""
    with pytest.raises(ConfigError, match=f"transport '{transport.name}'.*{says}"):
        await make_engine(transport)


@pytest.mark.parametrize("mode", ["write_behind", "write_through"])
@pytest.mark.parametrize("ending", ["raises", "returns_none"])
async def test_a_store_that_ends_part_way_hands_its_copied_prefix_to_the_tiers(layout, mode, ending):
    """Regression (issue 14): a source that failed at chunk 2 left chunks 0-1 in memory only under
    write_behind (they never reached a lower tier) but wrote them under write_through. Now both modes hand
    the committed prefix on; a source may also end the store by returning None (no exception)."""
    transport = DictTransport()
    eng = await make_engine(transport, write_mode=mode)
    b = eng.bind(Namespace(model="m"), layout)
    toks, kv = list(range(3 * CHUNK)), FakeKV(3 * CHUNK)

    def source(index, start, end):
        if index == 2:
            if ending == "raises":
                raise RuntimeError("the inference engine lost this chunk")
            return None
        return kv.source(index, start, end)

    if ending == "raises":
        with pytest.raises(RuntimeError, match="lost this chunk"):
            await eng.store(b, toks, source)
    else:
        assert (await eng.store(b, toks, source)).stored_chunks == 2
    await eng.flush()
    assert len(transport.blobs) == 2
    assert eng.memory.total_pins() == 0
    await eng.close()
    eng = await make_engine(transport)  # a fresh engine hits the two chunks from the lower tier, exactly
    b = eng.bind(Namespace(model="m"), layout)
    out = [torch.zeros_like(t) for t in kv.layers]
    res = await eng.lookup(b, "r", toks)
    assert res.tokens == 2 * CHUNK
    assert (await eng.load(res, copier(out))).loaded_tokens == 2 * CHUNK
    assert all(torch.equal(o[:, :, : 2 * CHUNK], k[:, :, : 2 * CHUNK]) for o, k in zip(out, kv.layers))
    await eng.close()


class GatedTransport(DictTransport):
    """Reads wait at ``gate`` (so a test can start a second lookup while the first one's reads are in
    flight); ``placed`` offers placed reads (the local-disk transport's path). Counts reads."""

    name = "gated"

    def __init__(self, placed: bool) -> None:
        super().__init__()
        self.capabilities = frozenset({Capability.PLACED_READS}) if placed else frozenset()
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = asyncio.Event()  # a read is waiting at the gate
        self.reads = 0
        self.asked = 0
        self.asked_twice = asyncio.Event()  # a second lookup reached this tier

    async def exists(self, keys):
        self.asked += 1
        if self.asked == 2:
            self.asked_twice.set()
        return await super().exists(keys)

    async def _pass_gate(self, n: int) -> None:
        self.reads += n
        self.waiting.set()
        await self.gate.wait()

    async def get(self, keys):
        await self._pass_gate(len(keys))
        return await super().get(keys)

    async def get_into(self, key, place):
        await self._pass_gate(1)
        blob = self.blobs.get(key)
        if blob is None:
            return None
        header, payload = unpack_record(blob, expect_key=key)
        out = place(header)
        if out is None:
            return None
        memoryview(out).cast("B")[: len(payload)] = payload
        return header


@pytest.mark.parametrize("placed", [True, False], ids=["placed_reads", "windowed_reads"])
async def test_concurrent_lookups_of_one_prefix_from_below_both_get_the_whole_hit(layout, placed):
    """Regression (a flaky vLLM test): two requests sharing a prefix, looked up at once while its chunks
    are on disk only. The second found the first one's memory slots taken but not yet committed and was
    told 0 tokens. Now it waits for the first promotion: both are told the whole prefix, each chunk is
    read once, and both load it exactly."""
    t = GatedTransport(placed)
    eng, b, toks, kv = await prompt_below(t, layout, 3)
    t.gate.clear()
    first = asyncio.ensure_future(eng.lookup(b, "first", toks))
    await t.waiting.wait()  # the first lookup's reads are in flight
    second = asyncio.ensure_future(eng.lookup(b, "second", toks))
    await t.asked_twice.wait()  # ... and the second one is promoting the same chunks
    t.gate.set()
    reservations = await asyncio.gather(first, second)
    assert [r.tokens for r in reservations] == [3 * CHUNK, 3 * CHUNK]
    if placed:  # the second joined the first's reads and issued none of its own
        assert t.reads == 3
    assert eng.metrics.value("kvengine_loaded_bytes_total", tier="gated") == 3 * layout.nbytes()
    for res in reservations:
        out = [torch.zeros_like(x) for x in kv.layers]
        assert (await eng.load(res, copier(out))).ok
        assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    assert eng.memory.total_pins() == 0
    await eng.close()


async def test_a_lookup_waiting_on_a_failed_promotion_is_a_miss_not_a_hang(layout):
    """The first promotion finds a corrupt record: the lookup that waited for it misses too (nothing
    served, nothing pinned) and neither hangs."""
    t = GatedTransport(placed=True)
    eng, b, toks, _ = await prompt_below(t, layout, 2)
    head = t.in_prompt_order()[0]
    damaged = bytearray(t.blobs[head])
    damaged[-1] ^= 0xFF
    t.blobs[head] = bytes(damaged)
    t.gate.clear()
    first = asyncio.ensure_future(eng.lookup(b, "first", toks))
    await t.waiting.wait()
    second = asyncio.ensure_future(eng.lookup(b, "second", toks))
    await t.asked_twice.wait()
    t.gate.set()
    reservations = await asyncio.wait_for(asyncio.gather(first, second), timeout=10)
    assert [r.tokens for r in reservations] == [0, 0]
    for res in reservations:
        await eng.release(res)
    assert eng.memory.total_pins() == 0
    await eng.close()


@pytest.mark.parametrize("placed", [True, False], ids=["placed_reads", "windowed_reads"])
async def test_concurrent_keyed_gets_of_one_chunk_from_below_both_hit(layout, placed):
    """The keyed path (SGLang's pages) shares the single-flight promotion: two gets of one chunk at once,
    while it is below memory only, both hit and get its bytes, read from below once (placed reads)."""
    from kvengine.keyed import GetOutcome, KeyedStore, keyed_namespace

    t = GatedTransport(placed)
    eng = await make_engine(t)
    keyed = KeyedStore(eng, eng.bind(keyed_namespace(Namespace(model="m"), "k"), layout))
    kv = FakeKV(CHUNK)
    await keyed.put([b"x"], lambda _i: list(kv.layers))
    await only_below(eng, t)
    got: list[list[torch.Tensor]] = [[], []]
    t.gate.clear()
    gets = [asyncio.ensure_future(keyed.get([b"x"], lambda _i, tensors, n=n: got[n].extend(x.clone() for x in tensors)))
            for n in range(2)]
    await t.asked_twice.wait()
    t.gate.set()
    assert await asyncio.gather(*gets) == [[GetOutcome.HIT], [GetOutcome.HIT]]
    if placed:  # one read, the second get joined it
        assert t.reads == 1
    for tensors in got:
        assert all(torch.equal(a, b) for a, b in zip(tensors, kv.layers)) and len(tensors) == len(kv.layers)
    assert eng.memory.total_pins() == 0
    await eng.close()


async def test_lookup_resident_answers_only_what_memory_alone_decides(layout):
    """Issue 14: the synchronous memory-only lookup answers a hit memory holds whole (the same reservation
    a later ``lookup`` renews, counted once) and declines (None, nothing pinned or counted) when a chunk
    must come from a lower tier, which the async lookup then promotes."""
    t = DictTransport()
    eng = await make_engine(t)
    b = eng.bind(Namespace(model="m"), layout)
    toks = list(range(3 * CHUNK))
    await eng.store(b, toks, FakeKV(3 * CHUNK).source)
    await eng.flush()
    res = eng.lookup_resident(b, "warm", toks)
    assert res is not None and res.tokens == 3 * CHUNK
    assert (await eng.lookup(b, "warm", toks)).reservation is res.reservation
    assert eng.memory.total_pins() == 3 and eng.metrics.value("kvengine_lookups_total") == 1
    await eng.release(res)
    tail = t.in_prompt_order()[2]
    assert eng.memory.discard(tail)
    assert eng.lookup_resident(b, "cold", toks) is None
    assert eng.memory.total_pins() == 0 and eng.metrics.value("kvengine_lookups_total") == 1
    assert eng.lookup_resident(b, "cold", toks, max_tokens=2 * CHUNK + 1).tokens == 2 * CHUNK
    res = await eng.lookup(b, "cold", toks)  # another question: the capped reservation is replaced
    assert res.tokens == 3 * CHUNK and eng.memory.total_pins() == 3
    await eng.release(res)
    assert eng.memory.total_pins() == 0 and len(eng.reservations) == 0
    await eng.close()


class TwoCopies(DictTransport):
    """A tier holding two copies of each record (scripted: ``first`` is what ``get`` serves where set,
    ``blobs`` the second copy), with :class:`~kvengine.transport.RejectsCopies`."""

    name = "two_copies"
    capabilities = frozenset({Capability.REJECTS_COPIES})

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[ChunkKey, bytes] = {}
        self.rejected: list[ChunkKey] = []
        self.fail_reject = False

    async def get(self, keys):
        return [self.first.get(k, self.blobs.get(k)) for k in keys]

    async def reject(self, key, copy):
        self.rejected.append(key)
        if self.fail_reject:
            raise TransportError("reject failed")
        if self.first.get(key) != copy:
            return None  # the second copy is the last one
        del self.first[key]
        return self.blobs.get(key)


def _at_wrong_position(blob: bytes) -> bytes:
    """``blob`` (a record) moved one chunk on, header resealed: it verifies but is at the wrong position."""
    from kvengine.chunks.record import encode_header

    header, payload = unpack_record(blob)
    return encode_header(header.key, (header.token_start + CHUNK, header.token_end + CHUNK), header.tensors,
                         codec_id=header.codec_id, raw_length=header.raw_length, payload=payload,
                         flags=header.flags) + bytes(payload)


@pytest.mark.parametrize("fail_reject", [False, True])
async def test_a_bad_copy_on_a_tier_with_copies_is_rejected_there_and_the_next_copy_admitted(layout, fail_reject):
    """Regression: the engine deleted a copy that failed its checks with ``delete`` (every copy the tier
    holds, good ones included) and stopped the lookup there. Now it hands the bad copy back with
    ``reject`` and admits the copy that returns; a ``reject`` that raises is a counted fault and a miss."""
    t = TwoCopies()
    eng, b, toks, kv = await prompt_below(t, layout, 3)
    keys = t.in_prompt_order()
    t.first[keys[1]] = _at_wrong_position(t.blobs[keys[1]])
    t.fail_reject = fail_reject
    res = await eng.lookup(b, "r", toks)
    out = [torch.zeros_like(x) for x in kv.layers]
    loaded = await eng.load(res, copier(out))

    assert t.rejected == [keys[1]] and t.deleted == []
    assert eng.metrics.value("kvengine_integrity_failures_total", tier="two_copies", reason="wrong_position") == 1
    if fail_reject:
        assert res.tokens == CHUNK
        assert eng.metrics.value("kvengine_tier_errors_total", tier="two_copies", op="reject") == 1
    else:
        assert res.tokens == loaded.loaded_tokens == 3 * CHUNK
        assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    assert eng.memory.total_pins() == 0
    await eng.close()
