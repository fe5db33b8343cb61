"""The Mooncake tier's own logic against a scripted client: deadlines, the one-stuck-call rule, result codes,
records larger than any seen. (Against a real master: test_mooncake_store.py.)"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvengine.chunks.keys import ChunkKey, Namespace
from kvengine.chunks.layout import KVCategory, dtype_code
from kvengine.chunks.record import TensorDescriptor, encode_header
from kvengine.transports.mooncake_store import (
    BUFFER_TOO_SMALL,
    OBJECT_NOT_FOUND,
    MooncakeOptions,
    MooncakeStoreTransport,
)

DIGEST = Namespace(model="tiny-test").digest()


def record(i: int, nbytes: int) -> tuple[ChunkKey, bytes]:
    import torch

    key = ChunkKey(DIGEST, i.to_bytes(16, "little"))
    payload = bytes([i % 251]) * nbytes
    tensors = (TensorDescriptor(0, KVCategory.OPAQUE, dtype_code(torch.uint8), (nbytes,), nbytes),)
    return key, bytes(encode_header(key, (0, 16), tensors, codec_id=0, raw_length=nbytes, payload=payload)) + payload


class ScriptedClient:
    """An in-memory stand-in for Mooncake's client; ``hold`` makes calls block until released."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.hold = threading.Event()
        self.hold.set()
        self.calls: list[str] = []

    def setup(self, *args: Any) -> int:
        return 0

    def _wait(self, name: str) -> None:
        self.calls.append(name)
        self.hold.wait()

    def batch_put_from_multi_buffers(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                                     config: Any = None) -> list[int]:
        self._wait("put")
        for key, parts, lens in zip(keys, ptrs, sizes):
            self.objects[key] = b"".join(ctypes.string_at(p, n) for p, n in zip(parts, lens))
        return [0] * len(keys)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self._wait("get")
        return [self.get_into(k, p, n) for k, p, n in zip(keys, ptrs, sizes)]

    def get_into(self, key: str, ptr: int, size: int) -> int:
        data = self.objects.get(key)
        if data is None:
            return OBJECT_NOT_FOUND
        if len(data) > size:
            return BUFFER_TOO_SMALL
        ctypes.memmove(ptr, data, len(data))
        return len(data)

    def get_size(self, key: str) -> int:
        return len(self.objects.get(key, b"")) or OBJECT_NOT_FOUND

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._wait("exists")
        return [int(k in self.objects) for k in keys]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        return [0 if self.objects.pop(k, None) is not None else OBJECT_NOT_FOUND for k in keys]

    def close(self) -> int:
        return 0


@pytest.fixture
async def scripted(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[MooncakeStoreTransport, ScriptedClient]]:
    monkeypatch.setattr("kvengine.transports.mooncake_store._replicas", lambda n: None)
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)  # the tier sets it; monkeypatch restores it
    client = ScriptedClient()
    tier = MooncakeStoreTransport(MooncakeOptions(master="127.0.0.1:1", timeout=0.3), client_factory=lambda: client)
    assert tier.wait_connected(5)
    yield tier, client
    await tier.close()


async def test_a_record_larger_than_any_seen_is_read_again_at_its_size(scripted: Any) -> None:
    tier, client = scripted
    small, large = record(1, 1000), record(2, 3 << 20)  # the first read's buffers are 1 MiB
    client.objects.update({"kvengine/" + k.hex(): r for k, r in (small, large)})
    got = await tier.get([small[0], large[0], record(3, 10)[0]])
    assert [bytes(g) if g is not None else None for g in got] == [small[1], large[1], None]
    assert tier.counts["hits"] == 2 and tier.counts["misses"] == 1
    assert not any(k.startswith("get_code") for k in tier.counts)  # not found is a miss, not a fault


async def test_a_call_past_its_deadline_is_a_miss_and_later_calls_miss_at_once_until_it_returns(
        scripted: Any) -> None:
    tier, client = scripted
    key, rec = record(4, 100)
    assert await tier.put([(key, rec)]) == [True]
    client.hold.clear()  # the store stops answering
    t0 = time.monotonic()
    assert await tier.get([key]) == [None]
    assert 0.25 < time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert await tier.exists([key]) == [False] and await tier.put([(key, rec)]) == [False]
    assert time.monotonic() - t0 < 0.1  # answered without asking the stuck store
    assert client.calls.count("get") == 1 and tier.counts["get_timeout"] == 1
    assert tier.stats().put_failures["stalled"] == 1 and tier.counts["exists_stalled"] == 1
    client.hold.set()  # the stuck call returns: the tier asks the store again
    for _ in range(100):
        if not tier.stalled:
            break
        await asyncio.sleep(0.01)
    got = await tier.get([key])
    assert got[0] is not None and bytes(got[0]) == rec


async def test_a_tier_that_never_connects_misses_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)

    class Unreachable(ScriptedClient):
        def setup(self, *args: Any) -> int:
            return -1

    tier = MooncakeStoreTransport(MooncakeOptions(master="127.0.0.1:1"), client_factory=Unreachable)
    key, rec = record(5, 100)
    assert not tier.wait_connected(0.2)
    assert await tier.get([key]) == [None] and await tier.put([(key, rec)]) == [False]
    assert tier.counts["get_not_connected"] == 1 and tier.stats().put_failures["not_connected"] == 1
    await tier.close()


async def test_a_put_of_a_record_that_does_not_match_its_key_is_refused(scripted: Any) -> None:
    from kvengine.errors import InvalidRequestError

    tier, _ = scripted
    key, rec = record(6, 100)
    other, _ = record(7, 100)
    with pytest.raises(InvalidRequestError, match="does not match its key"):
        await tier.put([(other, rec)])
    with pytest.raises(InvalidRequestError, match="malformed record"):
        await tier.put([(key, b"not a record")])


async def test_reads_answered_as_misses_reach_the_tier_errors_metric(scripted: Any) -> None:
    """Regression: the tier answers a read past its deadline, or stalled behind a stuck call, with a miss and
    counted it only internally, so ``kvengine_tier_errors_total{tier="mooncake"}`` stayed 0 through a whole
    pass with the master stopped (only put failures were exported). Now each read fault is exported under its
    op, next to the put failures."""
    from kvengine.metrics import EngineMetrics

    tier, client = scripted
    metrics = EngineMetrics()
    metrics.watch_tiers([tier])
    key, rec = record(8, 100)
    assert await tier.put([(key, rec)]) == [True]
    assert metrics.value("kvengine_tier_errors_total", tier="mooncake") == 0
    client.hold.clear()  # the store stops answering
    try:
        assert await tier.get([key]) == [None]  # past its deadline
        assert await tier.exists([key]) == [False] and await tier.get([key]) == [None]  # stalled behind it
        assert await tier.put([(key, rec)]) == [False]
    finally:
        client.hold.set()
    assert metrics.value("kvengine_tier_errors_total", tier="mooncake", op="get") == 2
    assert metrics.value("kvengine_tier_errors_total", tier="mooncake", op="exists") == 1
    assert metrics.value("kvengine_tier_errors_total", tier="mooncake", op="delete") == 0
    assert metrics.value("kvengine_tier_put_failures_total", tier="mooncake", reason="stalled") == 1
