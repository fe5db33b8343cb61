"""The test relay of the disaggregation tests against a real tcp peer server: it forwards whole records, and
once armed cuts a transfer in the middle, runs its action and leaves the client a miss, not a hang."""

from __future__ import annotations

import socket
import threading
import time

from kvengine.transports.peers.client import PeerClientOptions, PeerTransport
from kvengine.transports.peers.placement import Membership
from kvengine.transports.peers.store import MemoryRecordStore
from kvengine.transports.peers.tcp import TcpConnector, TcpOptions, TcpPeerServer, TcpServerOptions
from tests.integrations.stalling_relay import StallingRelay
from tests.transports.conftest import build_record

MiB = 1 << 20
OPTIONS = PeerClientOptions(replicas=1, request_timeout=5.0, read_deadline=5.0, write_timeout=5.0, cooldown=0.1)


async def test_the_relay_forwards_records_and_cuts_an_armed_transfer_mid_record() -> None:
    server = TcpPeerServer(MemoryRecordStore(64 * MiB), "127.0.0.1:0", None, TcpServerOptions())
    await server.start()
    assert server.address is not None
    host, port = server.address.rsplit(":", 1)
    relay = StallingRelay((host, int(port)))
    client = PeerTransport(TcpConnector(OPTIONS.limits, TcpOptions()), Membership([f"127.0.0.1:{relay.port}"]),
                           OPTIONS)
    try:
        key, record = build_record(9 * MiB)
        assert await client.put([(key, record)]) == [True]
        (got,) = await client.get([key])
        assert got is not None and bytes(got) == record
        ran = threading.Event()
        done = relay.arm(MiB, connections=1, action=ran.set)
        assert await client.get([key]) == [None]  # cut after 1 MiB of 9: a miss
        assert done.wait(5) and ran.is_set()
    finally:
        await client.close()
        relay.close()
        await server.close()


def test_the_action_ends_even_when_it_kills_the_stalled_client_first() -> None:
    """An action that kills the client (a consumer's process) closes the stalled connection before it returns;
    its end is still reported: the stalled connection's task, cancelled then, does not carry the action."""
    upstream = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = upstream.accept()
        try:
            conn.sendall(b"x" * (4 * MiB))
        except OSError:  # the relay closed it
            pass

    threading.Thread(target=serve, daemon=True).start()
    relay = StallingRelay(upstream.getsockname()[:2])
    client = socket.socket()

    def kill_client() -> None:
        client.shutdown(socket.SHUT_RDWR)  # the client dies: its connection to the relay ends ...
        time.sleep(0.5)  # ... before the action returns (as a killed process is waited for)

    try:
        done = relay.arm(MiB, connections=1, action=kill_client)
        client.connect(("127.0.0.1", relay.port))
        received = 0
        while chunk := client.recv(1 << 16):
            received += len(chunk)
        assert received <= MiB
        assert done.wait(10), relay.progress
        assert relay.progress[0] == 1 and (relay.progress[1] or "").startswith("ran in")
    finally:
        client.close()
        relay.close()
        upstream.close()
