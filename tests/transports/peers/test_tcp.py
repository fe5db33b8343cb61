"""The tcp wire (kvengine's own framing, optional TLS) on real loopback sockets, client and server on one loop.

Attacks against a standalone server process are in test_hostile_tcp.py; multi-process clusters in
test_e2e.py.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvengine.config import load_config
from kvengine.errors import ConfigError
from kvengine.tiers import build_tiers
from kvengine.transport import ReadScope, read_scope
from kvengine.transports.peers.client import PeerClientOptions, PeerTransport
from kvengine.transports.peers.placement import Membership, Peer, rendezvous_owners
from kvengine.transports.peers.protocol import Limits, Op, decode_header, encode_request
from kvengine.transports.peers.service import ServerOptions
from kvengine.transports.peers.store import MemoryRecordStore
from kvengine.transports.peers.tcp import (
    _READ_AHEAD,
    TcpConnector,
    TcpOptions,
    TcpPeerServer,
    TcpServerOptions,
    TlsConfig,
    create_transport,
)
from tests.transports.conftest import DelayedStore
from tests.transports.peers.certs import Pki

MiB = 1 << 20
FAST = PeerClientOptions(replicas=1, request_timeout=0.5, read_deadline=1.0, write_timeout=2.0, cooldown=30.0)
_LEN = struct.Struct("<I")


async def _server(store: MemoryRecordStore | None = None, options: ServerOptions | None = None,
                  **tcp: Any) -> TcpPeerServer:
    server = TcpPeerServer(store if store is not None else MemoryRecordStore(256 * MiB), "127.0.0.2:0", options, TcpServerOptions(**tcp))
    await server.start()
    return server


def _client(server: TcpPeerServer, options: PeerClientOptions = FAST, **tcp: Any) -> PeerTransport:
    assert server.address is not None
    return PeerTransport(TcpConnector(options.limits, TcpOptions(**tcp)), Membership([server.address]), options)


@pytest.fixture
async def server() -> AsyncIterator[TcpPeerServer]:
    s = await _server()
    yield s
    await s.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


async def test_put_get_exists_delete_round_trip_small_and_large_records(server: TcpPeerServer,
                                                                        make_record: Any) -> None:
    """Records below and above the one-buffer payload size, with misses between hits in one reply."""
    client = _client(server)
    items = [make_record(n) for n in (10, 5000, 300 << 10, 9 * MiB)]
    absent = make_record(10)[0]
    assert await client.put(items) == [True] * 4
    keys = [items[0][0], absent, items[1][0], items[2][0], absent, items[3][0]]
    got = await client.get(keys)
    assert [None if g is None else bytes(g) for g in got] == [items[0][1], None, items[1][1], items[2][1], None,
                                                              items[3][1]]
    assert await client.exists([items[2][0], absent]) == [True, False]
    assert await client.delete([items[0][0]]) == [True]
    assert await client.get([items[0][0]]) == [None]
    await client.close()


async def test_mutual_tls_round_trip_and_strangers_are_refused(pki: Pki, tmp_path: Path, make_record: Any) -> None:
    """A client with a certificate of the group's CA is served; one without a certificate, or one that trusts
    another CA (so cannot verify the server), gets misses, never an exception."""
    server = await _server(tls=pki.tls("server"))
    member = _client(server, tls=pki.tls("member"))
    item = make_record(4096)
    assert await member.put([item]) == [True]
    assert [bytes(r) for r in await member.get([item[0]]) if r is not None] == [item[1]]
    anonymous = _client(server, tls=TlsConfig(ca=pki.ca))
    other = Pki.create(tmp_path / "other", "other")
    wrong_trust = _client(server, tls=other.tls("outsider"))
    for stranger in (anonymous, wrong_trust):
        assert await stranger.get([item[0]]) == [None]
        assert any(k.startswith("error_") for k in stranger.connector.counts)  # type: ignore[attr-defined]
        await stranger.close()
    assert server.counts["op_get"] == 1  # only the member's get reached the service
    await member.close()
    await server.close()


async def test_a_trickled_message_is_cut_at_its_deadline_and_idle_connections_are_reopened(make_record: Any) -> None:
    """Slowloris: a message whose first bytes arrived must be whole within message_timeout, or the connection is closed; an idle pooled connection closed by the server is replaced transparently."""
    server = await _server(message_timeout=0.3, idle_timeout=0.3)
    assert server.address is not None
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(_LEN.pack(40)[:3])
    t0 = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
    assert 0.25 < time.monotonic() - t0 < 2
    assert server.counts["closed_message_timeout"] == 1
    client = _client(server)
    item = make_record(100)
    assert await client.put([item]) == [True]
    deadline = time.monotonic() + 5  # the pooled connection is closed as idle (idle_timeout 0.3 s) ...
    while server.counts["closed_idle"] < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert server.counts["closed_idle"] >= 1
    assert [bytes(r) for r in await client.get([item[0]]) if r is not None] == [item[1]]  # ... and reopened
    await client.close()
    await server.close()


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, list[bool], bytes]:
    """One reply off a raw connection: its request id, flags and payload."""
    (n,) = _LEN.unpack(await reader.readexactly(4))
    msg = decode_header(await reader.readexactly(n), Limits(), reply=True)
    return msg.request_id, list(msg.flags), await reader.readexactly(msg.payload_bytes)


async def test_pipelined_requests_read_ahead_are_answered_in_order_and_deadlines_still_hold(make_record: Any) -> None:
    """Three gets in one write (read ahead together, while the first is served the rest wait parsed-not): three
    replies in order. After them, a trickled message is still cut at its deadline (one timer per connection,
    moved as requests come)."""
    store = DelayedStore(MiB, 0.05)
    item = make_record(4096)
    await store.put([item])
    server = await _server(store, message_timeout=0.3, idle_timeout=5)
    assert server.address is not None
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    for _ in range(2):  # the second round: after replies, on a connection that read ahead before
        requests = [encode_request(Op.GET, rid, [item[0]]) for rid in (7, 8, 9)]
        writer.write(b"".join(_LEN.pack(len(r)) + r for r in requests))
        assert [await _read_reply(reader) for _ in requests] == [(rid, [True], item[1]) for rid in (7, 8, 9)]
    writer.write(_LEN.pack(40)[:3])
    t0 = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert 0.25 < time.monotonic() - t0 < 2
    assert server.counts["closed_message_timeout"] == 1 and server.counts["op_get"] == 6
    await server.close()


async def test_a_client_sending_while_its_request_is_served_is_paused_after_the_read_ahead(make_record: Any) -> None:
    """Bytes that come while a request is served are kept, up to the read-ahead buffer, then the server stops
    reading (TCP pushes back): a client that floods holds at most that much of the server's memory. Once the
    reply is out, the kept bytes are parsed: garbage closes the connection, counted."""
    store = DelayedStore(MiB, 1.0)
    item = make_record(100)
    await store.put([item])
    server = await _server(store)
    assert server.address is not None
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    request = encode_request(Op.GET, 1, [item[0]])
    writer.write(_LEN.pack(len(request)) + request + b"\xff" * (4 * _READ_AHEAD))
    await asyncio.sleep(0.5)  # the get is being served
    (conn,) = server._connections
    assert conn._kept[1] == _READ_AHEAD and conn.transport is not None and not conn.transport.is_reading()
    assert await _read_reply(reader) == (1, [True], item[1])
    with pytest.raises(ConnectionResetError):  # the kept garbage broke the framing: closed, unread bytes reset it
        await asyncio.wait_for(reader.read(), 5)
    assert server.counts["dropped_connection_too_large"] == 1
    await server.close()


async def test_requests_beyond_the_clients_share_of_the_receive_budget_wait_unread_then_are_served(
        make_record: Any) -> None:
    """Four 400 KiB puts at once against a 1 MiB receive budget, of which one client holds at most half: the ones
    that do not fit its share wait unread, all are stored, the budget is whole again after. A 700 KiB put,
    beyond the share, is refused at once (counted), holding nothing."""
    server = await _server(receive_budget_bytes=MiB, min_client_share_bytes=MiB // 4)
    client = _client(server)
    items = [make_record(400 << 10) for _ in range(4)]
    assert await asyncio.gather(*(client.put([item]) for item in items)) == [[True]] * 4
    assert server.budget.free == MiB  # every byte taken was given back
    t0 = time.monotonic()
    assert await client.put([make_record(700 << 10)]) == [False]
    assert time.monotonic() - t0 < FAST.request_timeout  # refused, not waited on
    assert server.counts["refused_over_client_share"] == 1 and server.budget.free == MiB
    await client.close()
    await server.close()


async def test_a_late_reply_is_never_taken_for_a_later_request(make_record: Any) -> None:
    """A request that times out loses its connection, so its reply cannot meet the next request."""
    store = DelayedStore(MiB, 0.6, 0.0)
    a, b = make_record(100), make_record(100)
    await store.put([a, b])
    server = await _server(store)
    connector = TcpConnector(options=TcpOptions(connections_per_peer=1))
    peer = Peer.parse(server.address or "")
    assert await connector.request(peer, Op.GET, [a[0]], (), timeout=0.2) is None
    answer = await connector.request(peer, Op.GET, [b[0]], (), timeout=5.0)
    assert answer is not None and [bytes(r) for r in answer[1]] == [b[1]]
    assert connector.counts["timeouts"] == 1
    await connector.close()
    await server.close()


async def test_a_client_beyond_its_in_flight_share_is_refused_busy(make_record: Any) -> None:
    """A client with more requests in flight than max_inflight_per_client gets BUSY for the extra one at once (not queued)."""
    store = DelayedStore(MiB, 0.3)
    item = make_record(100)
    await store.put([item])
    server = await _server(store, ServerOptions(max_inflight_per_client=1))
    connector = TcpConnector(options=TcpOptions(connections_per_peer=2))
    peer = Peer.parse(server.address or "")
    answers = await asyncio.gather(*(connector.request(peer, Op.GET, [item[0]], (), timeout=2.0) for _ in range(2)))
    statuses = sorted(a[0].status.name for a in answers if a is not None)
    assert statuses == ["BUSY", "OK"]
    assert server.counts["refused_busy"] == 1
    await connector.close()
    await server.close()


async def test_connections_beyond_the_per_client_cap_are_closed_at_once() -> None:
    """A client's connections beyond max_connections_per_client are closed on accept; the ones within the cap are served."""
    server = await _server(max_connections_per_client=2)
    assert server.address is not None
    host, port = server.address.rsplit(":", 1)
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
    assert await asyncio.wait_for(conns[2][0].read(), 2) == b""
    assert server.counts["refused_connection_client_limit"] == 1
    ping = encode_request(Op.PING, 1, [])
    conns[0][1].write(_LEN.pack(len(ping)) + ping)  # the first two are served
    assert len(await asyncio.wait_for(conns[0][0].read(100), 2)) > 0
    for _, writer in conns:
        writer.close()
    await server.close()


def test_engine_config_builds_a_tls_tcp_peer_tier_and_refuses_mismatched_wire_options(pki: Pki) -> None:
    """peers.transport=tcp with TLS files builds the tier; TLS files on another wire, CURVE keys on tcp, a certificate without a CA, or a remote peer without protection are refused, naming the setting."""
    tls = pki.tls("engine")
    config = load_config({"peers": {"transport": "tcp", "peers": ["127.0.0.2:7000"],
                                                    "tls_ca": str(tls.ca), "tls_cert": str(tls.cert),
                                                    "tls_key": str(tls.key)}})
    (tier,) = build_tiers(config)
    assert isinstance(tier.transport, PeerTransport) and tier.transport.name == "peers_tcp"
    with pytest.raises(ConfigError, match=r"peers\.tls_\* files are for peers\.transport=tcp, not zmq"):
        load_config({"peers": {"transport": "zmq", "peers": ["127.0.0.2:7000"], "tls_ca": str(tls.ca)}})
    with pytest.raises(ConfigError, match="curve_.* ZeroMQ-only, not for peers.transport=tcp"):
        load_config({"peers": {"transport": "tcp", "curve_public_key": "x" * 40}})
    with pytest.raises(ConfigError, match="tls_cert/tls_key need tls_ca"):
        create_transport({"peers": ["127.0.0.2:7000"], "tls_cert": str(tls.cert)})
    with pytest.raises(ConfigError, match="not on loopback.*peers.tls_ca"):
        create_transport({"peers": ["10.1.2.3:7000"]})
    assert create_transport({"peers": ["10.1.2.3:7000"], "tls_ca": str(tls.ca)}).name == "peers_tcp"


@pytest.mark.parametrize("argv, message", [
    (["--transport", "zmq", "--tls-cert", "c.pem"], "options of --transport tcp"),
    (["--curve-cert", "c"], "ZeroMQ options: add --transport zmq (the default wire is tcp)"),
    (["--transport", "tcp", "--tls-ca", "ca.pem"], "need --tls-cert"),
    (["--tenants", "t.json"], "--tenants needs --tls-ca"),
    (["--transport", "ucx", "--tenants", "t.json"], "cannot be used with UCX"),
    (["--transport", "zmq", "--tenants", "t.json"], "--tenants needs --curve-cert"),
])
def test_serve_refuses_options_of_another_wire(capsys: Any, argv: list[str], message: str) -> None:
    """kvengine serve refuses options of another wire, and tenants without a wire that proves identity, naming what is missing."""
    from kvengine.cli.serve import main as serve

    assert serve(["--bind", "127.0.0.2:0", *argv]) == 1
    assert message in capsys.readouterr().err


def test_a_receive_budget_too_small_for_a_clients_largest_batch_is_refused_naming_both_settings() -> None:
    """A client holds at most half the receive budget: a budget under twice ``min_client_share_bytes`` would
    refuse kvengine clients' largest batches (TOO_LARGE) at run time, so it is refused at construction."""
    with pytest.raises(ConfigError, match=r"receive_budget_bytes \(1048576\).*min_client_share_bytes"):
        TcpServerOptions(receive_budget_bytes=MiB)
    assert TcpServerOptions(receive_budget_bytes=MiB, min_client_share_bytes=MiB // 2).receive_budget_bytes == MiB


async def test_a_read_scope_budget_replaces_the_peers_deadlines_for_its_reads(make_record: Any) -> None:
    """A slow peer (1.5 s a get) is a miss within the client's own deadlines (0.5 s a request, 1 s a read);
    inside a read scope with a budget of 5 s (a handed-off prompt) it is read; a budget of 0.8 s still bounds
    the read, and writes keep their own timeout."""
    server = await _server(DelayedStore(64 * MiB, 1.5))
    item = make_record(MiB)
    await server.service.store.put([item])
    client = _client(server, PeerClientOptions(replicas=1, request_timeout=0.5, read_deadline=1.0, cooldown=0.01))
    try:
        assert await client.get([item[0]]) == [None]
        await asyncio.sleep(0.05)  # past the cool-down
        with read_scope(ReadScope(budget=5.0)):
            (got,) = await client.get([item[0]])
        assert got is not None and bytes(got) == item[1]
        t0 = time.monotonic()
        with read_scope(ReadScope(budget=0.8)):
            assert await client.get([item[0]]) == [None]
        assert 0.7 < time.monotonic() - t0 < 1.4
    finally:
        await client.close()
        await server.close()


async def test_a_read_scope_source_is_asked_first_whatever_placement_picks(make_record: Any) -> None:
    """A consumer names the producer that computed a prompt (``ReadScope.source``): the record, held only by
    the peer placement does not pick for it, is found there (exists and get); without the source it is a miss,
    and a source that is not one of the peers leaves placement alone (counted)."""
    servers = [await _server(), await _server()]
    item = make_record(MiB)
    peers = [Peer.parse(s.address or "") for s in servers]
    (owner,) = rendezvous_owners(item[0], peers, 1)
    holder = next(s for s, p in zip(servers, peers) if p != owner)
    await holder.service.store.put([item])
    client = PeerTransport(TcpConnector(FAST.limits, TcpOptions()), Membership([p.address for p in peers]), FAST)
    try:
        assert await client.exists([item[0]]) == [False] and await client.get([item[0]]) == [None]
        with read_scope(ReadScope(source=holder.address)):
            assert await client.exists([item[0]]) == [True]
        with read_scope(ReadScope(source=f"tcp://{holder.address}")):  # any spelling of a peer's address
            (got,) = await client.get([item[0]])
        assert got is not None and bytes(got) == item[1]
        for stranger in ("127.0.0.9:1", "not an address"):
            with read_scope(ReadScope(source=stranger)):
                assert await client.get([item[0]]) == [None]
        assert client.counts["read_source_unusable"] == 2
    finally:
        await client.close()
        for server in servers:
            await server.close()
