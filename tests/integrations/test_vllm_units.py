"""Parts of the vLLM connector that need no vLLM: the channel, page copies, options.

These run in the main environment too (no vLLM installed).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
from kvengine.errors import ConfigError
from kvengine.integrations.vllm.channel import ChannelClosed, LookupClient, LookupService
from kvengine.integrations.vllm.layout import GroupKind, GroupPlan, PagedLayout, PagedTensor
from kvengine.integrations.vllm.options import ConnectorOptions
from kvengine.integrations.vllm.paging import MissingPage, PagedCopier, blocks_in_range
from kvengine.lookups import PENDING, LookupOutcome, LookupResult
from kvengine.types import ChunkView


# ------------------------------------------------------------------ channel --
class FakeHandler:
    """Matches the first 8 tokens of anything; records calls; can be slowed (all, or per request), held at
    a gate (per request) or broken. Requests in ``resident`` are answered at once (``lookup_now``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.delay = 0.0
        self.delays: dict[str, float] = {}
        self.gates: dict[str, threading.Event] = {}
        self.resident: set[str] = set()
        self.at_gate = threading.Event()  # a lookup is waiting at its gate
        self.fail = False
        self.released = threading.Event()
        self.computed: dict[str, int] = {}  # each request's last lookup: the tokens vLLM held already

    def lookup(self, request_id: str, salt: str, tokens: bytes, max_tokens: int, producer: str | None = None,
               computed: int = 0):
        self.computed[request_id] = computed
        time.sleep(self.delays.get(request_id, self.delay))
        if request_id in self.gates:
            self.at_gate.set()
            self.gates[request_id].wait(10)
        if self.fail:
            raise RuntimeError("boom")
        self.calls.append(("lookup", request_id))
        return LookupResult(LookupOutcome.HIT, min(8, len(tokens) // 4, max_tokens))

    def lookup_now(self, request_id: str, salt: str, tokens: bytes, max_tokens: int, producer: str | None = None,
                   computed: int = 0):
        self.computed[request_id] = computed
        if request_id not in self.resident:
            return None
        self.calls.append(("lookup_now", request_id))
        return LookupResult(LookupOutcome.HIT, min(8, len(tokens) // 4, max_tokens))

    def release(self, request_id: str) -> None:
        self.calls.append(("release", request_id))
        self.released.set()

    def stats(self) -> dict[str, float]:
        return {"calls": float(len(self.calls))}


@pytest.fixture
def channel():
    handler = FakeHandler()
    service = LookupService(handler)
    path, key = service.start()
    client = LookupClient(path, key)
    yield handler, service, client
    client.close()
    service.close()


def test_lookup_round_trip(channel):
    """A lookup is answered with the handler's matched tokens; stats come back too."""
    handler, _, client = channel
    seq = client.submit("r1", "", bytes(4 * 20), 19)
    assert client.result(seq, 5.0) == LookupResult(LookupOutcome.HIT, 8)
    assert client.stats()["calls"] == 1.0


def test_a_lookup_carries_the_tokens_vllm_holds_already(channel):
    """vLLM's own prefix cache hit travels with the lookup, to both the answer at once and the waited one."""
    handler, _, client = channel
    handler.resident.add("warm")
    for request_id, computed in (("warm", 128), ("cold", 256)):
        answer = client.result(client.submit(request_id, "", bytes(40), 9, computed=computed), 5.0)
        assert answer.outcome is LookupOutcome.HIT
    assert handler.computed == {"warm": 128, "cold": 256}


def test_answer_not_back_in_time_is_pending_then_arrives(channel):
    """Scenario: the worker is slow; ``result`` says "not yet" (PENDING), a later call gets the answer."""
    handler, _, client = channel
    handler.delay = 0.3
    seq = client.submit("r1", "", bytes(40), 9)
    assert client.result(seq, 0.01) is PENDING
    assert client.result(seq, 5.0) == LookupResult(LookupOutcome.HIT, 8)


def test_abandoned_answer_is_dropped_and_later_calls_still_match(channel):
    """Regression: an answer to a forgotten call must not be taken for a later call's answer."""
    handler, _, client = channel
    handler.delay = 0.2
    old = client.submit("r1", "", bytes(40), 9)
    assert client.result(old, 0.0) is PENDING
    client.forget(old)
    handler.delay = 0.0
    new = client.submit("r2", "", bytes(12), 3)
    assert client.result(new, 5.0) == LookupResult(LookupOutcome.HIT, 3)  # not the old call's 8


def test_release_is_handled_after_the_lookup_it_follows(channel):
    """Calls are handled in order: a release sent after a lookup ends what that lookup reserved."""
    handler, _, client = channel
    handler.delay = 0.1
    client.submit("r1", "", bytes(40), 9)
    client.release("r1")
    assert handler.released.wait(5.0)
    assert handler.calls == [("lookup", "r1"), ("release", "r1")]


def test_a_slow_lookup_holds_up_no_other_requests_answer(channel):
    """Regression (issue 14): the worker served one call at a time, so one lookup promoting from disk held
    every other request's answer. Now requests are answered at once (each in order with itself)."""
    handler, _, client = channel
    handler.delays["slow"] = 1.0
    slow = client.submit("slow", "", bytes(40), 9)
    t0 = time.monotonic()
    fast = [client.submit(f"fast{i}", "", bytes(40), 9) for i in range(8)]
    assert all(client.result(seq, 5.0) is not PENDING for seq in fast)
    assert time.monotonic() - t0 < 0.5
    assert client.result(slow, 0.0) is PENDING  # still promoting
    assert client.result(slow, 5.0) is not PENDING


def test_a_lookup_memory_answers_is_answered_while_every_handler_is_busy(channel):
    """Issue 14 (scheduler p99): a hit memory holds is answered by the connection's reader thread, not
    queued behind lookups that wait on disk, even with every handler thread held."""
    handler, _, client = channel
    gate = threading.Event()
    held = [f"cold{i}" for i in range(12)]  # more than the pool's threads
    handler.gates = dict.fromkeys(held, gate)
    cold = [client.submit(rid, "", bytes(40), 9) for rid in held]
    handler.resident.add("warm")
    assert client.result(client.submit("warm", "", bytes(40), 9), 5.0) == LookupResult(LookupOutcome.HIT, 8)
    assert all(client.result(seq, 0.0) is PENDING for seq in cold)  # all still held at the gate
    gate.set()
    assert all(client.result(seq, 5.0) is not PENDING for seq in cold)
    assert handler.calls[0] == ("lookup_now", "warm")


def test_a_lookup_that_must_promote_is_answered_pending_at_once(channel):
    """Issue 14 (nothing in the scheduler waits on disk): a lookup memory cannot answer is first answered
    "pending" by the reader thread, so a first ask returns at once (not after its wait) while the promotion
    is still held; its answer follows, and a plain wait skips the pending word."""
    handler, _, client = channel
    gate = threading.Event()
    handler.gates["cold"] = gate
    seq = client.submit("cold", "", bytes(40), 9)
    t0 = time.monotonic()
    assert client.result(seq, 30.0, until_pending=True) is PENDING
    assert time.monotonic() - t0 < 10  # the gate is still closed: only the pending word can have ended it
    assert handler.at_gate.wait(5) and not gate.is_set()
    gate.set()
    assert client.result(seq, 5.0) == LookupResult(LookupOutcome.HIT, 8)


def test_a_release_is_handled_while_every_handler_is_busy(channel):
    """A release (nothing of its request queued) is handled by the reader thread: it ends the reservation
    at once, even with every handler thread held on disk."""
    handler, _, client = channel
    gate = threading.Event()
    held = [f"cold{i}" for i in range(12)]  # more than the pool's threads
    handler.gates = dict.fromkeys(held, gate)
    cold = [client.submit(rid, "", bytes(40), 9) for rid in held]
    assert handler.at_gate.wait(5)
    client.release("other")
    assert handler.released.wait(5)
    assert ("release", "other") in handler.calls and not gate.is_set()
    gate.set()
    assert all(client.result(seq, 5.0) is not PENDING for seq in cold)


def test_a_lookup_memory_could_answer_still_waits_for_its_requests_earlier_calls(channel):
    """Calls of one request stay in order: with its earlier lookup and release still queued, a lookup memory
    could answer at once goes after them (a release never ends the newer lookup's reservation)."""
    handler, _, client = channel
    gate = threading.Event()
    handler.gates["r1"] = gate  # the first lookup waits on "disk"
    first = client.submit("r1", "", bytes(40), 9)
    assert handler.at_gate.wait(5)
    client.release("r1")
    handler.resident.add("r1")  # now memory holds it
    second = client.submit("r1", "", bytes(40), 9)
    assert client.result(second, 0.2) is PENDING  # queued behind the first lookup and the release
    gate.set()
    assert client.result(first, 5.0) is not PENDING and client.result(second, 5.0) is not PENDING
    assert handler.calls == [("lookup", "r1"), ("release", "r1"), ("lookup", "r1")]


def test_handler_error_is_a_reply_not_a_dead_service(channel):
    """A failing lookup is answered FAILED with the error (nothing to load); the service keeps serving."""
    handler, _, client = channel
    handler.fail = True
    answer = client.result(client.submit("r1", "", bytes(40), 9), 5.0)
    assert answer.outcome is LookupOutcome.FAILED and answer.loadable == 0 and "boom" in answer.error
    handler.fail = False
    assert client.result(client.submit("r2", "", bytes(40), 9), 5.0) == LookupResult(LookupOutcome.HIT, 8)


def test_wrong_authkey_is_refused(channel):
    """A client connecting with the wrong authkey is refused by the lookup channel."""
    _, service, _ = channel
    from multiprocessing import AuthenticationError

    with pytest.raises(AuthenticationError):
        LookupClient(service.path, b"x" * 32)


def test_closed_service_makes_calls_fail_as_channel_closed(channel):
    """Scenario: the worker went away; the scheduler sees ChannelClosed (served as a miss)."""
    _, service, client = channel
    service.close()
    with pytest.raises(ChannelClosed):
        for _ in range(50):
            client.result(client.submit("r", "", bytes(40), 9), 0.1)
    assert client.closed


# ------------------------------------------------------------------ paging --
BS, RATIO, CHUNK = 8, 2, 16  # block of 8 tokens split into 2 kernel pages of 4; chunks of 2 blocks


def make_layout() -> tuple[PagedLayout, dict[str, torch.Tensor]]:
    """Two groups overlaying one allocation, like vLLM: full attention (group 0), sliding window (group 1)."""
    groups = (GroupPlan(group_id=0, kind=GroupKind.FULL, block_size=BS, layer_names=("full",)),
              GroupPlan(group_id=1, kind=GroupKind.SLIDING, block_size=BS, layer_names=("swa",), sliding_window=4))
    backing = torch.zeros(16 * RATIO, 2, BS // RATIO, 6)
    caches = {"full": backing, "swa": backing}
    pages = CHUNK // (BS // RATIO)
    specs, tensors = [], []
    for g in groups:
        name = g.layer_names[0]
        specs.append(TensorSpec(name=name, group=g.group_id, category=g.category, dtype=torch.float32,
                                shape=(pages, 2, BS // RATIO, 6), token_dim=None))
        tensors.append(PagedTensor(layer=name, group_id=g.group_id, kind=g.kind, kernel_ratio=RATIO, pages=pages))
    return PagedLayout(ChunkLayout(CHUNK, tuple(specs)), tuple(tensors), groups, "test", "fp"), caches


def fill(cache: torch.Tensor) -> None:
    cache.copy_(torch.arange(cache.numel(), dtype=cache.dtype).view_as(cache))


def gather(copier: PagedCopier, layout: PagedLayout, start: int, block_ids, null: int = 0) -> list[torch.Tensor]:
    out = [torch.full(t.shape, -1.0) for t in layout.chunk.tensors]
    for i, tensor in enumerate(out):
        copier.gather_into(i, start, block_ids, null, tensor)
    return out


def scatter(copier: PagedCopier, view: ChunkView, block_ids, lo: int, hi: int, null: int = 0) -> None:
    for i in range(len(view.tensors)):
        copier.scatter_tensor(i, view.tensors[i], view.token_range[0], block_ids, null, lo, hi)


def test_gather_then_scatter_moves_pages_between_different_blocks():
    """A chunk gathered from one request's blocks and scattered into another's lands page for page."""
    layout, caches = make_layout()
    fill(caches["full"])
    copier = PagedCopier(layout, caches)
    src = ((1, 2, 3, 4), (5, 9, 7, 8))  # group 1 blocks not consecutive: gathered, not viewed
    chunk = gather(copier, layout, CHUNK, src)  # chunk 1: blocks at index 2, 3
    assert torch.equal(chunk[0], caches["full"][3 * RATIO:5 * RATIO])
    assert torch.equal(chunk[1], caches["swa"][torch.tensor([14, 15, 16, 17])])
    dst = ((10, 11, 12, 13), (0, 0, 14, 15))  # out-of-window blocks of the sliding group are null
    view = ChunkView(1, None, (CHUNK, 2 * CHUNK), tuple(chunk), layout.chunk)  # type: ignore[arg-type]
    scatter(copier, view, dst, CHUNK, 2 * CHUNK)
    assert torch.equal(caches["full"][12 * RATIO:14 * RATIO], chunk[0])
    assert torch.equal(caches["swa"][14 * RATIO:16 * RATIO], chunk[1])


def test_scatter_writes_only_the_requested_token_range():
    """Blocks before ``lo`` belong to vLLM's own cache hit and are left alone."""
    layout, caches = make_layout()
    copier = PagedCopier(layout, caches)
    chunk = tuple(torch.ones(t.shape) for t in layout.chunk.tensors)
    view = ChunkView(0, None, (0, CHUNK), chunk, layout.chunk)  # type: ignore[arg-type]
    scatter(copier, view, ((1, 2), (3, 4)), BS, CHUNK)
    assert caches["full"][1 * RATIO:2 * RATIO].abs().sum() == 0
    assert caches["full"][2 * RATIO:3 * RATIO].eq(1).all()


def test_freed_block_zero_fills_sliding_window_but_stops_full_attention():
    """A null block of a sliding-window group is zero-filled (no load past the chunk reads it); a null
    block of a full-attention group makes the chunk, and every later one, unstorable."""
    layout, caches = make_layout()
    fill(caches["full"])
    copier = PagedCopier(layout, caches)
    chunk = gather(copier, layout, 0, ((1, 2), (0, 5)))
    assert chunk[1][:RATIO].abs().sum() == 0 and torch.equal(chunk[1][RATIO:], caches["swa"][10:12])
    assert copier.usable_chunks([(0, CHUNK), (CHUNK, 2 * CHUNK)], ((1, 2, 3, 4), (0, 5, 6, 7)), null=0) == 2
    assert copier.usable_chunks([(0, CHUNK), (CHUNK, 2 * CHUNK)], ((1, 2, 0, 4), (5, 6, 7, 8)), null=0) == 1
    assert copier.usable_chunks([(0, CHUNK), (CHUNK, 2 * CHUNK)], ((0, 2, 3, 4), (5, 6, 7, 8)), null=0) == 0
    with pytest.raises(MissingPage):
        gather(copier, layout, 0, ((0, 2), (3, 5)))


def test_a_tail_is_gathered_up_to_its_end_and_needs_no_later_block():
    """A tail (a chunk's first block, kvengine.core.tails) holds that block's pages, zeros after them; a
    request that has no block past the tail yet can store it, and a load writes back only its pages."""
    layout, caches = make_layout()
    fill(caches["full"])
    copier = PagedCopier(layout, caches)
    blocks = ((1, 2, 3), (5, 6, 7))  # chunk 1 has its first block (index 2) only
    assert copier.usable_chunks([(0, CHUNK), (CHUNK, CHUNK + BS)], blocks, null=0) == 2
    assert copier.usable_chunks([(0, CHUNK), (CHUNK, 2 * CHUNK)], blocks, null=0) == 1
    tail = [torch.full(t.shape, -1.0) for t in layout.chunk.tensors]
    for i, tensor in enumerate(tail):
        copier.gather_into(i, CHUNK, blocks, 0, tensor, end=CHUNK + BS)
    assert torch.equal(tail[0][:RATIO], caches["full"][3 * RATIO:4 * RATIO]) and tail[0][RATIO:].eq(0).all()
    assert torch.equal(tail[1][:RATIO], caches["swa"][7 * RATIO:8 * RATIO]) and tail[1][RATIO:].eq(0).all()
    caches["full"].zero_()
    view = ChunkView(1, None, (CHUNK, CHUNK + BS), tuple(tail), layout.chunk)  # type: ignore[arg-type]
    scatter(copier, view, ((10, 11, 12, 13), (14, 15, 8, 9)), CHUNK, CHUNK + BS)
    assert torch.equal(caches["full"][12 * RATIO:13 * RATIO], tail[0][:RATIO])
    assert caches["full"][13 * RATIO:14 * RATIO].eq(0).all()  # the block past the tail is left alone


def test_blocks_in_range_skips_null_blocks():
    """Only the non-null blocks holding tokens in [lo, hi) of each group are returned."""
    assert blocks_in_range(((4, 5, 6), (0, 8, 9)), {0: BS, 1: BS}, [0, 1], BS, 3 * BS, 0) == {5, 6, 8, 9}


# ------------------------------------------------------------------ options --
def test_options_defaults_and_engine_config():
    """The kvengine section configures the engine and lookup_wait_ms is read as seconds."""
    opts = ConnectorOptions.from_extra_config({"kvengine": {"chunk_size": 512}, "lookup_wait_ms": 50})
    assert opts.engine.chunk_size == 512 and opts.lookup_wait_s == pytest.approx(0.05)


def test_the_worker_engine_builds_every_configured_tier(tmp_path):
    """Regression (issue 14): a connector configured with peers and no disk.path ran with no lower tier
    at all. The worker now builds its tiers with the one builder every integration uses."""
    pytest.importorskip("vllm")
    from kvengine.integrations.vllm.worker import build_engine

    peers_only = ConnectorOptions.from_extra_config({"kvengine": {"peers": {"peers": ["127.0.0.2:7000"]}}})
    both = ConnectorOptions.from_extra_config({"kvengine": {"peers": {"peers": ["127.0.0.2:7000"]},
                                                            "disk": {"path": str(tmp_path)}}})
    for options, names in ((peers_only, ["peers_tcp"]), (both, ["local_disk", "peers_tcp"])):
        engine = build_engine(options)
        try:
            assert [t.name for t in engine._core.transports] == names
        finally:
            engine.close(flush=False)


@pytest.mark.parametrize("extra, match", [
    ({"chunksize": 256}, "unknown kv_connector_extra_config keys"),
    ({"kvengine": {"chunk_sise": 256}}, "unknown key"),
    ({"kvengine": {"store_partial_chunks": True}}, "store_partial_chunks"),
    ({"lookup_wait_ms": "soon"}, "lookup_wait_ms"),
    ({"kvengine": 7}, "mapping or a YAML path"),
    ({"kvengine": {"disk": {"path": "/nonexistent", "codec": "int8-token"}}}, "is lossy"),
    ({"kvengine": {"disk": {"path": "/nonexistent", "codec": "nope"}}}, "unknown codec 'nope'"),
    ({"kvengine": {"chunk_size": 0}}, "chunk_size"),
])
def test_options_refuse_mistakes(extra, match):
    """Unknown keys, a misspelt engine key, unsupported settings or ill-typed values are a ConfigError naming them."""
    with pytest.raises(ConfigError, match=match):
        ConnectorOptions.from_extra_config(extra)


def test_category_follows_group_kind():
    """A sliding group plan's KV category is SLIDING_WINDOW."""
    assert GroupPlan(group_id=0, kind=GroupKind.SLIDING, block_size=8, layer_names=()).category \
        is KVCategory.SLIDING_WINDOW
