"""Replicated peer reads when one owner's copies are bad: real servers on loopback sockets, both wires.

Two peer servers own every chunk (``replicas=2``, no secret). One of them serves records whose
checksums verify but whose token range is not the chunk's: only the engine's position check can
tell. The rule under test: a bad copy is deleted where it was read, never at the other owner, and
the other owner's copy is served in the same lookup.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvengine import CacheEngine, Namespace
from kvengine.chunks.keys import ChunkKey
from kvengine.chunks.record import encode_header, unpack_record
from kvengine.keyed import GetOutcome, KeyedStore, PutOutcome, keyed_namespace
from kvengine.transport import Buffer
from kvengine.transports.peers.client import PeerClientOptions, PeerTransport
from kvengine.transports.peers.placement import Membership
from kvengine.transports.peers.store import MemoryRecordStore
from kvengine.transports.peers.tcp import TcpConnector, TcpPeerServer
from kvengine.transports.peers.zmq import ZmqConnector, ZmqPeerServer
from tests.conftest import CHUNK, FakeKV, copier, make_config, make_layout

MiB = 1 << 20
CHUNKS = 48
OPTIONS = PeerClientOptions(replicas=2, request_timeout=2.0, read_deadline=20.0, write_timeout=10.0, cooldown=30.0)


class WrongPositionStore(MemoryRecordStore):
    """Stores records faithfully; serves each with its token range moved one chunk on and the header
    resealed: every checksum verifies, only the position is wrong."""

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        return [None if r is None else _moved(r) for r in await super().get(keys)]


def _moved(record: Buffer) -> bytes:
    header, payload = unpack_record(memoryview(record))
    span = (header.token_start + CHUNK, header.token_end + CHUNK)
    return encode_header(header.key, span, header.tensors, codec_id=header.codec_id, raw_length=header.raw_length,
                         payload=payload, flags=header.flags) + bytes(payload)


class LateExistsStore(MemoryRecordStore):
    """An honest store that answers ``exists`` a little late, so the other owner's answer comes first
    and reads ask that owner first."""

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        await asyncio.sleep(0.05)
        return await super().exists(keys)


@dataclass
class Pair:
    """The two owners of every chunk: ``healthy`` and ``liar``, and a client of them per engine."""

    wire: str
    healthy: MemoryRecordStore
    liar: MemoryRecordStore
    addresses: list[str]

    def client(self) -> PeerTransport:
        connector: Any = ZmqConnector() if self.wire == "zmq" else TcpConnector()
        return PeerTransport(connector, Membership(self.addresses), OPTIONS)

    async def holds(self, store: MemoryRecordStore, keys: Sequence[ChunkKey]) -> int:
        return sum(await store.exists(keys))


@pytest.fixture(params=["zmq", "tcp"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    healthy, liar = LateExistsStore(64 * MiB), WrongPositionStore(64 * MiB)
    server = ZmqPeerServer if request.param == "zmq" else TcpPeerServer
    servers = [server(healthy, "127.0.0.2:0"), server(liar, "127.0.0.3:0")]
    for s in servers:
        await s.start()
    try:
        yield Pair(request.param, healthy, liar, [str(s.address) for s in servers])
    finally:
        for s in servers:
            await s.close()


async def _engine(transport: PeerTransport) -> CacheEngine:
    engine = CacheEngine(make_config(capacity=4 * MiB), transports=[transport])
    await engine.start()
    return engine


async def test_a_replica_at_the_wrong_position_is_deleted_at_its_owner_only_and_the_other_served(pair: Pair) -> None:
    """Regression: with ``replicas=2`` and one owner serving records that verify but cover the wrong tokens,
    the engine's position check deleted each rejected chunk at every owner, the healthy one included
    (16-40 of 48 chunks lost in one run), and the healthy copy was not served in that lookup.

    Now: every chunk is loaded exactly (from the healthy owner), which still holds all of them; each bad
    copy is deleted at the liar only; every rejection is counted."""
    layout = make_layout()
    tokens, kv = list(range(CHUNKS * CHUNK)), FakeKV(CHUNKS * CHUNK)
    writer = await _engine(pair.client())
    await writer.store(writer.bind(Namespace(model="m"), layout), tokens, kv.source)
    await writer.flush()
    await writer.close()
    reader_transport = pair.client()
    reader = await _engine(reader_transport)
    binding = reader.bind(Namespace(model="m"), layout)
    res = await reader.lookup(binding, "r", tokens)
    keys = list(res.reservation.keys)
    out = [torch.zeros_like(t) for t in kv.layers]
    loaded = await reader.load(res, copier(out))

    assert res.tokens == CHUNKS * CHUNK and loaded.ok and loaded.loaded_tokens == CHUNKS * CHUNK
    assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    assert await pair.holds(pair.healthy, keys) == CHUNKS
    assert await pair.holds(pair.liar, keys) == 0
    assert reader.metrics.value("kvengine_integrity_failures_total", tier=reader_transport.name,
                                reason="wrong_position") == CHUNKS
    assert reader_transport.counts["rejected_by_engine"] == CHUNKS
    assert reader.memory.total_pins() == 0
    await reader.close()


async def test_keyed_gets_are_served_by_the_healthy_replica(pair: Pair) -> None:
    """Regression (the keyed path, which admits what it reads the same way): a keyed get whose first owner
    serves wrong-position copies gets every page from the other owner, which keeps them; the bad copies
    are deleted at their owner only."""
    layout = make_layout()
    namespace = keyed_namespace(Namespace(model="keyed"), "test-keys")
    names = [f"page-{i}".encode() for i in range(8)]
    kv = FakeKV(len(names) * CHUNK)
    writer = await _engine(pair.client())
    assert await KeyedStore(writer, writer.bind(namespace, layout)).put(
        names, lambda i: kv.source(i, i * CHUNK, (i + 1) * CHUNK)) == [PutOutcome.STORED] * len(names)
    await writer.flush()
    await writer.close()
    reader = await _engine(pair.client())
    store = KeyedStore(reader, reader.bind(namespace, layout))
    got: dict[int, list[torch.Tensor]] = {}
    outcomes = await store.get(names, lambda i, tensors: got.__setitem__(i, [t.clone() for t in tensors]))

    assert outcomes == [GetOutcome.HIT] * len(names)
    for i, tensors in got.items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, kv.source(i, i * CHUNK, (i + 1) * CHUNK)))
    keys = store.chunk_keys(names)
    assert await pair.holds(pair.healthy, keys) == len(names)
    assert await pair.holds(pair.liar, keys) == 0
    await reader.close()


async def test_a_chunk_bad_at_every_owner_is_a_miss_deleted_at_each_and_nothing_else_is_touched() -> None:
    """With both owners serving wrong-position copies, the lookup is a miss: the first chunk's copy is
    deleted at each owner (each once, where it was read), and no other chunk is deleted anywhere."""
    stores = [WrongPositionStore(64 * MiB), WrongPositionStore(64 * MiB)]
    servers = [TcpPeerServer(stores[0], "127.0.0.2:0"), TcpPeerServer(stores[1], "127.0.0.3:0")]
    for s in servers:
        await s.start()
    addresses = [str(s.address) for s in servers]
    layout = make_layout()
    tokens, kv = list(range(4 * CHUNK)), FakeKV(4 * CHUNK)
    writer = await _engine(PeerTransport(TcpConnector(), Membership(addresses), OPTIONS))
    written = writer.bind(Namespace(model="m"), layout)
    await writer.store(written, tokens, kv.source)
    await writer.flush()
    res = await writer.lookup(written, "w", tokens)
    keys = list(res.reservation.keys)
    await writer.release(res)
    await writer.close()
    reader_transport = PeerTransport(TcpConnector(), Membership(addresses), OPTIONS)
    reader = await _engine(reader_transport)
    res = await reader.lookup(reader.bind(Namespace(model="m"), layout), "r", tokens)

    assert res.tokens == 0
    for store in stores:
        assert await store.exists(keys) == [False, True, True, True]
    assert reader.metrics.value("kvengine_integrity_failures_total", reason="wrong_position") == 2
    await reader.release(res)
    await reader.close()
    for s in servers:
        await s.close()
