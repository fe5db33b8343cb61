"""KV events: kvengine's chunks entering and leaving tiers, published in vLLM's wire format over ZeroMQ.

A real SUB socket on loopback receives what real engines publish; the frames are decoded here with
plain msgpack (vLLM's own decoder reads the same stream in tests/integrations/test_vllm_kv_events.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import msgpack
import pytest
import zmq

from kvengine import KVEngine, Namespace
from kvengine.chunks.hashing import prefix_hashes
from kvengine.chunks.keys import ChunkKey
from kvengine.config import load_config
from kvengine.errors import ConfigError
from kvengine.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    coalesce,
    decode_batch,
    encode_batch,
    medium_of,
)

from .conftest import CHUNK, FakeKV, make_layout

TOPIC = "kv@test-pod@tiny"
CHUNK_BYTES = make_layout().nbytes()  # one chunk of the test layout in memory


# -- a subscriber ---------------------------------------------------------------------------------
@dataclass
class Message:
    topic: bytes
    seq: int
    batch: EventBatch


class Subscriber:
    """A SUB socket bound on loopback (engines connect to it, as vLLM's pods connect to llm-d's indexer)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.messages: list[Message] = []

    def recv(self, timeout: float) -> Message | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        frames = self.sock.recv_multipart()
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert len(seq) == 8
        message = Message(topic, int.from_bytes(seq, "big"), decode_batch(payload))
        self.messages.append(message)
        return message

    def sync(self, publisher: KVEventPublisher | None) -> None:
        """Wait until the subscription reached ``publisher`` (an engine's or the host service's: ZeroMQ drops
        what a PUB sends before it knows a subscriber), probing with AllBlocksCleared; then forget the
        probes."""
        assert publisher is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            publisher.publish(AllBlocksCleared())
            if self.recv(0.05) is not None:
                while self.recv(0.2) is not None:
                    pass
                self.probes = len(self.messages)
                return
        raise AssertionError("the subscription never reached the publisher")

    def events(self, kind: type | None = None) -> list:
        out = [e for m in self.messages[self.probes:] for e in m.batch.events]
        return [e for e in out if kind is None or isinstance(e, kind)]

    def wait_for(self, done, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out; events so far: {self.events()}"
            self.recv(0.05)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def sub(ctx):
    return Subscriber(ctx)


def events_config(endpoint: str, **events: object) -> dict:
    return {"endpoint": endpoint, "topic": TOPIC, **events}


def make_engine(endpoint: str, *, capacity: int = 1 << 20, events: dict | None = None, **extra: object) -> KVEngine:
    return KVEngine(load_config({"chunk_size": CHUNK, "memory": {"capacity_bytes": capacity},
                                 "events": events_config(endpoint, **(events or {})), **extra}, environ={}))


def chunks_of(stored: list[BlockStored]) -> list[tuple[bytes, bytes | None, list[int], str]]:
    """Per chunk: (hash, parent hash, token ids, medium), runs of several chunks split back up."""
    out = []
    for event in stored:
        ids = event.token_ids
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            out.append((h, parent, ids[i * event.block_size:(i + 1) * event.block_size], event.medium))
            parent = h
    return out


def expected_chunks(binding, tokens: list[int], first: int = 0, medium: str = "CPU"):
    hashes = prefix_hashes(tokens, CHUNK, binding.digest)
    return [(hashes[i], hashes[i - 1] if i else None, tokens[i * CHUNK:(i + 1) * CHUNK], medium)
            for i in range(first, len(hashes))]


def tokens_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


# -- the wire format, without sockets ------------------------------------------------------------
def test_batches_roundtrip_and_runs_merge():
    h = [bytes([i]) * 16 for i in range(4)]
    tok = lambda a, b: b"".join(i.to_bytes(4, "little") for i in range(a, b))  # noqa: E731
    events = [BlockStored((h[0],), None, tok(0, 4), 4, "CPU"), BlockStored((h[1],), h[0], tok(4, 8), 4, "CPU"),
              BlockStored((h[2],), h[1], tok(8, 12), 4, "DISK"),  # another medium: its own event
              BlockRemoved((h[0],), "CPU"), BlockRemoved((h[1],), "CPU"), AllBlocksCleared(),
              BlockStored((h[3],), h[0], tok(0, 4), 4, "CPU")]
    merged = coalesce(events)
    assert merged == [BlockStored((h[0], h[1]), None, tok(0, 8), 4, "CPU"), events[2],
                      BlockRemoved((h[0], h[1]), "CPU"), AllBlocksCleared(), events[6]]
    assert merged[0].token_ids == list(range(8))
    batch = EventBatch(12.5, tuple(merged), 0)
    assert decode_batch(encode_batch(batch)) == batch
    raw = msgpack.unpackb(encode_batch(batch))
    assert raw[0] == 12.5 and raw[2] == 0
    assert list(raw[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name"]  # vLLM's field order, the tag first
    assert raw[1][0]["block_hashes"] == [h[0], h[1]] and raw[1][0]["lora_id"] is None
    assert raw[1][2] == {"type": "BlockRemoved", "block_hashes": [h[0], h[1]], "medium": "CPU"}
    assert raw[1][3] == {"type": "AllBlocksCleared"}
    as_int = msgpack.unpackb(encode_batch(batch, hash_format="int64"))[1][0]
    assert as_int["block_hashes"] == [int.from_bytes(x, "big") & (2**64 - 1) for x in (h[0], h[1])]


def test_a_partial_chunk_ends_a_run():
    h = [bytes([i]) * 16 for i in range(3)]
    partial = BlockStored((h[0],), None, b"\0" * 8, 4, "CPU")  # 2 tokens of a 4-token chunk
    after = BlockStored((h[1],), h[0], b"\0" * 16, 4, "CPU")
    assert coalesce([partial, after]) == [partial, after]


def test_media():
    assert [medium_of(t) for t in ("memory", "local_disk", "peers_zmq", "peers_tcp", "mooncake", "s3_store")] == \
        ["CPU", "DISK", "PEERS", "PEERS", "MOONCAKE", "S3_STORE"]


def test_publish_never_blocks_and_counts_drops():
    """A full queue (here: a publisher whose thread never started) drops events, counted, at once."""
    publisher = KVEventPublisher("tcp://127.0.0.1:9", queue_size=4)
    started = time.perf_counter()
    for _ in range(1000):
        publisher.publish(AllBlocksCleared())
    assert time.perf_counter() - started < 0.5
    assert publisher.stats().dropped == 996
    publisher.close()
    publisher.publish(AllBlocksCleared())  # closed: dropped, never raises
    assert publisher.stats().dropped == 997


def test_config():
    assert load_config({}, environ={}).events.endpoint is None
    cfg = load_config({}, environ={"KVENGINE_EVENTS__ENDPOINT": "tcp://127.0.0.1:5557",
                                   "KVENGINE_EVENTS__TOPIC": "kv@a@m"})
    assert (cfg.events.endpoint, cfg.events.topic) == ("tcp://127.0.0.1:5557", "kv@a@m")
    with pytest.raises(ConfigError, match="events.endpoint"):
        load_config({"events": {"endpoint": "127.0.0.1:5557"}}, environ={})
    with pytest.raises(ConfigError, match="did you mean 'topic'"):
        load_config({"events": {"endpoint": "tcp://127.0.0.1:5557", "topics": "x"}}, environ={})


def test_off_costs_nothing():
    """Events off: no publisher anywhere, no event is built."""
    with KVEngine(load_config({"chunk_size": CHUNK}, environ={})) as engine:
        assert engine._core.events is None and engine._core.memory._events is None
        assert engine._core.writer.events is None
        b = engine.bind(Namespace(model="tiny"), make_layout())
        engine.store(b, tokens_of(3 * CHUNK, 1), FakeKV(3 * CHUNK).source)
        assert not any(e.announced for e in engine._core.memory._entries.values())
        assert "KV events off" in engine._core.describe()


def test_an_endpoint_that_cannot_be_bound_is_a_config_error(ctx):
    taken = ctx.socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:0")
    try:
        with pytest.raises(ConfigError, match="events"):
            make_engine(taken.getsockopt_string(zmq.LAST_ENDPOINT), events={"bind": True})
    finally:
        taken.close(linger=0)


# -- real engines ---------------------------------------------------------------------------------
def test_stores_publish_chained_chunks_with_their_tokens(sub):
    with make_engine(sub.endpoint) as engine:
        sub.sync(engine._core.events)
        binding = engine.bind(Namespace(model="tiny"), make_layout())
        first = tokens_of(3 * CHUNK + 5, 1)  # a trailing partial chunk is not stored, not announced
        assert engine.store(binding, first, FakeKV(len(first)).source).stored_chunks == 3
        sub.wait_for(lambda: len(chunks_of(sub.events(BlockStored))) == 3)
        assert chunks_of(sub.events(BlockStored)) == expected_chunks(binding, first)
        # A second prompt sharing two chunks: only its new chunk, chained to the shared prefix.
        second = first[: 2 * CHUNK] + tokens_of(2 * CHUNK, 2)
        assert engine.store(binding, second, FakeKV(len(second)).source).stored_chunks == 2
        sub.wait_for(lambda: len(chunks_of(sub.events(BlockStored))) == 5)
        assert chunks_of(sub.events(BlockStored))[3:] == expected_chunks(binding, second, first=2)
        stored = sub.events(BlockStored)
        assert all(e.block_size == CHUNK and e.lora_name is None for e in stored)
        assert not sub.events(BlockRemoved)
    # Closed: everything it announced is gone.
    sub.wait_for(lambda: isinstance(sub.messages[-1].batch.events[-1], AllBlocksCleared))
    assert all(m.topic == TOPIC.encode() and m.batch.data_parallel_rank == 0 for m in sub.messages)
    seqs = [m.seq for m in sub.messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one more per batch, none missed


def test_evictions_publish_removals(sub):
    with make_engine(sub.endpoint, capacity=4 * CHUNK_BYTES) as engine:
        sub.sync(engine._core.events)
        binding = engine.bind(Namespace(model="tiny"), make_layout())
        a, b = tokens_of(3 * CHUNK, 1), tokens_of(3 * CHUNK, 2)
        engine.store(binding, a, FakeKV(len(a)).source)
        engine.store(binding, b, FakeKV(len(b)).source)  # room for 4 chunks: 2 of a's go
        sub.wait_for(lambda: len(chunks_of(sub.events(BlockStored))) == 6 and len(sub.events(BlockRemoved)) >= 1)
        sub.wait_for(lambda: sum(len(e.block_hashes) for e in sub.events(BlockRemoved)) == 2)
        removed = [h for e in sub.events(BlockRemoved) for h in e.block_hashes]
        assert all(e.medium == "CPU" for e in sub.events(BlockRemoved))
        a_hashes = prefix_hashes(a, CHUNK, binding.digest)
        assert set(removed) <= set(a_hashes)
        for h in a_hashes:  # what was announced removed is gone, the rest still held
            assert engine._core.holds(ChunkKey(binding.digest, h)) == (h not in removed)
        # Every removal follows its store, in stream order.
        order = [(type(e), h) for e in sub.events() for h in getattr(e, "block_hashes", ())]
        for h in removed:
            assert order.index((BlockStored, h)) < order.index((BlockRemoved, h))


@pytest.mark.parametrize("write_mode", ["write_behind", "write_through"])
def test_lower_tier_writes_publish_their_medium(sub, tmp_path, write_mode):
    with make_engine(sub.endpoint, disk={"path": str(tmp_path), "capacity_bytes": "16MiB"},
                     write_mode=write_mode) as engine:
        sub.sync(engine._core.events)
        binding = engine.bind(Namespace(model="tiny"), make_layout())
        tokens = tokens_of(4 * CHUNK, 3)
        engine.store(binding, tokens, FakeKV(len(tokens)).source)
        engine.flush()
        disk = lambda: sorted(c for c in chunks_of(sub.events(BlockStored)) if c[3] == "DISK")  # noqa: E731
        sub.wait_for(lambda: len(disk()) == 4)
        assert disk() == sorted(expected_chunks(binding, tokens, medium="DISK"))
        cpu = [c for c in chunks_of(sub.events(BlockStored)) if c[3] == "CPU"]
        assert cpu == expected_chunks(binding, tokens)


def test_promotions_and_staged_stores_are_announced(sub, tmp_path):
    disk = {"path": str(tmp_path), "capacity_bytes": "16MiB"}
    tokens = tokens_of(3 * CHUNK, 4)
    with make_engine(sub.endpoint, disk=disk) as writer:
        sub.sync(writer._core.events)
        binding = writer.bind(Namespace(model="tiny"), make_layout())
        # begin_store/commit_store: the caller fills the slots itself (and may reuse its token buffer).
        buffer = list(tokens)
        staged = writer.begin_store(binding, buffer)
        buffer[:] = [0] * len(buffer)
        kv = FakeKV(len(tokens))
        for view in staged.chunks:
            for dst, src in zip(view.tensors, kv.source(view.index, *view.token_range)):
                dst.copy_(src)
        assert writer.commit_store(staged, len(staged.chunks)).stored_chunks == 3
        sub.wait_for(lambda: len([c for c in chunks_of(sub.events(BlockStored)) if c[3] == "DISK"]) == 3)
        assert [c for c in chunks_of(sub.events(BlockStored)) if c[3] == "CPU"] == expected_chunks(binding, tokens)
    sub.wait_for(lambda: isinstance(sub.messages[-1].batch.events[-1], AllBlocksCleared))
    # A fresh engine on the same disk: a lookup promotes the chunks into memory, which announces them.
    with make_engine(sub.endpoint, disk=disk) as reader:
        sub.sync(reader._core.events)
        binding = reader.bind(Namespace(model="tiny"), make_layout())
        res = reader.lookup(binding, "r1", tokens)
        assert res.tokens == 3 * CHUNK
        sub.wait_for(lambda: len(chunks_of(sub.events(BlockStored))) == 3)
        assert chunks_of(sub.events(BlockStored)) == expected_chunks(binding, tokens)
        reader.release(res)
        reader.lookup(binding, "r2", tokens)  # resident now: nothing announced twice
        time.sleep(0.3)
        while sub.recv(0.1) is not None:
            pass
        assert len(chunks_of(sub.events(BlockStored))) == 3


def test_int64_hashes_and_the_adapter(sub):
    with make_engine(sub.endpoint, events={"hash_format": "int64"}) as engine:
        sub.sync(engine._core.events)
        binding = engine.bind(Namespace(model="tiny", adapter_id="my-lora"), make_layout())
        tokens = tokens_of(2 * CHUNK, 5)
        engine.store(binding, tokens, FakeKV(len(tokens)).source)
        sub.wait_for(lambda: len(sub.events(BlockStored)) == 1)
        (event,) = sub.events(BlockStored)
        assert event.block_hashes == tuple(int.from_bytes(h, "big") & (2**64 - 1)
                                           for h in prefix_hashes(tokens, CHUNK, binding.digest))
        assert event.parent_block_hash is None and event.lora_name == "my-lora"


def test_replay_serves_missed_batches(ctx):
    """Nobody subscribed while the engine stored; a replay request from seq 0 gets every batch, then the end."""
    with make_engine("tcp://127.0.0.1:0", events={"bind": True, "replay_endpoint": "tcp://127.0.0.1:0"}) as engine:
        binding = engine.bind(Namespace(model="tiny"), make_layout())
        for seed in range(3):
            tokens = tokens_of(2 * CHUNK, 10 + seed)
            engine.store(binding, tokens, FakeKV(len(tokens)).source)
        deadline = time.monotonic() + 10
        while engine._core.events.stats().events < 6:  # one per chunk, all sent (a store does not wait for it)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(engine._core.events.replay_endpoint)
        client.send_multipart((b"", (0).to_bytes(8, "big")))
        replies = []
        while True:
            assert client.poll(5000), "no replay reply"
            frames = client.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                break
            replies.append((frames[1], int.from_bytes(frames[2], "big"), decode_batch(frames[3])))
        client.close()
        assert [seq for _, seq, _ in replies] == list(range(len(replies)))
        assert all(topic == TOPIC.encode() for topic, _, _ in replies)
        stored = [e for _, _, batch in replies for e in batch.events if isinstance(e, BlockStored)]
        assert len(chunks_of(stored)) == 6


def test_absent_or_slow_subscribers_never_block_a_store(ctx):
    """Connected to nobody, or to a subscriber that never reads: stores take as long as without events."""
    silent = ctx.socket(zmq.SUB)
    silent.setsockopt(zmq.RCVHWM, 1)
    silent.setsockopt(zmq.SUBSCRIBE, b"")
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    nobody = ctx.socket(zmq.PUB)  # a port bound then closed: nobody listens there
    nobody.bind("tcp://127.0.0.1:0")
    absent = nobody.getsockopt_string(zmq.LAST_ENDPOINT)
    nobody.close(linger=0)
    for endpoint in (absent, silent.getsockopt_string(zmq.LAST_ENDPOINT)):
        engine = make_engine(endpoint, capacity=8 * CHUNK_BYTES, events={"queue_size": 16})
        binding = engine.bind(Namespace(model="tiny"), make_layout())
        kv = FakeKV(4 * CHUNK)
        done = threading.Event()

        def stores(engine=engine, binding=binding, kv=kv, done=done) -> None:
            for seed in range(200):  # 800 chunks through 8 slots: stores and evictions, 1000+ events
                engine.store(binding, tokens_of(4 * CHUNK, 100 + seed), kv.source)
            done.set()

        worker = threading.Thread(target=stores, daemon=True)
        worker.start()
        assert done.wait(60), f"stores blocked with subscriber at {endpoint}"
        started = time.perf_counter()
        engine.close()
        assert time.perf_counter() - started < 5
        stats = engine._core.events.stats()
        assert stats.events + stats.dropped >= 1000
    silent.close()
