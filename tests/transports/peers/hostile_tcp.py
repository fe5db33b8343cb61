"""Attacks on the tcp wire (kvengine's own framing), measured as in :mod:`tests.transports.peers.hostile`.

The attacker uses raw sockets bound to its own loopback address (127.0.0.99), so the server's
per-client limits tell it from the victim; the honest victim is a :class:`PeerTransport` over
:class:`TcpConnector` against a real ``kvengine serve --transport tcp`` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from kvengine.chunks.keys import Namespace
from kvengine.transports.peers.protocol import Op, encode_request
from tests.transports.peers.certs import Pki, fingerprint_of
from tests.transports.peers.hostile import (
    ROOT,
    MiB,
    Outcome,
    PeerTransport,
    Victim,
    _forge_payload,
    fuzzed_header,
    records,
    served,
    transport,
    valid_requests,
)

ATTACKER = "127.0.0.99"
_LEN = struct.Struct("<I")


def _framed(header: bytes) -> bytes:
    return _LEN.pack(len(header)) + header


async def _open(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port), local_addr=(ATTACKER, 0))


#: The attacker of :func:`byte_flood`, in a process of its own: a PUT announcing one 100-byte record, then
#: ``total`` more bytes; prints the seconds until the server cut it off and how many bytes it got rid of.
_FLOODER = """
import socket, sys, time
from kvengine.chunks.keys import ChunkKey
from kvengine.transports.peers.protocol import Op, encode_request
host, port, total, attacker = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sock = socket.create_connection((host, port), source_address=(attacker, 0))
header = encode_request(Op.PUT, 9, [ChunkKey.from_hex("ab" * 32)], [100])
blob = b"x" * (8 << 20)
t0 = time.monotonic()
sent = 0
try:
    sock.sendall(len(header).to_bytes(4, "little") + header + b"y" * 100)
    while sent < total:
        sent += sock.send(blob)
    sock.settimeout(30)
    while sock.recv(65536):
        pass
    print("closed", time.monotonic() - t0, sent, flush=True)
except OSError as exc:
    print(type(exc).__name__, time.monotonic() - t0, sent, flush=True)
"""


async def byte_flood(host: str, total: int = 256 * MiB) -> Outcome:
    """A PUT announcing 100 bytes followed by 256 MiB: what follows the announced payload is read as the next
    message's length, fails its check, and the connection is closed; nothing beyond is read."""
    async with served(host, "--transport", "tcp") as server:
        victim = await Victim.on(server.address, wire="tcp")
        rss0 = server.rss_mib()
        stop = asyncio.Event()
        checking = asyncio.create_task(victim.keep_checking(stop))
        h, port = server.address.rsplit(":", 1)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _FLOODER, h, port, str(total), ATTACKER,
                                                    stdout=subprocess.PIPE, cwd=ROOT)
        out, _ = await proc.communicate()
        stop.set()
        ok = await checking
        rss = server.rss_mib() - rss0
        await victim.client.close()
    how, took, sent = out.decode().split()
    dropped = server.counts.get("dropped_connection_too_large", 0)
    return Outcome("256 MiB behind a header announcing 100 bytes (tcp)", 1, int(dropped == 1), victim.wrong,
                   float(took), rss, ok, victim.slowest * 1e3,
                   note=f"cut off ({how}) after the attacker got {int(sent) / MiB:.1f} MiB into socket buffers; "
                        f"victim misses meanwhile: {victim.failed}")


async def oversized_header(host: str) -> Outcome:
    """Length fields announcing headers of 4 GiB and 1 MiB: refused on their 4 bytes, connection closed."""
    async with served(host, "--transport", "tcp") as server:
        victim = await Victim.on(server.address, wire="tcp")
        rss0 = server.rss_mib()
        slowest = 0.0
        for n in (2**32 - 1, MiB):
            reader, writer = await _open(server.address)
            t0 = time.monotonic()
            writer.write(_LEN.pack(n) + b"z" * 4096)
            with contextlib.suppress(OSError):
                await writer.drain()
                await asyncio.wait_for(reader.read(), 5)
            slowest = max(slowest, time.monotonic() - t0)
            writer.close()
        ok = await victim.check()
        rss = server.rss_mib() - rss0
        await victim.client.close()
    dropped = server.counts.get("dropped_connection_too_large", 0)
    return Outcome("headers announced at 4 GiB and 1 MiB (tcp)", 2, dropped, victim.wrong, slowest, rss, ok,
                   victim.slowest * 1e3, note="refused on the length field; connection closed")


async def slowloris(host: str, connections: int = 200) -> Outcome:
    """One client opens 200 connections and trickles 3 bytes of a message on each, then stalls: beyond its
    per-client share connections are closed at once, the rest at the message deadline."""
    async with served(host, "--transport", "tcp", "--message-timeout", "1.0") as server:
        victim = await Victim.on(server.address, wire="tcp")
        rss0 = server.rss_mib()
        stop = asyncio.Event()
        checking = asyncio.create_task(victim.keep_checking(stop))
        t0 = time.monotonic()
        opened = []
        for _ in range(connections):
            with contextlib.suppress(OSError):
                reader, writer = await _open(server.address)
                writer.write(b"\x18\x00\x00")
                opened.append((reader, writer))
        closed_at = []
        for reader, _ in opened:
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(), 10)
            closed_at.append(time.monotonic() - t0)
        stop.set()
        ok = await checking
        rss = server.rss_mib() - rss0
        for _, writer in opened:
            writer.close()
        await victim.client.close()
    counts = server.counts
    detected = counts.get("refused_connection_client_limit", 0) + counts.get("closed_message_timeout", 0)
    return Outcome(f"slowloris: {connections} connections from one client, each stalled mid-message (tcp)",
                   connections, detected, victim.wrong, max(closed_at, default=0.0), rss, ok, victim.slowest * 1e3,
                   note=f"{counts.get('refused_connection_client_limit', 0)} refused at connect (per-client cap), "
                        f"{counts.get('closed_message_timeout', 0)} closed at the 1 s message deadline")


async def budget_hog(host: str, seconds: float = 5.0, message_timeout: float = 2.0) -> Outcome:
    """One client keeps its 16 connections announcing PUTs and sending nothing: half announce 1 GiB (the whole
    receive budget of ``kvengine serve``), half 512 MiB (its share with two clients), each reopened as soon as
    the server closes it. Meanwhile an honest client puts one 4 KiB record after another: each must be stored
    within its request timeout. Time to miss: the honest client's slowest put."""
    async with served(host, "--transport", "tcp", "--message-timeout", str(message_timeout)) as server:
        victim = await Victim.on(server.address, wire="tcp")
        rss0 = server.rss_mib()
        key = records(1)[0][0]
        closed_by_server = [0]  # announcements the server decided on (the last ones are still open at the end)
        stop = asyncio.Event()

        async def hog(size: int) -> None:
            stopped = asyncio.ensure_future(stop.wait())
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    reader, writer = await _open(server.address)
                    writer.write(_framed(encode_request(Op.PUT, 1, [key], [size])))
                    read = asyncio.ensure_future(reader.read())
                    await asyncio.wait([read, stopped], return_when=asyncio.FIRST_COMPLETED)
                    closed_by_server[0] += read.done()
                    read.cancel()
                    writer.close()
                await asyncio.sleep(0.02)

        hogs = [asyncio.create_task(hog(1 << 30 if i % 2 else 512 * MiB)) for i in range(16)]
        await asyncio.sleep(0.2)  # the hog holds what it can before the first honest put
        honest, stored, slowest = 0, 0, 0.0
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            item = records(1, 4096)
            t0 = time.monotonic()
            stored += (await victim.client.put(item)) == [True]
            slowest = max(slowest, time.monotonic() - t0)
            honest += 1
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*hogs)
        ok = await victim.check() and stored == honest
        rss = server.rss_mib() - rss0
        await victim.client.close()
        await asyncio.sleep(0.2)  # the server sees the hog's last connections go
    counts = server.counts
    over, timed_out = counts.get("refused_over_client_share", 0), counts.get("closed_message_timeout", 0)
    return Outcome(f"one client holds PUTs of 1 GiB and 512 MiB announced on 16 connections, sends nothing, "
                   f"reconnects; message_timeout {message_timeout:g} s (tcp)", closed_by_server[0], over + timed_out,
                   victim.wrong, slowest, rss, ok, victim.slowest * 1e3,
                   note=f"honest 4 KiB puts stored: {stored} of {honest}; {over} announcements refused at once "
                        f"(beyond the client's share), {timed_out} closed at the message deadline")


async def fuzzer(host: str, messages: int = 1000, seed: int = 0) -> Outcome:
    """Random and mutated messages (lengths that lie, bad magic, versions, ops, counts, truncations, trailing
    garbage), each on a connection of its own, never reading the answers."""
    rng = random.Random(seed)
    async with served(host, "--transport", "tcp", "--message-timeout", "1.0") as server:
        victim = await Victim.on(server.address, wire="tcp")
        rss0 = server.rss_mib()
        valid = valid_requests(victim)
        stop = asyncio.Event()
        checking = asyncio.create_task(victim.keep_checking(stop))
        t0 = time.monotonic()
        for _ in range(messages):
            kind, base = fuzzed_header(rng, valid)
            if kind == 0:
                wire = bytes(base)
            elif kind == 1:
                wire = _framed(bytes(base))
            elif kind == 2:
                wire = _framed(bytes(base))[: rng.randrange(1, len(base) + 4)]
            elif kind == 3:
                wire = _LEN.pack(rng.choice([0, 1, len(base) - 1, len(base) + 1, 2**31])) + bytes(base)
            else:
                wire = _framed(bytes(base)) + rng.randbytes(rng.randrange(1, 4096))
            with contextlib.suppress(OSError):
                _, writer = await _open(server.address)
                writer.write(wire)
                await writer.drain()
                writer.close()
        elapsed = time.monotonic() - t0
        await asyncio.sleep(1.5)  # stalled partial messages reach their deadline
        stop.set()
        ok = await checking
        rss = server.rss_mib() - rss0
        alive = server.alive()
        await victim.client.close()
    counts = server.counts
    detected = sum(v for k, v in counts.items()
                   if k.startswith(("dropped_", "refused_connection_", "closed_message_timeout")))  # one per connection
    return Outcome(f"fuzzed messages ({messages} random/mutated, tcp)", messages, detected, victim.wrong,
                   elapsed / messages, rss, ok and alive, victim.slowest * 1e3,
                   note=f"server alive: {alive}; {counts.get('dropped_partial_message', 0)} partial messages dropped "
                        f"at the sender's hang-up, {counts.get('refused_connection_client_limit', 0)} connections "
                        "refused at the per-client cap; the rest were valid requests, answered")


async def non_reading_client(host: str, connections: int = 16, requests: int = 200) -> Outcome:
    """A client pipelines GETs of a 1 MiB record on 16 connections and never reads a reply."""
    async with served(host, "--transport", "tcp") as server:
        victim = await Victim.on(server.address, wire="tcp")
        big = records(1, MiB)
        assert await victim.client.put(big) == [True]
        rss0 = server.rss_mib()
        stop = asyncio.Event()
        checking = asyncio.create_task(victim.keep_checking(stop))
        t0 = time.monotonic()
        writers = []
        for c in range(connections):
            reader, writer = await _open(server.address)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            writer.write(b"".join(_framed(encode_request(Op.GET, c * requests + i, [big[0][0]]))
                                  for i in range(requests)))
            writers.append(writer)
        await asyncio.sleep(7.0)  # past reply_timeout (5 s): the replies pile up unread while the victim reads
        elapsed = time.monotonic() - t0
        stop.set()
        ok = await checking
        rss = server.rss_mib() - rss0
        for writer in writers:
            writer.close()
        await victim.client.close()
    counts = server.counts
    abandoned = counts.get("reply_abandoned_slow_client", 0)
    return Outcome(f"client that pipelines {connections * requests} GETs of a 1 MiB record on {connections} "
                   "connections and never reads (tcp)", connections, abandoned, victim.wrong, elapsed, rss, ok,
                   victim.slowest * 1e3,
                   note=f"{abandoned} connections cut after reply_timeout; {counts.get('refused_busy', 0)} "
                        "requests refused BUSY")


async def tenants_attack_each_other(host: str, workdir: Path) -> Outcome:
    """Two tenants on one TLS server with a tenants file keyed by certificate fingerprints: B reads, probes,
    deletes and overwrites A's chunks and squats A's pinned namespace; A's read-only certificate writes; a
    certificate from another CA is refused at the handshake."""
    pki, stranger_ca = Pki.create(workdir / "pki"), Pki.create(workdir / "other", "other-ca")
    server_cert, server_key = pki.issue("server")
    tls = {name: pki.tls(name) for name in ("a_writer", "a_reader", "b_writer")}
    ns_a, ns_pinned = Namespace(model="tls-tenant-a").digest(), Namespace(model="tls-tenant-a-pinned").digest()
    (workdir / "tenants.json").write_text(json.dumps({"tenants": {
        "a": {"writers": [fingerprint_of(tls["a_writer"].cert)], "readers": [fingerprint_of(tls["a_reader"].cert)],
              "namespaces": [ns_pinned.hex()]},
        "b": {"writers": [fingerprint_of(tls["b_writer"].cert)]}}}))
    args = ("--transport", "tcp", "--tls-cert", str(server_cert), "--tls-key", str(server_key), "--tls-ca",
            str(pki.ca), "--tenants", str(workdir / "tenants.json"))
    async with served(host, *args) as server:

        def as_(name: str) -> PeerTransport:
            return transport([server.address], wire="tcp", tls=tls[name])

        a, a_reader, b = as_("a_writer"), as_("a_reader"), as_("b_writer")
        stranger = transport([server.address], wire="tcp", tls=stranger_ca.tls("stranger", trust=pki.ca))
        mine = records(8, 16 << 10, namespace=ns_a)
        assert await a.put(mine) == [True] * len(mine)
        victim = Victim(a_reader, mine)
        ok = await victim.check()
        ks = [k for k, _ in mine]
        t0 = time.monotonic()
        leaks = sum(r is not None for r in await b.get(ks)) + sum(await b.exists(ks))
        tampered = sum(await b.delete(ks)) + sum(await b.put([(k, _forge_payload(r)) for k, r in mine]))
        squat = sum(await b.put(records(4, 1024, namespace=ns_pinned)))
        read_only = sum(await a_reader.put(records(2, 1024, namespace=ns_a))) + sum(await a_reader.delete(ks[:2]))
        foreign = sum(r is not None for r in await stranger.get(ks))
        elapsed = time.monotonic() - t0
        attempts = 4 * len(ks) + 4 + 4 + len(ks)
        ok &= await victim.check()
        for client in (a, a_reader, b, stranger):
            await client.close()
    denied = server.counts.get("denied_read", 0) + server.counts.get("denied_write", 0)
    refused_handshake = len(ks) - foreign  # the stranger's gets never reach the service: each a miss
    return Outcome("two tenants on one TLS server (tcp): B reads, probes, deletes, overwrites A's chunks; squats A's "
                   "pinned namespace; A's read-only certificate writes; a foreign CA's certificate reads",
                   attempts, denied + refused_handshake, victim.wrong + leaks + tampered + squat + read_only + foreign,
                   elapsed / attempts, 0.0, ok, victim.slowest * 1e3,
                   note=f"B saw {leaks} of A's chunks; {tampered + squat + read_only} writes accepted; the foreign "
                        f"certificate got {foreign}")


async def run_all(workdir: Path) -> list[Outcome]:
    return [await byte_flood("127.0.0.31"), await oversized_header("127.0.0.32"), await slowloris("127.0.0.33"),
            await budget_hog("127.0.0.37"), await fuzzer("127.0.0.34"), await non_reading_client("127.0.0.35"),
            await tenants_attack_each_other("127.0.0.36", workdir)]
