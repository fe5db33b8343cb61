"""Peer sharing end to end: engine processes on their own loopback addresses, real sockets.

Per wire (ZeroMQ; kvengine's own tcp framing; UCX over ``UCX_TLS=tcp`` and ``UCX_TLS=sm``) a cluster of
subprocesses is started once:

* nodes A (127.0.0.2) and B (127.0.0.3): a :class:`KVEngine` whose only tier
  is a :class:`PeerTransport`, plus an embedded peer server (an
  :class:`EngineStore` on a :class:`ServerThread`), driven by JSON lines;
* misbehaving peers on 127.0.0.5, hosted by A's process (one process fewer
  to start): one that serves corrupted bytes, two that accept requests and
  never answer them, a bare TCP listener that never speaks, and (ZeroMQ)
  one that stalls half-way through streaming a record. The last test kills
  A's process with all of them.

Each node's peer list is a file the test rewrites at runtime (membership
reload). Faults must end as misses within the read deadline: nothing hangs,
nothing wrong is served. This file doubles as the node/fake program
(``python test_e2e.py node WIRE BIND PEERS_FILE [FAKES_HOST]``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.transports.node_process import ROOT, NodeProcess, expected_digest, lookup_and_load, tokens_and_kv

REQUEST_TIMEOUT = 1.0
READ_DEADLINE = 2.0
WIRES = {
    "zmq": {},
    "tcp": {},
    "ucx-tcp": {"UCX_TLS": "tcp"},
    "ucx-sm": {"UCX_TLS": "sm"},
}


# ---------------------------------------------------------------------------------------------------
# The programs run in subprocesses.
# ---------------------------------------------------------------------------------------------------
def _connector(wire: str) -> Any:
    if wire == "zmq":
        from kvengine.transports.peers.zmq import ZmqConnector

        return ZmqConnector()
    if wire == "tcp":
        from kvengine.transports.peers.tcp import TcpConnector

        return TcpConnector()
    from kvengine.transports.peers.ucx import UcxConnector

    return UcxConnector()


def _server(wire: str, store: Any, bind: str) -> Any:
    if wire == "zmq":
        from kvengine.transports.peers.zmq import ZmqPeerServer

        return ZmqPeerServer(store, bind)
    if wire == "tcp":
        from kvengine.transports.peers.tcp import TcpPeerServer

        return TcpPeerServer(store, bind)
    from kvengine.transports.peers.ucx import UcxPeerServer

    return UcxPeerServer(store, bind)


def node_main(wire: str, bind: str, peers_file: str, fakes_host: str = "") -> None:
    """A node: engine + peer transport + embedded server; one JSON command per stdin line."""

    from kvengine import KVEngine, Namespace
    from kvengine.sharing import EngineStore
    from kvengine.transports.peers.client import PeerClientOptions, PeerTransport
    from kvengine.transports.peers.placement import Membership
    from kvengine.transports.peers.service import ServerThread
    from kvengine.transports.peers.store import MemoryRecordStore
    from tests.conftest import make_config, make_layout

    options = PeerClientOptions(replicas=1, request_timeout=REQUEST_TIMEOUT, read_deadline=READ_DEADLINE,
                                write_timeout=3.0, cooldown=30.0)
    membership = Membership(path=peers_file, reload_interval=0.05)
    transport = PeerTransport(_connector(wire), membership, options)
    engine = KVEngine(make_config(capacity=1 << 20), transports=[transport])
    store = EngineStore(engine._core, MemoryRecordStore(16 << 20))
    server = ServerThread(_server(wire, store, bind))
    address = server.start()
    fakes = _start_fakes(wire, fakes_host) if fakes_host else {}
    print("ready", address, json.dumps(fakes), flush=True)
    bindings: dict[str, Any] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "peers":  # the list this node uses now (re-read from its file when due)
            print(json.dumps({"peers": [p.address for p in membership.peers()]}), flush=True)
            continue
        if cmd["op"] == "reached":  # wait until a fake hosted here was asked for a record
            print(json.dumps({"reached": GETS_REACHED[cmd["fake"]].wait(10.0)}), flush=True)
            continue
        model = cmd.get("model", "tiny-test")
        if model not in bindings:
            bindings[model] = engine.bind(Namespace(model=model), make_layout())
            store.share(bindings[model])
        binding = bindings[model]
        tokens, kv = tokens_and_kv(cmd["seed"], cmd["tokens"])
        t0 = time.monotonic()
        if cmd["op"] == "store":
            stored = engine.store(binding, tokens, kv.source)
            engine.flush()
            if cmd.get("forget"):  # keep it on the peers only
                res = engine.lookup(binding, "forget", tokens)
                keys = res.reservation.keys
                engine.release(res)
                assert all(engine._core.memory.discard(k) for k in keys)
            reply: dict[str, Any] = {"stored": stored.stored_chunks}
        else:
            reply = lookup_and_load(engine, binding, cmd["request"], tokens, kv)
        reply["seconds"] = time.monotonic() - t0
        reply["integrity_failures"] = sum(  # found by the engine, or by the peer tier before it
            s.value for m in engine.metrics.registry.collect() for s in m.samples
            if s.name == "kvengine_integrity_failures_total")
        reply["transport"] = dict(transport.counts)
        print(json.dumps(reply), flush=True)
    server.stop()
    engine.close(flush=False)


class _CorruptingStore:
    """Stores records faithfully; serves them with one payload byte flipped (header intact)."""

    def __init__(self) -> None:
        from kvengine.transports.peers.store import MemoryRecordStore

        self.inner = MemoryRecordStore(16 << 20)

    async def get(self, keys: Any) -> list[Any]:
        out = []
        for record in await self.inner.get(keys):
            if record is not None:
                record = bytearray(record)
                record[-1] ^= 0xFF
            out.append(record)
        return out

    async def exists(self, keys: Any) -> list[bool]:
        return await self.inner.exists(keys)

    async def put(self, items: Any) -> list[bool]:
        return await self.inner.put(items)

    async def delete(self, keys: Any) -> list[bool]:
        return await self.inner.delete(keys)


#: Per fake that stalls a read, set once a read reached it (the test kills the peer only then).
GETS_REACHED = {"victim": threading.Event(), "stall": threading.Event()}


class _SilentStore:
    """Claims to hold everything; a get never returns."""

    def __init__(self, reached: threading.Event | None = None) -> None:
        self.reached = reached

    async def exists(self, keys: Any) -> list[bool]:
        return [True] * len(keys)

    async def get(self, keys: Any) -> list[Any]:
        if self.reached is not None:
            self.reached.set()
        await asyncio.sleep(3600)
        return [None] * len(keys)

    async def put(self, items: Any) -> list[bool]:
        return [False] * len(items)

    async def delete(self, keys: Any) -> list[bool]:
        return [False] * len(keys)


async def _zmq_staller(host: str) -> str:
    """A raw ZeroMQ peer: says it has every key, then streams half of a 32 MiB record and stalls."""
    import zmq
    import zmq.asyncio

    from kvengine.transports.peers.protocol import Limits, Op, decode_header, encode_reply, split_frames, tagged

    sock = zmq.asyncio.Context().socket(zmq.ROUTER)
    port = sock.bind_to_random_port(f"tcp://{host}")
    size = 32 << 20

    async def serve() -> None:
        while True:
            ident, header, *_ = await sock.recv_multipart()
            req = decode_header(header, Limits(), reply=False)
            if req.op is not Op.GET:
                await sock.send_multipart([ident, encode_reply(req.op, req.request_id, flags=[True] * len(req.keys))])
                continue
            GETS_REACHED["stall"].set()
            lengths = [size] + [0] * (len(req.keys) - 1)
            flags = [True] + [False] * (len(req.keys) - 1)
            await sock.send_multipart([ident, encode_reply(req.op, req.request_id, flags=flags, lengths=lengths)])
            frames = list(tagged(req.request_id, split_frames([bytes(size)], 1 << 20)))
            for tag, frame in frames[: len(frames) // 2]:
                await sock.send_multipart([ident, tag, frame])

    asyncio.get_running_loop().create_task(serve())
    return f"{host}:{port}"


def _start_fakes(wire: str, host: str) -> dict[str, str]:
    """Start the misbehaving peers on a loop of their own (a daemon thread); their addresses by name."""
    started: concurrent.futures.Future[dict[str, str]] = concurrent.futures.Future()

    async def main() -> None:
        servers = {"corrupt": _server(wire, _CorruptingStore(), f"{host}:0"),
                   "silent": _server(wire, _SilentStore(), f"{host}:0"),
                   "victim": _server(wire, _SilentStore(GETS_REACHED["victim"]), f"{host}:0")}
        for s in servers.values():
            await s.start()
        addresses = {name: s.address for name, s in servers.items()}
        listener = socket.create_server((host, 0))
        held: list[socket.socket] = []
        threading.Thread(target=lambda: [held.append(listener.accept()[0]) for _ in iter(int, 1)],
                         daemon=True).start()
        addresses["blackhole"] = f"{host}:{listener.getsockname()[1]}"
        if wire == "zmq":
            addresses["stall"] = await _zmq_staller(host)
        started.set_result(addresses)
        await asyncio.Event().wait()

    threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
    return started.result(timeout=60)


# ---------------------------------------------------------------------------------------------------
# The tests.
# ---------------------------------------------------------------------------------------------------
class Proc(NodeProcess):
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__(__file__, args, env)

    def node_ready(self) -> tuple[str, dict[str, str]]:
        """The node's address and those of the fakes it hosts."""
        address, fakes = self.ready(2)
        return address, json.loads(fakes)


class Cluster:
    def __init__(self, wire: str, tmp: Path) -> None:
        env = {**os.environ, **WIRES[wire], "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_LOG_FILE": "stderr",
               "PYTHONPATH": str(ROOT)}
        self.files = {n: tmp / f"peers-{n}" for n in "ab"}
        for f in self.files.values():
            f.write_text("")
        self.a = Proc(["node", wire, "127.0.0.2:0", str(self.files["a"]), "127.0.0.5"], env)
        self.b = Proc(["node", wire, "127.0.0.3:0", str(self.files["b"])], env)
        self.addr: dict[str, str] = {}
        self.fake: dict[str, str] = {}

    def wait_ready(self) -> None:
        (self.addr["a"], self.fake), (self.addr["b"], _) = self.a.node_ready(), self.b.node_ready()

    def peers(self, node: str, *addresses: str) -> None:
        tmp = self.files[node].with_suffix(".tmp")
        tmp.write_text("".join(f"{a}\n" for a in addresses))
        os.replace(tmp, self.files[node])
        proc = self.a if node == "a" else self.b
        deadline = time.monotonic() + 10.0
        while (now := proc.ask(op="peers")["peers"]) != list(addresses):  # re-read within reload_interval
            assert time.monotonic() < deadline, f"node {node} still uses {now}, not {list(addresses)}"

    def stop(self) -> None:
        for p in (self.a, self.b):
            p.stop()


def _ucxx_missing() -> str | None:
    try:
        import ucxx  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA-side import
        return f"ucxx not usable here ({type(exc).__name__}: {exc}); install the 'ucx' extra"
    return None


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Cluster]]:
    """Every wire's processes, started at once (their imports overlap), stopped at the end of the module."""
    wires = [w for w in WIRES if not (w.startswith("ucx") and _ucxx_missing())]
    started: dict[str, Cluster] = {}
    try:
        for wire in wires:
            started[wire] = Cluster(wire, tmp_path_factory.mktemp(wire))
        for c in started.values():
            c.wait_ready()
        yield started
    finally:
        for c in started.values():
            c.stop()


@pytest.fixture(scope="module", params=list(WIRES))
def cluster(request: pytest.FixtureRequest, clusters: dict[str, Cluster]) -> Cluster:
    if request.param not in clusters:
        pytest.skip(_ucxx_missing() or "wire not started")
    return clusters[request.param]


TOKENS = 4 * 16 + 5  # four full chunks of 16 tokens and a partial tail (not stored)


@pytest.mark.slow
def test_chunk_stored_on_a_is_a_byte_identical_hit_on_b(cluster: Cluster) -> None:
    """Scenario: A stores a prompt (write-behind to its owners among A and B); B, which never saw it, loads it all."""
    both = (cluster.addr["a"], cluster.addr["b"])
    cluster.peers("a", *both)
    cluster.peers("b", *both)
    assert cluster.a.ask(op="store", seed=1, tokens=TOKENS, forget=True)["stored"] == 4
    got = cluster.b.ask(op="fetch", seed=1, tokens=TOKENS, request="r1")
    assert got["matched"] == got["loaded"] == 64, got
    assert got["digest"] == expected_digest(1, TOKENS, 64)
    assert got["integrity_failures"] == 0
    again = cluster.a.ask(op="fetch", seed=1, tokens=TOKENS, request="r1")  # A forgot it: back from the peers
    assert again["loaded"] == 64 and again["digest"] == got["digest"]


@pytest.mark.slow
def test_other_model_namespace_is_a_miss(cluster: Cluster) -> None:
    """Scenario: the same tokens under another model's namespace never match."""
    assert cluster.a.ask(op="store", seed=2, tokens=TOKENS, model="other-model", forget=True)["stored"] == 4
    assert cluster.b.ask(op="fetch", seed=2, tokens=TOKENS, request="r2")["matched"] == 0
    other = cluster.b.ask(op="fetch", seed=2, tokens=TOKENS, request="r3", model="other-model")
    assert other["loaded"] == 64 and other["digest"] == expected_digest(2, TOKENS, 64)


@pytest.mark.slow
def test_corrupted_bytes_from_a_peer_are_a_counted_miss(cluster: Cluster) -> None:
    """Scenario: peers that corrupt what they return: B matches and loads nothing, and counts integrity failures."""
    cluster.peers("a", cluster.fake["corrupt"])
    cluster.peers("b", cluster.fake["corrupt"])
    assert cluster.a.ask(op="store", seed=3, tokens=TOKENS, forget=True)["stored"] == 4
    got = cluster.b.ask(op="fetch", seed=3, tokens=TOKENS, request="r4")
    assert got["matched"] == 0 and got["loaded"] == 0
    assert got["integrity_failures"] >= 1


@pytest.mark.slow
def test_peer_that_never_answers_is_a_miss_within_the_deadline_then_skipped(cluster: Cluster) -> None:
    """Scenario: a peer that never answers is a miss within the read deadline; in its cool-down it is not asked
    again."""
    for fake in ("blackhole", "silent"):
        cluster.peers("b", cluster.fake[fake])
        got = cluster.b.ask(op="fetch", seed=5, tokens=TOKENS, request=f"r5-{fake}")
        assert got["matched"] == 0
        assert got["seconds"] < READ_DEADLINE + 1.0, got
        second = cluster.b.ask(op="fetch", seed=5, tokens=TOKENS, request=f"r6-{fake}")
        assert second["matched"] == 0 and second["seconds"] < 0.5, second  # in cool-down: not asked again


@pytest.mark.slow
def test_peer_killed_mid_transfer_is_a_miss_without_waiting_out_the_deadline(cluster: Cluster) -> None:
    """Scenario: B is receiving from a peer (ZeroMQ: half of a streamed record) when the peer process dies.

    The fakes live in A's process, so this kills A too: it runs last.
    """
    fake = "stall" if "stall" in cluster.fake else "victim"  # never used before: not in cool-down
    cluster.peers("b", cluster.fake[fake])
    cluster.b.send(op="fetch", seed=6, tokens=TOKENS, request="r7")
    assert cluster.a.ask(op="reached", fake=fake)["reached"], f"B's read never reached the {fake} peer"
    cluster.a.p.send_signal(signal.SIGKILL)
    got = cluster.b.receive()
    assert got["matched"] == 0 and got["loaded"] == 0
    print("killed-peer fetch took", got["seconds"])
    assert got["seconds"] < REQUEST_TIMEOUT, got  # the disconnect ended it, not the timeout
    cluster.a.p.wait()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    role, *rest = sys.argv[1:]
    if role == "node":
        node_main(*rest)
    else:
        raise SystemExit(f"unknown role {role!r}")
