"""kvengine's KV event stream, read with vLLM's own classes (``vllm.distributed.kv_events``): what a router
built on vLLM's decoder sees. Needs vLLM's package (.venv-vllm), not a vLLM engine:

    .venv-vllm/bin/python -m pytest -q tests/integrations/test_vllm_kv_events.py
"""

from __future__ import annotations

import time

import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="needs vLLM (.venv-vllm)")
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvengine import KVEngine, Namespace
from kvengine.chunks.hashing import prefix_hashes
from kvengine.config import load_config
from kvengine.events import decode_batch
from tests.conftest import CHUNK, FakeKV, make_layout

TOPIC = b"kv@pod-0@tiny"


def tokens_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


class RawSubscriber:
    """A SUB socket bound on loopback, keeping each message's frames as they came."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frames: list[list[bytes]] = []

    def drain(self, timeout: float) -> int:
        got = 0
        while self.sock.poll(int(timeout * 1000)):
            self.frames.append(self.sock.recv_multipart())
            got += 1
        return got

    def sync(self, engine: KVEngine) -> None:
        """Probe until the subscription reached the publisher, then drop the probes."""
        from kvengine.events import AllBlocksCleared

        deadline = time.monotonic() + 10
        while not self.sock.poll(50):
            assert time.monotonic() < deadline, "the subscription never reached the publisher"
            engine._core.events.publish(AllBlocksCleared())
        self.drain(0.2)
        self.frames.clear()

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def sub():
    subscriber = RawSubscriber()
    yield subscriber
    subscriber.close()


def engine_for(sub: RawSubscriber, tmp_path, **events: object) -> KVEngine:
    chunk = make_layout().nbytes()
    return KVEngine(load_config({
        "chunk_size": CHUNK, "memory": {"capacity_bytes": 4 * chunk},
        "disk": {"path": str(tmp_path), "capacity_bytes": "16MiB"},
        "events": {"endpoint": sub.endpoint, "topic": TOPIC.decode(), **events},
    }, environ={}))


def run_scenario(sub: RawSubscriber, tmp_path, **events: object):
    """Two prompts into a 4-chunk memory over a disk tier (stores, disk writes, evictions), then close."""
    with engine_for(sub, tmp_path, **events) as engine:
        sub.sync(engine)
        binding = engine.bind(Namespace(model="tiny"), make_layout())
        a, b = tokens_of(3 * CHUNK, 1), tokens_of(3 * CHUNK, 2)
        engine.store(binding, a, FakeKV(len(a)).source)
        engine.flush()
        engine.store(binding, b, FakeKV(len(b)).source)
        engine.flush()
        sub.drain(0.3)
    sub.drain(0.5)  # AllBlocksCleared, sent at close
    return binding, a, b


def test_vllms_decoder_reads_kvengines_stream(sub, tmp_path):
    binding, a, b = run_scenario(sub, tmp_path)
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    batches = []
    for topic, seq, payload in sub.frames:
        assert topic == TOPIC and len(seq) == 8
        batch = decoder.decode(payload)
        assert isinstance(batch, kv_events.KVEventBatch)
        assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 60
        # Byte for byte what vLLM's encoder writes for the same objects.
        assert msgspec.msgpack.encode(batch) == payload
        batches.append((int.from_bytes(seq, "big"), batch))
    seqs = [s for s, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events = [e for _, batch in batches for e in batch.events]

    stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
    for medium in ("CPU", "DISK"):
        chunks = {}
        for event in (e for e in stored if e.medium == medium):
            assert event.block_size == CHUNK and event.lora_id is None and event.lora_name is None
            assert event.extra_keys is None and event.group_idx is None and event.locality is None
            assert len(event.token_ids) == CHUNK * len(event.block_hashes)
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                assert isinstance(h, bytes) and len(h) == 16
                chunks[h] = (parent, event.token_ids[i * CHUNK:(i + 1) * CHUNK])
                parent = h
        for tokens in (a, b):
            hashes = prefix_hashes(tokens, CHUNK, binding.digest)
            for i, h in enumerate(hashes):
                assert chunks[h] == (hashes[i - 1] if i else None, tokens[i * CHUNK:(i + 1) * CHUNK])
    removed = [h for e in events if isinstance(e, kv_events.BlockRemoved) for h in e.block_hashes]
    assert len(removed) == 2 and set(removed) <= set(prefix_hashes(a, CHUNK, binding.digest))
    assert all(e.medium == "CPU" for e in events if isinstance(e, kv_events.BlockRemoved))
    assert isinstance(events[-1], kv_events.AllBlocksCleared)


def test_int64_hashes_are_vllms_integer_form(sub, tmp_path):
    binding, a, _ = run_scenario(sub, tmp_path, hash_format="int64")
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    first = next(e for _, _, p in sub.frames for e in decoder.decode(p).events
                 if isinstance(e, kv_events.BlockStored) and e.parent_block_hash is None and e.medium == "CPU")
    expected = [maybe_convert_block_hash(h) for h in prefix_hashes(a, CHUNK, binding.digest)]
    assert all(isinstance(h, int) for h in expected)  # vLLM's default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    assert list(first.block_hashes) == expected


def test_kvengines_decoder_reads_vllms_own_batches():
    """A router using kvengine.events.decode_batch reads vLLM's stream too (fields it does not use ignored)."""
    batch = kv_events.KVEventBatch(ts=3.5, events=[
        kv_events.BlockStored(block_hashes=[7, 8], parent_block_hash=6, token_ids=list(range(32)), block_size=16,
                              lora_id=None, medium=kv_events.MEDIUM_GPU, lora_name=None, extra_keys=[None, None],
                              group_idx=0, kv_cache_spec_kind="full_attention"),
        kv_events.BlockRemoved(block_hashes=[b"x" * 32], medium=kv_events.MEDIUM_GPU, group_idx=0),
        kv_events.AllBlocksCleared(),
    ], data_parallel_rank=1)
    decoded = decode_batch(msgspec.msgpack.encode(batch))
    assert decoded.ts == 3.5 and decoded.data_parallel_rank == 1
    stored, removed, cleared = decoded.events
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium) == \
        ((7, 8), 6, list(range(32)), 16, "GPU")
    assert (removed.block_hashes, removed.medium) == ((b"x" * 32,), "GPU")
    assert type(cleared).__name__ == "AllBlocksCleared"
