"""``kvengine host`` with real processes: engines share one copy, and every lifetime fault is a miss or a
release, never wrong data, a leak or a hang."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvengine import KVEngine, Namespace
from kvengine.config import MemoryConfig
from kvengine.errors import CapacityError, ConfigError
from kvengine.host import client as client_module
from kvengine.host.client import ServiceMemory, ServiceStats
from kvengine.host.service import HostService

from ..conftest import FakeKV, copier, make_layout
from .clients import TOKENS, config
from .host_process import Host

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).with_name("clients.py")
LAYOUT = make_layout()


def host_at(path: Path) -> Host:
    """A service of 256 chunks of :data:`LAYOUT`, in slabs of 8, on ``path`` (not started)."""
    return Host(path, capacity=256 * LAYOUT.nbytes(), slab_bytes=8 * LAYOUT.nbytes())


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = host_at(tmp_path / "kvengine.sock")
    h.start()
    yield h
    if h.proc is not None and h.proc.poll() is None:
        h.kill()


def settled(host: Host) -> ServiceStats:
    """The service's stats once no pin is held, or as they are after 5 s (the closes of clients that just
    ended may still be in flight)."""
    memory = ServiceMemory(str(host.path))
    try:
        for _ in range(50):
            stats = memory.service_stats()
            if stats.all_pins == 0:
                break
            time.sleep(0.1)
        return stats
    finally:
        memory.close()


def _client(host: Host, *args: str) -> str:
    return subprocess.run([sys.executable, str(CLIENTS), args[0], str(host.path), *args[1:]], cwd=ROOT,
                          check=True, capture_output=True, text=True, timeout=300).stdout


def test_two_engine_processes_share_one_copy_and_the_second_loads_it_exactly(host):
    """An engine process stores a prompt's chunks and exits; another engine loads them from the service,
    equal to what was stored; storing the same prompt again adds nothing (the bytes are held once)."""
    _client(host, "store", "5")
    with KVEngine(config(str(host.path))) as engine:
        binding = engine.bind(Namespace(model="shared"), LAYOUT)
        res = engine.lookup(binding, "r", TOKENS)
        assert res.tokens == len(TOKENS)
        kv = FakeKV(len(TOKENS), seed=5)
        out = [torch.zeros_like(t) for t in kv.layers]
        assert engine.load(res, copier(out)).loaded_tokens == len(TOKENS)
        assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
        again = engine.store(binding, TOKENS, FakeKV(len(TOKENS), seed=5).source)
        assert (again.stored_chunks, again.present_chunks) == (0, 3)
        stats = engine._core.memory.service_stats()
        assert (stats.chunks, stats.all_pins) == (3, 0)
    assert "3 chunks" in host.stop()


def test_engine_processes_storing_and_loading_at_once_each_load_exactly(host):
    """Three engine processes store and load at once, prompts they share (same tokens, same KV) and their
    own: every load equals what was stored, and no pin outlives them."""
    procs = [subprocess.Popen([sys.executable, str(CLIENTS), "busy", str(host.path), "3"], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all(int(out) > 0 for out in outs), outs
    assert settled(host).all_pins == 0


def test_a_thousand_clients_killed_holding_pins_and_half_written_stores_leak_nothing(host):
    """Each killed client held the prefix's pins and a prepared store it had half written: the service
    releases both when the socket closes, and the half-written chunk is never visible."""
    _client(host, "store", "1")
    assert _client(host, "killed", "1000").split() == ["1000"]
    stats = settled(host)
    assert (stats.chunks, stats.all_pins) == (3, 0)
    out = host.stop()
    assert "3000 pins and 1000 stores released" in out, out  # three chunks pinned by each


def test_the_service_killed_mid_traffic_is_a_miss_and_the_engine_reattaches(host, monkeypatch):
    """Lookups, loads and stores run in a loop while the service is SIGKILLed: none raises, every load is
    exact (a reservation taken before the kill still reads the old arena's bytes), lookups miss at once
    while it is gone, and once it is back the engine stores and hits again."""
    monkeypatch.setattr(client_module, "RETRY_S", 0.1)
    kv = FakeKV(len(TOKENS), seed=3)
    errors: list[BaseException] = []
    misses: list[float] = []
    stop = threading.Event()
    with KVEngine(config(str(host.path))) as engine:
        binding = engine.bind(Namespace(model="m"), LAYOUT)
        assert engine.store(binding, TOKENS, kv.source).stored_chunks == 3
        held = engine.lookup(binding, "held", TOKENS)

        def traffic() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    engine.store(binding, TOKENS, kv.source)
                    t0 = time.perf_counter()
                    res = engine.lookup(binding, f"r{i}", TOKENS)
                    if res.tokens == 0:
                        misses.append(time.perf_counter() - t0)
                    out = [torch.zeros_like(t) for t in kv.layers]
                    n = engine.load(res, copier(out)).loaded_tokens
                    assert all(torch.equal(o[:, :, :n], k[:, :, :n]) for o, k in zip(out, kv.layers))
                except BaseException as exc:
                    errors.append(exc)
                    return

        worker = threading.Thread(target=traffic)
        worker.start()
        time.sleep(0.5)
        host.kill()
        time.sleep(0.5)
        out = [torch.zeros_like(t) for t in kv.layers]
        assert engine.load(held, copier(out)).loaded_tokens == len(TOKENS)
        assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
        stop.set()
        worker.join(timeout=30)
        assert not errors, errors
        assert misses and max(misses) < 0.5, misses
        assert engine._core.memory.outages == 1
        host.start()
        deadline = time.monotonic() + 10
        while engine.lookup(binding, "back", TOKENS).tokens == 0 and time.monotonic() < deadline:
            engine.store(binding, TOKENS, kv.source)
            time.sleep(0.05)
        res = engine.lookup(binding, "after", TOKENS)
        assert res.tokens == len(TOKENS)
        out = [torch.zeros_like(t) for t in kv.layers]
        assert engine.load(res, copier(out)).loaded_tokens == len(TOKENS)
        assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))


def test_an_engine_refuses_to_start_without_its_service(tmp_path):
    with pytest.raises(ConfigError, match=r"memory.service: cannot attach .*nothing.sock.*kvengine host --socket"):
        KVEngine(config(str(tmp_path / "nothing.sock")))


def test_a_user_the_service_does_not_allow_is_refused(tmp_path):
    service = HostService(MemoryConfig(capacity_bytes=64 * LAYOUT.nbytes()), tmp_path / "s.sock")
    service.allowed_uids = frozenset({os.getuid() + 1})
    service.start()
    try:
        with pytest.raises(ConfigError, match=f"refused this process: uid {os.getuid()} may not use"):
            KVEngine(config(str(service.path)))
        assert service.stats().refused_connections == 1
    finally:
        service.close()


#: A client as another user, speaking the wire by hand (that user cannot run this checkout's Python).
_AS_NOBODY = """
import socket, struct, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit()
s.sendall(struct.pack("<IBH", 3, 1, 1))
print({4: "FORBIDDEN", 0: "OK"}.get(s.recv(5)[4], "?"))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root to run a client as another user")
@pytest.mark.parametrize("mode, answer", [("0600", "EACCES"), ("0666", "FORBIDDEN")])
def test_another_user_is_refused_by_the_socket_mode_and_by_its_credentials(mode, answer):
    """With the default mode the socket refuses another user; with an open mode its credentials do."""
    folder = Path(tempfile.mkdtemp(prefix="kvengine-host-"))  # pytest's are closed to other users
    folder.chmod(0o755)
    h = host_at(folder / "s.sock")
    h.start("--mode", mode)
    try:
        out = subprocess.run(["/usr/bin/python3", "-c", _AS_NOBODY, str(h.path)], capture_output=True, text=True,
                             timeout=30, preexec_fn=lambda: os.setuid(65534), check=True).stdout
        assert out.strip() == answer
    finally:
        h.kill()
        shutil.rmtree(folder)


def test_a_malformed_frame_costs_only_its_own_connection(tmp_path):
    """Garbage on one connection drops it (its pins released); another client's pins and data stay."""
    import socket

    service = HostService(MemoryConfig(capacity_bytes=64 * LAYOUT.nbytes()), tmp_path / "s.sock")
    service.start()
    try:
        with KVEngine(config(str(service.path))) as engine:
            binding = engine.bind(Namespace(model="m"), LAYOUT)
            engine.store(binding, TOKENS, FakeKV(len(TOKENS)).source)
            held = engine.lookup(binding, "held", TOKENS)
            rogue = socket.socket(socket.AF_UNIX)
            rogue.connect(str(service.path))
            rogue.sendall(b"\xff\xff\xff\xff\x01garbage")
            try:
                assert rogue.recv(16) == b""  # dropped
            except ConnectionResetError:  # dropped with the rest of its garbage unread
                pass
            rogue.close()
            assert service.stats().pins == 3
            assert engine.load(held, copier([torch.zeros_like(t) for t in FakeKV(len(TOKENS)).layers])).ok
            assert engine._core.memory.service_stats().all_pins == 0  # answered after the load's releases
    finally:
        service.close()


def test_a_connection_cannot_release_another_ones_pins(tmp_path):
    service = HostService(MemoryConfig(capacity_bytes=64 * LAYOUT.nbytes()), tmp_path / "s.sock")
    service.start()
    try:
        with KVEngine(config(str(service.path))) as a, KVEngine(config(str(service.path))) as b:
            ba = a.bind(Namespace(model="m"), LAYOUT)
            b.bind(Namespace(model="m"), LAYOUT)
            a.store(ba, TOKENS, FakeKV(len(TOKENS)).source)
            res = a.lookup(ba, "a", TOKENS)
            b._core.memory.unpin(b._core.memory.pin_prefix(res.reservation.keys) + a._core.memory.pin_prefix(res.reservation.keys))
            assert b._core.memory.total_pins() == 0  # answered after b's unpins (one connection is in order)
            stats = a._core.memory.service_stats()
            assert (stats.own_pins, stats.all_pins) == (6, 6)  # a's lookup and a's pins above; b released its own
    finally:
        service.close()


def test_the_configuration_refuses_an_engines_own_kv_events_on_the_service_and_a_relative_socket():
    from kvengine.config import load_config

    with pytest.raises(ConfigError, match=r"events.endpoint: with memory.service, the host service publishes.*"
                                          r"kvengine host --config"):
        load_config({"memory": {"service": "/run/k.sock"}, "events": {"endpoint": "tcp://*:5557"}}, environ={})
    with pytest.raises(ConfigError, match="absolute Unix socket path"):
        load_config({"memory": {"service": "run/k.sock"}}, environ={})
    assert load_config({"memory": {"service": "unix:///run/k.sock"}}, environ={}).memory.service == "/run/k.sock"


def test_chunks_a_broken_service_places_outside_the_arena_are_misses_not_views(tmp_path):
    """A service answering offsets past the arena's end (a bug, or a hostile service) costs hits and
    stores, never a view outside the mapping or an exception into the engine."""
    service = HostService(MemoryConfig(capacity_bytes=64 * LAYOUT.nbytes()), tmp_path / "s.sock")
    service.start()
    try:
        with KVEngine(config(str(service.path))) as engine:
            binding = engine.bind(Namespace(model="m"), LAYOUT)
            assert engine.store(binding, TOKENS, FakeKV(len(TOKENS)).source).stored_chunks == 3
            service.pools[""].base = service.capacity_bytes  # every offset it answers is now past the end
            assert engine.lookup(binding, "r", TOKENS).tokens == 0
            assert engine.store(binding, [9, *TOKENS[1:]], FakeKV(len(TOKENS)).source).stored_chunks == 0
            service.pools[""].base = 0
            again = engine.lookup(binding, "again", TOKENS)
            assert again.tokens == len(TOKENS)
            engine.release(again)
            stats = engine._core.memory.service_stats()  # answered after every frame this engine sent before
            assert (stats.chunks, stats.all_pins) == (3, 0)  # the refused stores were aborted
    finally:
        service.close()


def test_the_service_remembers_a_bounded_number_of_layouts(tmp_path, monkeypatch):
    from kvengine.host import service as service_module

    monkeypatch.setattr(service_module, "MAX_LAYOUTS", 2)
    service = HostService(MemoryConfig(capacity_bytes=64 * LAYOUT.nbytes()), tmp_path / "s.sock")
    service.start()
    try:
        with KVEngine(config(str(service.path))) as engine:
            for layers in (1, 2):
                engine.bind(Namespace(model=f"m{layers}"), make_layout(layers=layers))
            with pytest.raises(CapacityError, match="knows 2 layouts already"):
                engine.bind(Namespace(model="m3"), make_layout(layers=3))
            engine.bind(Namespace(model="again"), make_layout(layers=1))  # a known one still binds
    finally:
        service.close()
