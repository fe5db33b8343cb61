"""The Mooncake Store tier end to end: a real ``mooncake_master`` and engine processes as cluster nodes.

Nodes A (127.0.0.2, contributes a memory segment) and B (127.0.0.3, a client
only, so every chunk B reads lies in A's segment) each run a
:class:`KVEngine` whose only tier below memory is the Mooncake tier, built
from ``EngineConfig`` (the ``mooncake`` section), with a shared secret. One
cluster is started for the module; the fault tests run last, in order:
master stalled (SIGSTOP), master killed then restarted (an empty cache),
segment holder killed. Every fault must end as a miss within the tier's
deadline while the engine keeps serving from memory.

This file doubles as the node program (``python test_mooncake_store.py node HOST MASTER SEGMENT SECRET``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mooncake_master import Master
from tests.transports.node_process import ROOT, NodeProcess, expected_digest, lookup_and_load, tokens_and_kv

TIMEOUT = 1.0  # mooncake.timeout of the nodes
TOKENS = 4 * 16  # four chunks of tests.conftest.CHUNK


# ---------------------------------------------------------------------------------------------------
# The node program (runs in a subprocess).
# ---------------------------------------------------------------------------------------------------
def _expected_digest(seed: int, upto: int) -> str:
    return expected_digest(seed, TOKENS, upto)


def node_main(host: str, master: str, segment: str, secret_file: str, replicas: str = "1") -> None:

    from kvengine import KVEngine, Namespace
    from kvengine.chunks.hashing import prefix_hashes
    from kvengine.chunks.keys import ChunkKey
    from kvengine.chunks.record import encode_header, seal_record, unpack_record
    from kvengine.transports.mooncake_store import MooncakeStoreTransport, _object_name
    from tests.conftest import make_config, make_layout

    config = make_config(capacity=1 << 20, mooncake={
        "master": master, "local_hostname": host, "segment_bytes": int(segment), "timeout": TIMEOUT,
        "replicas": int(replicas),
        "secret_file": secret_file})
    engine = KVEngine(config)
    (tier,) = [t for t in engine._core.tiers.transports if isinstance(t, MooncakeStoreTransport)]
    assert tier.wait_connected(30.0), "the node could not reach the master"
    binding = engine.bind(Namespace(model="tiny-test"), make_layout())

    def keys_of(tokens: Any) -> list[Any]:
        return [ChunkKey(binding.digest, h) for h in prefix_hashes(tokens, binding.chunk_size, binding.digest)]

    print("ready", host, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        tokens, kv = tokens_and_kv(cmd.get("seed", 0), TOKENS)
        t0 = time.monotonic()
        reply: dict[str, Any]
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "store":
            stored = engine.store(binding, tokens, kv.source)
            engine.flush()
            if cmd.get("forget"):  # keep it in the cluster only
                for key in keys_of(tokens):
                    engine._core.memory.discard(key)
            reply = {"stored": stored.stored_chunks}
        elif cmd["op"] == "lookup":
            reply = lookup_and_load(engine, binding, cmd.get("request", "r"), tokens, kv)
            if cmd.get("forget"):
                for key in keys_of(tokens):
                    engine._core.memory.discard(key)
        elif cmd["op"] == "exists":
            reply = {"exists": engine.run(tier.exists(keys_of(tokens)))}
        elif cmd["op"] == "get":  # the tier's own read, as a lookup window makes it
            reply = {"got": [r is not None for r in engine.run(tier.get(keys_of(tokens)))]}
        elif cmd["op"] == "tamper":  # replace chunk 0's object by a bad one, bypassing the tier's sealing
            key = keys_of(tokens)[0]
            store = tier._store()
            name = _object_name(key)
            sealed = store.get(name)
            assert sealed, "nothing to tamper with"
            header, payload = unpack_record(sealed, expect_key=key)
            head = encode_header(key, (header.token_start, header.token_end), header.tensors,
                                 codec_id=header.codec_id, raw_length=header.raw_length, payload=payload)
            unsealed = bytes(head) + bytes(payload)  # well-formed, a valid checksum, no MAC
            if cmd["how"] == "unsealed":
                bad = unsealed
            elif cmd["how"] == "other_writer":  # sealed by a writer with another secret
                bad = seal_record(unsealed, os.urandom(32))
            else:  # the sealed record with one payload byte flipped
                bad = bytearray(sealed)
                bad[header.header_length] ^= 0xFF
            assert store.remove(name, True) == 0
            assert store.put(name, bytes(bad)) == 0
            reply = {"tampered": cmd["how"]}
        else:
            raise ValueError(cmd["op"])
        reply["seconds"] = time.monotonic() - t0
        reply["integrity_failures"] = sum(
            s.value for m in engine.metrics.registry.collect() for s in m.samples
            if s.name == "kvengine_integrity_failures_total")
        reply["tier"] = dict(tier.counts)
        reply["tier_errors"] = {op: engine.metrics.value("kvengine_tier_errors_total", tier="mooncake", op=op)
                                for op in ("exists", "get", "delete")}
        print(json.dumps(reply), flush=True)
    engine.close(flush=False)


# ---------------------------------------------------------------------------------------------------
# The tests.
# ---------------------------------------------------------------------------------------------------
def test_a_master_off_loopback_needs_the_secret(tmp_path: Path) -> None:
    from kvengine.config import load_config
    from kvengine.errors import ConfigError
    from kvengine.tiers import build_tiers

    config = load_config({"mooncake": {"master": "10.1.2.3:50051"}}, environ={})
    with pytest.raises(ConfigError, match="mooncake.master 10.1.2.3:50051 is not on loopback.*secret_file"):
        build_tiers(config)
    short = tmp_path / "short"
    short.write_bytes(b"too short")
    with pytest.raises(ConfigError, match=r"mooncake\.secret_file .*short: holds 9 bytes"):  # its own setting
        build_tiers(load_config({"mooncake": {"master": "10.1.2.3:50051", "secret_file": str(short)}}, environ={}))


@pytest.mark.parametrize("master", ["50051", "host:", "host:port", "host:70000"])
def test_a_malformed_master_address_is_refused(master: str) -> None:
    from kvengine.config import load_config
    from kvengine.errors import ConfigError

    with pytest.raises(ConfigError, match="mooncake.master: .*must be 'host:port'"):
        load_config({"mooncake": {"master": master}}, environ={})


def test_a_bind_address_that_contradicts_the_hostname_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvengine.errors import ConfigError
    from kvengine.transports.mooncake_store import MooncakeOptions, MooncakeStoreTransport

    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.9")
    with pytest.raises(ConfigError, match="local_hostname is 127.0.0.2 but MC_TCP_BIND_ADDRESS is 127.0.0.9"):
        MooncakeStoreTransport(MooncakeOptions(master="127.0.0.1:1", local_hostname="127.0.0.2"))


class Node(NodeProcess):
    def __init__(self, host: str, master: str, segment: int, secret: Path, replicas: int = 1) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}
        env.pop("MC_TCP_BIND_ADDRESS", None)
        super().__init__(__file__, ["node", host, master, str(segment), str(secret), str(replicas)], env)


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.master = Master()
        self.master.start()
        secret = tmp / "secret"
        secret.write_bytes(os.urandom(32).hex().encode())
        self.a = Node("127.0.0.2", self.master.address, 256 << 20, secret)
        self.b = Node("127.0.0.3", self.master.address, 0, secret)
        self.a.ready(), self.b.ready()

    def stop(self) -> None:
        for node in (self.a, self.b):
            node.stop()
        if self.master.proc is not None and self.master.proc.poll() is None:
            self.master.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("mooncake"))
    try:
        yield c
    finally:
        c.stop()


def _eventually(ask: Any, until: Any, timeout: float = 15.0) -> dict[str, Any]:
    """``ask()`` again until ``until(reply)`` holds (at most ``timeout`` s); the last reply."""
    deadline = time.monotonic() + timeout
    while True:
        reply: dict[str, Any] = ask()
        if until(reply) or time.monotonic() > deadline:
            return reply
        time.sleep(0.2)


def _stopped(pid: int, timeout: float = 5.0) -> bool:
    """Whether every thread of ``pid`` has entered the stopped state (a SIGSTOP is delivered, not only sent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [Path(t, "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()]
        if all(state in ("T", "t") for state in states):
            return True
        time.sleep(0.01)
    return False


def test_a_chunk_stored_on_one_node_is_served_exactly_on_the_other(cluster: Cluster) -> None:
    assert cluster.a.ask(op="store", seed=1, forget=True)["stored"] == 4
    assert cluster.a.ask(op="exists", seed=1)["exists"] == [True] * 4
    got = cluster.b.ask(op="lookup", seed=1, forget=True)
    assert (got["matched"], got["loaded"]) == (TOKENS, TOKENS)
    assert got["digest"] == _expected_digest(1, TOKENS)
    assert got["tier"]["hits"] == 4 and got["integrity_failures"] == 0
    back = cluster.a.ask(op="lookup", seed=1)  # and back to the writer, whose memory forgot it
    assert back["loaded"] == TOKENS and back["digest"] == got["digest"]


@pytest.mark.parametrize(("how", "reason"), [("unsealed", "unauthenticated"), ("other_writer", "bad_mac"),
                                             ("flipped", "payload_checksum")])
def test_a_record_that_does_not_verify_is_a_counted_miss_and_removed(cluster: Cluster, how: str,
                                                                      reason: str) -> None:
    seed = {"unsealed": 2, "other_writer": 3, "flipped": 11}[how]
    cluster.a.ask(op="store", seed=seed, forget=True)
    cluster.a.ask(op="tamper", seed=seed, how=how)
    got = cluster.b.ask(op="lookup", seed=seed, forget=True)
    assert (got["matched"], got["loaded"]) == (0, 0)  # chunk 0 is bad: nothing after it is usable
    assert got["tier"][f"wrong_record_{reason}"] == 1
    assert cluster.b.ask(op="exists", seed=seed)["exists"][0] is False
    cluster.a.ask(op="store", seed=seed, forget=True)  # a good copy takes its place
    again = cluster.b.ask(op="lookup", seed=seed, forget=True)
    assert again["loaded"] == TOKENS and again["digest"] == _expected_digest(seed, TOKENS)


def test_a_stalled_master_is_a_miss_within_the_deadline_and_serving_resumes(cluster: Cluster) -> None:
    cluster.a.ask(op="store", seed=4, forget=True)
    proc = cluster.master.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        assert _stopped(proc.pid), "the master did not stop"
        got = cluster.b.ask(op="lookup", seed=4, forget=True)
        assert got["loaded"] == 0 and got["seconds"] < TIMEOUT + 0.5
        again = cluster.b.ask(op="lookup", seed=4, forget=True)  # the stuck call still runs: answered at once
        assert again["loaded"] == 0 and again["seconds"] < 0.5 and again["tier"]["exists_stalled"] >= 1
        local = cluster.a.ask(op="store", seed=5)  # the engine keeps serving from memory
        assert cluster.a.ask(op="lookup", seed=5)["loaded"] == TOKENS and local["seconds"] < 3 * TIMEOUT
    finally:
        proc.send_signal(signal.SIGCONT)
    back = _eventually(lambda: cluster.b.ask(op="lookup", seed=4, forget=True), lambda r: r["loaded"] == TOKENS)
    assert back["loaded"] == TOKENS and back["digest"] == _expected_digest(4, TOKENS)


def test_reads_a_stalled_master_leaves_unanswered_are_exported_as_tier_errors(cluster: Cluster) -> None:
    """Regression: with the master stopped (SIGSTOP), nothing was read from Mooncake yet
    ``kvengine_tier_errors_total{tier="mooncake"}`` stayed 0: the tier counted its timeouts and stalls only
    internally. Now the lookup's ``exists`` past its deadline and a ``get`` stalled behind it are exported under
    their ops in the node engine's metrics (what ``kvengine stats`` reads), and a healthy read adds nothing."""
    cluster.a.ask(op="store", seed=12, forget=True)
    before = cluster.b.ask(op="get", seed=12)
    assert before["got"] == [True] * 4
    proc = cluster.master.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        assert _stopped(proc.pid), "the master did not stop"
        assert cluster.b.ask(op="lookup", seed=12, forget=True)["loaded"] == 0  # its exists runs past the deadline
        stalled = cluster.b.ask(op="get", seed=12)  # answered at once: the exists call is still stuck
        assert stalled["got"] == [False] * 4
    finally:
        proc.send_signal(signal.SIGCONT)
    errors, was = stalled["tier_errors"], before["tier_errors"]
    assert errors["exists"] == was["exists"] + 1 and errors["get"] == was["get"] + 1
    assert errors["delete"] == was["delete"]
    back = _eventually(lambda: cluster.b.ask(op="get", seed=12), lambda r: r["got"] == [True] * 4)
    assert back["got"] == [True] * 4
    assert cluster.b.ask(op="get", seed=12)["tier_errors"] == back["tier_errors"]  # a healthy read adds nothing


def test_a_dead_master_is_a_miss_within_the_deadline_and_a_restarted_one_an_empty_cache(cluster: Cluster) -> None:
    cluster.a.ask(op="store", seed=6, forget=True)
    cluster.master.kill()
    for _ in range(3):
        got = cluster.b.ask(op="lookup", seed=6, forget=True)
        assert got["loaded"] == 0 and got["seconds"] < TIMEOUT + 0.5
    assert cluster.a.ask(op="store", seed=7)["seconds"] < 3 * TIMEOUT
    assert cluster.a.ask(op="lookup", seed=7)["loaded"] == TOKENS  # memory still serves
    cluster.master.start()
    # The clients find the new master by themselves; it holds nothing of before.
    fresh = _eventually(lambda: cluster.a.ask(op="store", seed=8, forget=True) and
                        cluster.b.ask(op="lookup", seed=8, forget=True), lambda r: r["loaded"] == TOKENS, 30.0)
    assert fresh["loaded"] == TOKENS and fresh["digest"] == _expected_digest(8, TOKENS)
    assert cluster.b.ask(op="lookup", seed=6, forget=True)["loaded"] == 0


def test_a_dead_segment_holder_is_a_miss_within_the_deadline(cluster: Cluster) -> None:
    cluster.a.ask(op="store", seed=9, forget=True)
    assert cluster.b.ask(op="exists", seed=9)["exists"] == [True] * 4
    cluster.a.stop()  # the only node with a segment: every object was there
    for _ in range(3):
        got = cluster.b.ask(op="lookup", seed=9)
        assert got["loaded"] == 0 and got["seconds"] < TIMEOUT + 0.5
    assert cluster.b.ask(op="store", seed=10)["seconds"] < 3 * TIMEOUT  # nowhere to put it: still no wait
    assert cluster.b.ask(op="lookup", seed=10)["loaded"] == TOKENS


def test_a_chunk_kept_in_two_replicas_is_served_again_once_the_master_drops_a_dead_segment(tmp_path: Path) -> None:
    """Mooncake's replication, used as it is: with ``replicas: 2`` every chunk lies in two nodes' segments
    (two holder processes lend the cluster's only memory). After one holder dies, Mooncake 0.3 still hands
    out its replica until the master expires the node (``--client_ttl``, 10 s): those reads miss within the
    deadline; then every chunk is served, exact, from the surviving replica."""
    from tests.mooncake_master import Master, SegmentHolder

    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    with Master() as master, SegmentHolder(master.address, host="127.0.0.4", segment_bytes=32 << 20) as first, \
            SegmentHolder(master.address, host="127.0.0.5", segment_bytes=32 << 20):
        a = Node("127.0.0.2", master.address, 0, secret, replicas=2)
        b = Node("127.0.0.3", master.address, 0, secret, replicas=2)
        try:
            a.ready(), b.ready()
            assert a.ask(op="store", seed=20, forget=True)["stored"] == 4
            first.stop()
            started = time.monotonic()
            replies = []
            while time.monotonic() - started < 40:
                replies.append(b.ask(op="lookup", seed=20, forget=True))
                if replies[-1]["loaded"] == TOKENS:
                    break
                time.sleep(0.5)
            assert all(r["seconds"] < TIMEOUT + 0.5 for r in replies)
            assert replies[-1]["loaded"] == TOKENS and replies[-1]["digest"] == _expected_digest(20, TOKENS)
            print(f"served again {time.monotonic() - started:.1f} s after the holder died")
        finally:
            a.stop()
            b.stop()


if __name__ == "__main__" and sys.argv[1] == "node":
    node_main(*sys.argv[2:])
