"""Attacks on the peer tier, each measured the same way (used by test_hostile_zmq.py and
benchmarks/bench_hostile_peers.py, which prints the table in docs/security.md).

Every attack runs against real sockets on 127.0.0.x: a fresh ``kvengine serve`` process (so its RSS and
its own counters belong to that attack alone), raw ZeroMQ sockets for the attacker, and an honest victim
(a :class:`PeerTransport`, or a :class:`CacheEngine` over one) whose records were stored before the
attack. An :class:`Outcome` says how many attempts were made, how many the system detected (refused,
rejected or counted), how many served wrong bytes (must be 0), how long the slowest attempt took to
become a miss, how much the server's RSS grew, and whether the victim kept being served exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from kvengine.chunks.keys import ChunkKey, Namespace, NamespaceDigest
from kvengine.chunks.record import seal_record, unpack_record
from kvengine.transports.peers.client import PeerClientOptions, PeerTransport
from kvengine.transports.peers.placement import Membership, Peer, rendezvous_owners
from kvengine.transports.peers.protocol import Limits, Op, Status, decode_header, encode_reply, encode_request
from kvengine.transports.peers.service import ServerOptions
from kvengine.transports.peers.store import MemoryRecordStore
from kvengine.transports.peers.tcp import TcpConnector, TcpOptions
from kvengine.transports.peers.zmq import CurveConfig, ZmqConnector, ZmqOptions, ZmqPeerServer
from tests.transports.conftest import build_record

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"hostile-suite-group-secret-0123456789"
MiB = 1 << 20
OPTIONS = PeerClientOptions(replicas=1, request_timeout=0.5, read_deadline=1.0, write_timeout=2.0, cooldown=30.0,
                            secret=SECRET)


@dataclass(frozen=True, slots=True)
class Outcome:
    attack: str
    attempts: int
    detected: int
    served_wrong: int
    #: Slowest attempt's time until the victim had its answer (a miss, or the honest copy).
    time_to_miss_s: float
    rss_growth_mib: float
    valid_served: bool
    #: The victim's slowest exact read while the attack ran (or right after it).
    valid_latency_ms: float
    note: str = ""

    def row(self) -> str:
        return (f"| {self.attack} | {self.attempts} | {self.detected} | {self.served_wrong} | "
                f"{self.time_to_miss_s * 1e3:.1f} | {self.rss_growth_mib:+.1f} | "
                f"{'yes' if self.valid_served else 'NO'} ({self.valid_latency_ms:.0f} ms) | {self.note} |")


HEADER = ("| attack | attempts | detected | served wrong | time to miss (ms) | server RSS growth (MiB) | "
          "valid client served (slowest read) | notes |\n|---|---|---|---|---|---|---|---|")


# -- the server under attack -------------------------------------------------------------------------
class ServeProcess:
    """``kvengine serve`` (memory store) on ``host``; its RSS, and its counters once stopped."""

    def __init__(self, host: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvengine.cli.serve", "--bind", f"{host}:0", "--capacity", "256MiB", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"on (\S+), store", line)
        if not match:
            self.proc.kill()
            raise RuntimeError(f"kvengine serve did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.address = match.group(1)
        self.counts: dict[str, int] = {}

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> dict[str, int]:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        match = re.search(r"stopped \((.*)\)", out)
        if match and "=" in match.group(1):
            self.counts = {k: int(v) for k, v in (kv.split("=") for kv in match.group(1).split(", "))}
        return self.counts


@contextlib.asynccontextmanager
async def served(host: str, *args: str) -> AsyncIterator[ServeProcess]:
    server = await asyncio.to_thread(ServeProcess, host, "--secret-file", _secret_file(), *args)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


def _secret_file() -> str:
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvengine-hostile-secret-{os.getpid()}"
    path.write_bytes(SECRET)
    return str(path)


def transport(addresses: Sequence[str], options: PeerClientOptions = OPTIONS, *, wire: str = "zmq",
              **wire_options: Any) -> PeerTransport:
    """An honest client over ``wire`` (zmq: :class:`ZmqOptions`; tcp: :class:`TcpOptions` keyword arguments)."""
    if wire == "tcp":
        connector: Any = TcpConnector(options.limits, TcpOptions(**wire_options))
    else:
        connector = ZmqConnector(options.limits, ZmqOptions(**wire_options))
    return PeerTransport(connector, Membership(addresses), options)


def records(n: int, size: int = 4096, namespace: NamespaceDigest | None = None) -> list[tuple[ChunkKey, bytes]]:
    kwargs = {} if namespace is None else {"namespace": namespace}
    return [build_record(size, **kwargs) for _ in range(n)]


def payload(record: Any) -> bytes:
    return bytes(unpack_record(memoryview(record))[1])


class Victim:
    """An honest client holding ``items`` at the server; checks they still come back exactly."""

    def __init__(self, client: PeerTransport, items: list[tuple[ChunkKey, bytes]]) -> None:
        self.client = client
        self.items = items
        self.wrong = 0
        self.failed = 0
        self.slowest = 0.0

    @classmethod
    async def on(cls, address: str, n: int = 8, size: int = 64 << 10, wire: str = "zmq") -> Victim:
        victim = cls(transport([address], wire=wire), records(n, size))
        assert await victim.client.put(victim.items) == [True] * n, "the victim could not store its records"
        return victim

    async def check(self) -> bool:
        t0 = time.monotonic()
        got = await self.client.get([k for k, _ in self.items])
        self.slowest = max(self.slowest, time.monotonic() - t0)
        ok = True
        for (_, record), blob in zip(self.items, got):
            if blob is None:
                self.failed += 1
                ok = False
            elif payload(blob) != payload(record):
                self.wrong += 1
                ok = False
        return ok

    async def keep_checking(self, stop: asyncio.Event) -> bool:
        ok = True
        while not stop.is_set():
            ok &= await self.check()
            await asyncio.sleep(0.05)
        return ok & await self.check()


async def raw_dealer(address: str, **options: int) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(f"tcp://{address}")
    return ctx, sock


def close_raw(ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket) -> None:
    sock.close(linger=0)
    ctx.term()


# -- attacks on a server ------------------------------------------------------------------------------
async def forged_puts(host: str) -> Outcome:
    """An attacker without the secret deletes the victim's chunks and puts well-formed forgeries (valid
    checksums) in their place, and plants forgeries under keys before the victim stores them."""
    async with served(host, "--transport", "zmq") as server:
        victim = await Victim.on(server.address)
        attacker = transport([server.address], dataclasses.replace(OPTIONS, secret=None))
        wrong_key = transport([server.address], dataclasses.replace(OPTIONS, secret=b"a-guessed-secret-0123456789"))
        rss0 = server.rss_mib()
        attempts = detected = 0
        t0 = time.monotonic()
        for key, _ in victim.items:
            forged = _forged(key, 64 << 10)
            for client in (attacker, wrong_key):
                deleted = await client.delete([key])
                stored = await client.put([(key, forged)])
                attempts += 2
                detected += (not deleted[0]) + (not stored[0])
        fresh = records(8, 64 << 10)
        for key, record in fresh:  # planted first, before the victim's own store
            attempts += 1
            detected += not (await attacker.put([(key, _forge_payload(record))]))[0]
        assert await victim.client.put(fresh) == [True] * len(fresh)
        victim.items += fresh
        elapsed = time.monotonic() - t0
        ok = await victim.check()
        rss = server.rss_mib() - rss0
        for client in (victim.client, attacker, wrong_key):
            await client.close()
    return Outcome("forged records put by a client without the secret (DELETE + PUT, and planting first)",
                   attempts, detected, victim.wrong, elapsed / max(attempts, 1), rss, ok, victim.slowest * 1e3,
                   note=f"server: {server.counts.get('put_invalid_unauthenticated', 0)} unsealed, "
                        f"{server.counts.get('put_invalid_bad_mac', 0)} bad MAC, "
                        f"{server.counts.get('delete_refused_record_valid', 0)} deletes of valid records refused")


def _forge_payload(record: bytes) -> bytes:
    """The same key and size as ``record``, other payload bytes, checksums recomputed (anyone can do this)."""
    header, data = unpack_record(memoryview(record))
    return _forged(header.key, len(data))


def _forged(key: ChunkKey, size: int) -> bytes:
    """A well-formed record of ``size`` random payload bytes under ``key``, valid checksums, no MAC."""
    return _rekey(build_record(size, namespace=key.namespace)[1], key)


def _rekey(record: bytes, key: ChunkKey) -> bytes:
    from kvengine.chunks.record import encode_header

    header, data = unpack_record(memoryview(record))
    return encode_header(key, (header.token_start, header.token_end), header.tensors, codec_id=header.codec_id,
                         raw_length=header.raw_length, payload=bytes(data)) + bytes(data)


async def fuzzer(host: str, messages: int = 3000, seed: int = 0) -> Outcome:
    """Random and mutated requests (bad magic, versions, ops, counts, truncations, stray frames, lengths
    that lie), sent as fast as the socket takes them, never reading the answers."""
    rng = random.Random(seed)
    async with served(host, "--transport", "zmq") as server:
        victim = await Victim.on(server.address)
        rss0 = server.rss_mib()
        ctx, sock = await raw_dealer(server.address, RCVHWM=1)
        valid = valid_requests(victim)
        stop = asyncio.Event()
        checking = asyncio.create_task(victim.keep_checking(stop))
        t0 = time.monotonic()
        for _ in range(messages):
            kind, base = fuzzed_header(rng, valid)
            if kind == 2:
                base = base[: rng.randrange(len(base))] or bytearray(b"K")
            elif kind == 3:
                struct.pack_into("<I", base, 16, rng.choice([0, 1, 4096, 4097, 2**32 - 1]))
            frames = [bytes(base)]
            if kind in (4, 5):
                frames += [rng.randbytes(rng.randrange(1, 4096)) for _ in range(rng.randrange(1, 64))]
            await sock.send_multipart(frames)
        elapsed = time.monotonic() - t0
        stop.set()
        ok = await checking
        rss = server.rss_mib() - rss0
        alive = server.alive()
        close_raw(ctx, sock)
        await victim.client.close()
    refused = sum(v for k, v in server.counts.items() if k.startswith(("refused_", "put_invalid_", "denied_")))
    return Outcome("fuzzed requests (3000 random/mutated messages)", messages, refused, victim.wrong,
                   elapsed / messages, rss, ok and alive, victim.slowest * 1e3,
                   note=f"server alive: {alive}; {server.counts.get('frames_dropped', 0)} frames dropped unread")


def valid_requests(victim: Victim) -> list[bytes]:
    """Well-formed headers for the victim's chunks: what a fuzzer mutates."""
    key, record = victim.items[0]
    return [encode_request(Op.GET, 1, [key]), encode_request(Op.PUT, 2, [key], [len(record)]),
            encode_request(Op.EXISTS, 3, [k for k, _ in victim.items])]


def fuzzed_header(rng: random.Random, valid: Sequence[bytes]) -> tuple[int, bytearray]:
    """A mutation kind (0-5) and the header to send: for kind 0 random bytes, for 1 a valid header with a
    few bytes flipped, otherwise a valid header that the wire's fuzzer breaks in its own way (2-5)."""
    base = bytearray(rng.choice(valid))
    kind = rng.randrange(6)
    if kind == 0:
        base = bytearray(rng.randbytes(rng.randrange(1, 200)))
    elif kind == 1:
        for _ in range(rng.randrange(1, 8)):
            base[rng.randrange(len(base))] = rng.randrange(256)
    return kind, base


#: Requests of the non-reading client the server may answer instead of refusing BUSY: its in-flight slots
#: (4), held until libzmq lets go of each reply, plus the replies the kernel's socket buffers take (a few
#: MiB). (Two CI runs saw 1,763 and 1,833 of 3,000 refused: slots were freed as soon as a reply was queued,
#: so the client was answered up to libzmq's queue of 1,024 messages, 1 MiB each.)
NON_READER_IN_FLIGHT = 64


async def non_reading_client(host: str, requests: int = 3000) -> Outcome:
    """A client sends thousands of GETs for a 1 MiB record and never reads a reply."""
    async with served(host, "--transport", "zmq") as server:
        victim = await Victim.on(server.address)
        big = records(1, MiB)
        assert await victim.client.put(big) == [True]
        rss0 = server.rss_mib()
        ctx, sock = await raw_dealer(server.address, RCVHWM=1, RCVBUF=4096, SNDHWM=requests + 10)
        stop = asyncio.Event()
        checking = asyncio.create_task(victim.keep_checking(stop))
        t0 = time.monotonic()
        for i in range(requests):
            await sock.send_multipart([encode_request(Op.GET, i + 1, [big[0][0]])])
        await asyncio.sleep(2.0)  # replies pile up unread while the victim keeps reading
        elapsed = time.monotonic() - t0
        stop.set()
        ok = await checking
        rss = server.rss_mib() - rss0
        close_raw(ctx, sock)
        await victim.client.close()
    busy = server.counts.get("refused_busy", 0)
    return Outcome("client that sends 3000 GETs of a 1 MiB record and never reads", requests, busy, victim.wrong,
                   elapsed / requests, rss, ok, victim.slowest * 1e3,
                   note=f"{busy} refused BUSY, {server.counts.get('reply_abandoned_slow_client', 0)} replies "
                        "abandoned after reply_timeout")


async def frame_flood(host: str, frames: int = 1_000_000) -> Outcome:
    """One message of a million one-byte frames behind a PUT header announcing 100 bytes."""
    return await _flood(host, "one message of 1M one-byte frames behind a header announcing 100 bytes",
                        frames, 1)


async def oversized_payload(host: str, frames: int = 32) -> Outcome:
    """A PUT header announcing 100 bytes followed by 256 MiB of 8 MiB frames."""
    return await _flood(host, "256 MiB in 8 MiB frames behind a header announcing 100 bytes", frames,
                        8 * MiB - 64)


#: The attacker of :func:`_flood`, in a process of its own (so its sending does not slow the victim):
#: one PUT announcing 100 bytes with ``frames`` frames of ``size`` bytes, then a PING on the same
#: connection; prints the seconds until each was answered and the PUT's status.
_FLOODER = """
import sys, time, zmq
from kvengine.chunks.keys import ChunkKey
from kvengine.transports.peers.protocol import Limits, Op, decode_header, encode_request
address, frames, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.SNDHWM, 0)
sock.connect("tcp://" + address)
blob = b"x" * size
t0 = time.monotonic()
sock.send_multipart([encode_request(Op.PUT, 9, [ChunkKey.from_hex("ab" * 32)], [100]), *([blob] * frames)],
                    copy=size > 1024)
sock.send_multipart([encode_request(Op.PING, 10, [])])
sent = time.monotonic() - t0
answers = {}
if sock.poll(60000):
    while 10 not in answers and sock.poll(60000):
        reply = decode_header(sock.recv(), Limits(), reply=True)
        answers[reply.request_id] = (reply.status.name, time.monotonic() - t0)
print(sent, *answers.get(9, ("never", -1)), 10 in answers, flush=True)
"""


async def _flood(host: str, attack: str, frames: int, size: int) -> Outcome:
    """A PUT whose payload breaks its header, sent by another process; the victim reads all the while.
    Time to miss: until the PUT's refusal arrives."""
    async with served(host, "--transport", "zmq") as server:
        victim = await Victim.on(server.address)
        rss0 = server.rss_mib()
        stop = asyncio.Event()
        checking = asyncio.create_task(victim.keep_checking(stop))
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _FLOODER, server.address, str(frames),
                                                    str(size), stdout=subprocess.PIPE, cwd=ROOT)
        out, _ = await proc.communicate()
        stop.set()
        await checking
        during = (victim.failed, victim.slowest)
        await victim.client.close()
        victim.client = transport([server.address])  # the old one cooled the server down after its timeouts
        ok = await victim.check()
        rss = server.rss_mib() - rss0
        await victim.client.close()
    sent, status, took, pinged = out.decode().split()
    dropped = server.counts.get("frames_dropped", 0)
    return Outcome(attack, 1, int(status == "BAD_REQUEST"), victim.wrong, float(took), rss,
                   ok and pinged == "True", during[1] * 1e3,
                   note=f"refused {status}; sending took the attacker {float(sent):.1f} s; {dropped} frames read "
                        f"and dropped, none kept; victim chunk reads missed meanwhile: {during[0]}")


# -- attacks by a peer on a client ---------------------------------------------------------------------
@contextlib.asynccontextmanager
async def lying_peer(host: str, answer: Callable[[Any, bytes, Any], Awaitable[None]]) -> AsyncIterator[str]:
    """A raw ROUTER that answers every request with ``answer(sock, ident, request)``."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port(f"tcp://{host}")

    async def serve() -> None:
        while True:
            ident, header, *_ = await sock.recv_multipart()
            with contextlib.suppress(Exception):
                await answer(sock, ident, decode_header(header, Limits(), reply=False))

    task = asyncio.create_task(serve())
    try:
        yield f"{host}:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        sock.close(linger=0)
        ctx.term()


async def malicious_replica(host: str, honest_host: str, rounds: int = 8) -> Outcome:
    """The first owner of every chunk is a malicious peer that serves forgeries: unsealed records with valid
    checksums, records sealed with another secret, another key's record, garbage, a truncated record. The
    second owner is honest."""
    forgeries = ["unsealed", "other_secret", "other_key", "garbage", "truncated"]
    sent: list[str] = []

    async def answer(sock: Any, ident: bytes, req: Any) -> None:
        if req.op is not Op.GET:  # acks puts, deletes and exists like an honest peer
            await sock.send_multipart([ident, encode_reply(req.op, req.request_id, Status.OK, [True] * len(req.keys))])
            return
        kind = forgeries[len(sent) % len(forgeries)]
        sent.append(kind)
        blobs = [_forgery(kind, key) for key in req.keys]
        await sock.send_multipart([ident, encode_reply(Op.GET, req.request_id, Status.OK, [True] * len(blobs),
                                                       [len(b) for b in blobs]), *blobs])

    server = ZmqPeerServer(MemoryRecordStore(64 * MiB), f"{honest_host}:0", ServerOptions(secret=SECRET))
    await server.start()
    try:
        async with lying_peer(host, answer) as liar:
            assert server.address is not None
            peers = [liar, server.address]
            client = transport(peers, dataclasses.replace(OPTIONS, replicas=2))
            liar_peer = Peer.parse(liar)
            items = [item for item in (build_record(16 << 10) for _ in range(400))
                     if rendezvous_owners(item[0], Membership(peers).peers(), 2)[0] == liar_peer][:rounds]
            assert await client.put(items) == [True] * len(items)
            victim = Victim(client, items)
            slowest = 0.0
            for item in items:
                victim.items = [item]
                t0 = time.monotonic()
                await victim.check()
                slowest = max(slowest, time.monotonic() - t0)
            rejected = sum(v for k, v in client.counts.items() if k.startswith("wrong_record_"))
            ok = victim.failed == 0 and victim.wrong == 0
            await client.close()
    finally:
        await server.close()
    return Outcome("malicious first replica serving forgeries (5 kinds), honest second replica", len(sent),
                   rejected, victim.wrong, slowest, 0.0, ok, victim.slowest * 1e3,
                   note="each forgery rejected at the victim, deleted at the liar only, honest copy served")


def _forgery(kind: str, key: ChunkKey) -> bytes:
    record = _forged(key, 16 << 10)
    if kind == "other_secret":
        return bytes(seal_record(memoryview(record), b"another-groups-secret-0123456789"))
    if kind == "other_key":
        return build_record(16 << 10, namespace=key.namespace)[1]
    if kind == "garbage":
        return os.urandom(len(record))
    if kind == "truncated":
        return bytes(seal_record(memoryview(record), SECRET))[:-100]
    return record


class _SlowStore(MemoryRecordStore):
    """Answers every exists after ``delay``; every get after ``delay``, or never when ``silent``."""

    def __init__(self, capacity: int, *, delay: float, silent: bool) -> None:
        super().__init__(capacity)
        self.delay = delay
        self.silent = silent

    async def get(self, keys: Any) -> Any:
        await asyncio.sleep(3600 if self.silent else self.delay)
        return await super().get(keys)

    async def exists(self, keys: Any) -> Any:
        await asyncio.sleep(self.delay)
        return await super().exists(keys)


async def slow_and_silent_peers(host: str, chunks: int = 32) -> list[Outcome]:
    """An engine's lookup of ``chunks`` chunks through a peer that answers each request just under the
    request timeout, and through one that never answers: each lookup ends within ``read_deadline``."""
    from kvengine import CacheEngine
    from tests.conftest import FakeKV, make_config, make_layout

    outcomes = []
    for mode in ("slow", "silent"):
        store = _SlowStore(64 * MiB, delay=OPTIONS.request_timeout * 0.9, silent=mode == "silent")
        server = ZmqPeerServer(store, f"{host}:0", ServerOptions(secret=SECRET))
        await server.start()
        assert server.address is not None
        layout, ns = make_layout(), Namespace(model="hostile-slow")
        writer = CacheEngine(make_config(capacity=8 << 20, write_mode="write_through"),
                             transports=[transport([server.address], dataclasses.replace(OPTIONS, write_timeout=10))])
        await writer.start()
        binding = writer.bind(ns, layout)
        tokens = list(range(chunks * 16))
        stored = await writer.store(binding, tokens, FakeKV(len(tokens)).source)
        await writer.close()
        reader_transport = transport([server.address])
        reader = CacheEngine(make_config(capacity=8 << 20), transports=[reader_transport])
        await reader.start()
        rb = reader.bind(ns, layout)
        t0 = time.monotonic()
        res = await reader.lookup(rb, "r1", tokens)
        took = time.monotonic() - t0
        matched = res.tokens
        await reader.release(res)
        await reader.close()
        await server.close()
        outcomes.append(Outcome(
            f"{'slow peer (answers each request after 0.45 s)' if mode == 'slow' else 'silent peer'}: "
            f"engine lookup of {chunks} chunks, read_deadline 1.0 s", 1, 1, 0, took, 0.0, True, 0.0,
            note=f"{stored.stored_chunks} stored, {matched // 16} chunks hit before the deadline, rest missed"))
    return outcomes


# -- tenants --------------------------------------------------------------------------------------------
async def tenants_attack_each_other(host: str, workdir: Path) -> Outcome:
    """Two tenants on one CURVE server with a tenants file. Tenant B's writer reads, probes, deletes and
    overwrites tenant A's chunks, and writes into a namespace pinned to A; A's read-only key tries to
    write. Every attempt must be a miss or a refusal; A keeps reading its own chunks exactly."""
    import zmq.auth

    server_public, server_secret = zmq.auth.create_certificates(str(workdir), "server")
    server_key, _ = zmq.auth.load_certificate(server_public)
    keys = {name: zmq.curve_keypair() for name in ("a_writer", "a_reader", "b_writer")}
    ns_a, ns_pinned = Namespace(model="tenant-a").digest(), Namespace(model="tenant-a-pinned").digest()
    (workdir / "tenants.json").write_text(json.dumps({"tenants": {
        "a": {"writers": [keys["a_writer"][0].decode()], "readers": [keys["a_reader"][0].decode()],
              "namespaces": [ns_pinned.hex()]},
        "b": {"writers": [keys["b_writer"][0].decode()]}}}))

    def as_(name: str) -> PeerTransport:
        public, secret = keys[name]
        return transport([address], curve=CurveConfig(public_key=public, secret_key=secret, server_key=server_key))

    async with served(host, "--transport", "zmq", "--curve-cert", server_secret, "--tenants",
                      str(workdir / "tenants.json")) as server:
        address = server.address
        a, a_reader, b = as_("a_writer"), as_("a_reader"), as_("b_writer")
        mine = records(8, 16 << 10, namespace=ns_a)
        assert await a.put(mine) == [True] * len(mine)
        victim = Victim(a_reader, mine)  # A's read-only key reads A's chunks
        ok = await victim.check()
        ks = [k for k, _ in mine]
        t0 = time.monotonic()
        leaks = sum(r is not None for r in await b.get(ks)) + sum(await b.exists(ks))
        tampered = sum(await b.delete(ks)) + sum(await b.put([(k, _forge_payload(r)) for k, r in mine]))
        squat = sum(await b.put(records(4, 1024, namespace=ns_pinned)))
        read_only = sum(await a_reader.put(records(2, 1024, namespace=ns_a))) + sum(await a_reader.delete(ks[:2]))
        elapsed = time.monotonic() - t0
        attempts = 4 * len(ks) + 4 + 4
        ok &= await victim.check()
        for client in (a, a_reader, b):
            await client.close()
    denied = server.counts.get("denied_read", 0) + server.counts.get("denied_write", 0)
    return Outcome("two tenants on one CURVE server: B reads, probes, deletes, overwrites A's chunks; "
                   "squats A's pinned namespace; A's read-only key writes", attempts, denied,
                   victim.wrong + leaks + tampered + squat + read_only, elapsed / attempts, 0.0, ok,
                   victim.slowest * 1e3, note=f"B saw {leaks} of A's chunks; {tampered + squat + read_only} "
                                              "writes accepted")


async def run_all(workdir: Path) -> list[Outcome]:
    """Every attack, one after another (each with a fresh server)."""
    out = [await forged_puts("127.0.0.21"), await malicious_replica("127.0.0.22", "127.0.0.23")]
    out += await slow_and_silent_peers("127.0.0.24")
    out += [await fuzzer("127.0.0.25"), await non_reading_client("127.0.0.26"), await frame_flood("127.0.0.27"),
            await oversized_payload("127.0.0.28"), await tenants_attack_each_other("127.0.0.29", workdir)]
    return out

