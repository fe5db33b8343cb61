"""Hypothesis state machine over the reservation protocol.

Random interleavings of lookup (async, or the synchronous memory-only
``lookup_resident``) / repeated lookup / load / partial load
failure / release / store / caller-filled store (committed part-way, or
abandoned to the reaper) / keyed put and get (a failing source or sink) /
eviction pressure / lease expiry. Invariants: no reserved chunk is evicted,
pins equal what live reservations and open stores hold, capacity is never
exceeded, a load never delivers more than promised and delivers exactly the
stored bytes, and every pin is gone once all requests have ended.
"""

from __future__ import annotations

import asyncio
import zlib

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvengine import CacheEngine, Namespace
from kvengine.core.reservations import ReservationState
from kvengine.keyed import GetOutcome, KeyedStore, PutOutcome, keyed_namespace

from ..conftest import CHUNK, make_config, make_layout
from .test_tiering import DictTransport

LAYOUT = make_layout(layers=1, heads=1, dim=2)
POOL_CHUNKS = 6


def prompt(family: int, variant: int, chunks: int) -> list[int]:
    """Prompts of a family share their first chunks, so prefixes overlap."""
    shared = [family * 1000 + t for t in range(2 * CHUNK)]
    return (shared + [variant * 7919 + family + t for t in range(8 * CHUNK)])[: chunks * CHUNK + 3]


def chunk_kv(tokens: list[int], end: int) -> torch.Tensor:
    """Deterministic KV of the chunk ending at ``end``: a function of the whole prefix."""
    seed = zlib.crc32(str(tokens[:end]).encode())
    return torch.randn(LAYOUT.tensors[0].shape, generator=torch.Generator().manual_seed(seed))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class ReservationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        cfg = make_config(capacity=POOL_CHUNKS * LAYOUT.nbytes(), lease_seconds=10)
        self.engine = CacheEngine(cfg, transports=self.lower_tiers(), clock=self.clock)
        self.run(self.engine.start())
        # Time passes only by the time_passes rule: the engine's reaper, woken by the real clock between steps,
        # would end leases and drop abandoned stores at moments a replay cannot repeat.
        for task in asyncio.all_tasks(self.loop):
            if task.get_name() == "kvengine-reaper":
                task.cancel()
        self.binding = self.engine.bind(Namespace(model="sm"), LAYOUT)
        self.keyed = KeyedStore(self.engine, self.engine.bind(keyed_namespace(Namespace(model="sm"), "t"), LAYOUT))
        self.live: dict[str, tuple[object, list[int]]] = {}
        self.open_stores: list[object] = []  # caller-filled stores not committed (pinned until then)

    def lower_tiers(self) -> list[object]:
        """The engine's tiers below memory: none here."""
        return []

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        for res, _ in self.live.values():
            self.run(self.engine.release(res))
        for staged in self.open_stores:
            if not staged.committed:
                self.run(self.engine.commit_store(staged, 0))
        self.run(self.engine.flush())
        assert self.engine.memory.total_pins() == 0
        assert len(self.engine.reservations) == 0
        self.run(self.engine.close())
        self.loop.close()

    @rule(family=st.integers(0, 2), variant=st.integers(0, 3), chunks=st.integers(1, 5))
    def store(self, family, variant, chunks):
        toks = prompt(family, variant, chunks)
        self.run(self.engine.store(self.binding, toks, lambda i, s, e, toks=toks: [chunk_kv(toks, e)]))

    @rule(req=st.sampled_from(["a", "b", "c", "d"]), family=st.integers(0, 2), variant=st.integers(0, 3),
          chunks=st.integers(1, 5), cap=st.one_of(st.none(), st.integers(0, 6 * CHUNK)), resident=st.booleans())
    def lookup(self, req, family, variant, chunks, cap, resident):
        toks = prompt(family, variant, chunks)
        res = self.ask(req, toks, cap, resident)
        assert res.tokens % CHUNK == 0 and res.tokens <= len(toks)
        if cap is not None:
            assert res.tokens <= cap
        self.live[req] = (res, toks)

    def ask(self, req, toks, cap, resident):
        """``lookup``, or its synchronous memory-only form (no lower tiers here: it always answers)."""
        if resident:
            res = self.engine.lookup_resident(self.binding, req, toks, max_tokens=cap)
            assert res is not None
            return res
        return self.run(self.engine.lookup(self.binding, req, toks, max_tokens=cap))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), resident=st.booleans())
    def repeat_lookup(self, data, resident):
        req = data.draw(st.sampled_from(sorted(self.live)))
        res, toks = self.live[req]
        if res.reservation.state is not ReservationState.RESERVED:
            return
        pins = self.engine.memory.total_pins()
        lookups = self.engine.metrics.value("kvengine_lookups_total")
        again = self.ask(req, toks, res.reservation.query[0], resident)
        assert again.reservation is res.reservation and again == res
        assert self.engine.memory.total_pins() == pins
        assert self.engine.metrics.value("kvengine_lookups_total") == lookups

    @precondition(lambda self: self.live)
    @rule(data=st.data(), fail_at=st.one_of(st.none(), st.integers(0, 5)))
    def load(self, data, fail_at):
        req = data.draw(st.sampled_from(sorted(self.live)))
        res, toks = self.live.pop(req)
        seen: list[int] = []

        def sink(view):
            if view.index == fail_at:
                raise RuntimeError("injected")
            assert torch.equal(view.tensors[0], chunk_kv(toks, view.token_range[1]))
            seen.append(view.index)

        expired = self.clock.now > res.reservation.expires_at or res.reservation.state is not ReservationState.RESERVED
        result = self.run(self.engine.load(res, sink))
        assert result.loaded_tokens <= result.promised_tokens == res.tokens
        assert seen == list(range(result.loaded_tokens // CHUNK))
        if expired:
            assert result.loaded_tokens == 0
        elif fail_at is None or fail_at >= res.reservation.num_chunks:
            assert result.ok
        else:
            assert result.loaded_tokens == fail_at * CHUNK
            assert result.failed_chunks == tuple(range(fail_at, res.reservation.num_chunks))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        req = data.draw(st.sampled_from(sorted(self.live)))
        res, _ = self.live.pop(req)
        self.run(self.engine.release(res))

    @rule(family=st.integers(0, 2), variant=st.integers(0, 3), chunks=st.integers(1, 5), filled=st.integers(0, 5),
          commit=st.booleans())
    def caller_filled_store(self, family, variant, chunks, filled, commit):
        """A store the caller fills itself (vLLM's layer-wise saves): committed part-way, or left open until
        a lease reclaim drops it as abandoned (time_passes)."""
        toks = prompt(family, variant, chunks)
        staged = self.run(self.engine.begin_store(self.binding, toks))
        for view in staged.chunks[:filled]:
            view.tensors[0].copy_(chunk_kv(toks, view.token_range[1]))
        if commit:
            self.run(self.engine.commit_store(staged, filled))
        else:
            self.open_stores.append(staged)

    @rule(keys=st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True), fail_at=st.integers(0, 4))
    def keyed_put(self, keys, fail_at):
        """Keyed chunks put; a source that raises part-way stores the chunks before it."""
        def source(i):
            if i == fail_at:
                raise RuntimeError("injected")
            return [chunk_kv([keys[i]], 1)]

        try:
            outcomes = self.run(self.keyed.put([bytes([k]) for k in keys], source))
            assert all(o in (PutOutcome.STORED, PutOutcome.PRESENT, PutOutcome.NO_ROOM) for o in outcomes)
        except RuntimeError:
            assert fail_at < len(keys)

    @rule(keys=st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True), sink_fails=st.booleans())
    def keyed_get(self, keys, sink_fails):
        """Keyed chunks read back exactly; a sink that raises is that chunk's failure, never a pin left."""
        def sink(i, tensors):
            if sink_fails:
                raise RuntimeError("injected")
            assert torch.equal(tensors[0], chunk_kv([keys[i]], 1))

        # One key per get: a get's promotions from below admit concurrently, in an order a replay cannot repeat
        # (which one finds room first), and the machine's steps must replay exactly.
        outcomes: list[GetOutcome] = []
        for i, k in enumerate(keys):
            outcomes += self.run(self.keyed.get([bytes([k])], lambda _j, tensors, i=i: sink(i, tensors)))
        allowed = {GetOutcome.MISS, GetOutcome.NO_ROOM, GetOutcome.CORRUPT}
        allowed |= {GetOutcome.SINK_FAILED} if sink_fails else {GetOutcome.HIT}
        assert set(outcomes) <= allowed

    @rule(seconds=st.sampled_from([1.0, 4.0, 11.0]))
    def time_passes(self, seconds):
        self.clock.now += seconds
        self.run(self.engine.reclaim_expired())

    @rule(n=st.integers(1, 8))
    def eviction_pressure(self, n):
        for j in range(n):
            toks = [900_000 + j * 10 * CHUNK + t for t in range(CHUNK)]
            self.run(self.engine.store(self.binding, toks, lambda i, s, e, toks=toks: [chunk_kv(toks, e)]))
            # Queued tier writes pin their chunks until written: whether the next store may evict one would
            # depend on thread timing, and the machine's steps must replay exactly.
            self.run(self.engine.flush())

    @invariant()
    def capacity_never_exceeded(self):
        assert self.engine.memory.used_bytes <= self.engine.memory.capacity_bytes

    @invariant()
    def reserved_chunks_resident_and_pins_balanced(self):
        live = [r for r in self.engine.reservations.all()]
        for res in live:
            assert all(self.engine.memory.contains(k) for k in res.keys)
        self.open_stores = [s for s in self.open_stores if not s.committed]  # the reaper commits abandoned ones
        staged = sum(len(s.entries) for s in self.open_stores)
        assert self.engine.memory.total_pins() == sum(r.num_chunks for r in live) + staged


ReservationMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestReservationProtocol = ReservationMachine.TestCase


class FaultyTier(DictTransport):
    """A lower tier whose reads can be made to fail: raise, miss, or return damaged bytes."""

    name = "faulty"

    def __init__(self) -> None:
        super().__init__()
        self.fault: str | None = None

    async def get(self, keys):
        if self.fault == "raise":
            raise OSError("injected read failure")
        if self.fault == "missing":
            return [None] * len(keys)
        out = await super().get(keys)
        if self.fault == "damaged":
            out = [None if r is None else r[:-1] + bytes([r[-1] ^ 0xFF]) for r in out]
        return out


class TieredReservationMachine(ReservationMachine):
    """The same protocol over a lower tier, so that lookups also promote: chunks are dropped from memory (held
    below only), the tier's reads fail in every way (raise, miss, damaged bytes), and the engine is closed with
    requests still holding reservations. Every pin still returns to zero."""

    def __init__(self) -> None:
        self.tier = FaultyTier()
        super().__init__()
        self.close_with_live = False

    def lower_tiers(self) -> list[object]:
        return [self.tier]

    def ask(self, req, toks, cap, resident):
        """With a lower tier a lookup may need it: the memory-only form then answers None."""
        if resident:
            res = self.engine.lookup_resident(self.binding, req, toks, max_tokens=cap)
            if res is not None:
                return res
        return self.run(self.engine.lookup(self.binding, req, toks, max_tokens=cap))

    @rule(fault=st.sampled_from([None, "raise", "missing", "damaged"]))
    def tier_fails(self, fault):
        self.tier.fault = fault

    @rule(data=st.data())
    def only_below(self, data):
        """Queued writes land; then unpinned chunks the tier holds leave memory (a lookup must promote them)."""
        self.run(self.engine.flush())
        held = sorted(self.tier.blobs, key=repr)
        if held:
            for key in data.draw(st.lists(st.sampled_from(held), max_size=4, unique=True)):
                self.engine.memory.discard(key)  # refused (False) while a reservation pins it

    @invariant()
    def reserved_chunks_resident_and_pins_balanced(self):
        """As above, once queued tier writes (which pin their chunks until written) have landed."""
        self.run(self.engine.flush())
        super().reserved_chunks_resident_and_pins_balanced()

    @rule()
    def close_later_with_requests_live(self):
        self.close_with_live = True

    def teardown(self) -> None:
        if self.close_with_live:  # the engine ends every reservation it closes with
            self.run(self.engine.close())
            assert self.engine.memory.total_pins() == 0
            assert len(self.engine.reservations) == 0
            self.loop.close()
            return
        super().teardown()


TieredReservationMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestTieredReservationProtocol = TieredReservationMachine.TestCase
