"""The host service's own lower tiers (``kvengine host --config``): what engines store reaches the service's
disk; a restarted service serves it, verified, to an engine with no tier of its own; a bad record is a miss."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml

from kvengine import KVEngine, Namespace
from kvengine.config import EngineConfig, MemoryConfig
from kvengine.core.host_tiers import HostTiers
from kvengine.errors import ConfigError
from kvengine.host.client import ServiceMemory
from kvengine.host.service import HostService
from kvengine.keyed import GetOutcome, PutOutcome, SyncKeyedStore, keyed_namespace
from kvengine.types import ModelBinding
from tests.conftest import CHUNK, FakeKV, copier, make_layout
from tests.core.test_tiering import DictTransport
from tests.host.clients import TOKENS, config
from tests.host.host_process import ROOT, Host
from tests.test_keyed import PAGE, Collect, keys, page_layout, pages

LAYOUT = make_layout()
CLIENTS = ROOT / "tests" / "host" / "clients.py"


def _disk_config(disk: Path) -> EngineConfig:
    return EngineConfig(chunk_size=CHUNK, disk={"path": str(disk), "capacity_bytes": 64 * LAYOUT.nbytes()})


@contextmanager
def _service(sock: Path, disk: Path) -> Iterator[tuple[HostService, HostTiers]]:
    """A service in this process whose disk tier is ``disk``, and its tiers; closed (queued writes flushed)
    on exit."""
    lower = HostTiers(_disk_config(disk))
    service = HostService(MemoryConfig(capacity_bytes=64 * LAYOUT.nbytes(), slab_bytes=8 * LAYOUT.nbytes()), sock,
                          lower=lower)
    service.start()
    try:
        yield service, lower
    finally:
        service.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def _load_all(engine: KVEngine, seed: int) -> tuple[int, int, bool]:
    """(matched, loaded, exact) of a lookup and load of :data:`TOKENS` stored with ``seed``."""
    binding = engine.bind(Namespace(model="shared"), LAYOUT)
    res = engine.lookup(binding, f"r{seed}", TOKENS)
    kv = FakeKV(len(TOKENS), seed=seed)
    out = [torch.zeros_like(t) for t in kv.layers]
    loaded = engine.load(res, copier(out)).loaded_tokens
    exact = all(torch.equal(o[:, :, :loaded], k[:, :, :loaded]) for o, k in zip(out, kv.layers))
    return res.tokens, loaded, exact


def test_a_restarted_service_serves_what_its_disk_tier_holds_to_a_new_engine_exactly(tmp_path):
    """An engine process with no tier of its own stores three chunks through a service that owns a disk tier,
    and exits; the service stops (writing what is queued) and a new one starts on the same disk. A fresh
    engine's first lookup finds all three (promoted by the service into its arena: the engine's own
    in-memory answer says "ask below"), loads them exactly, and the second lookup is a memory hit."""
    disk, sock = tmp_path / "disk", tmp_path / "kvengine.sock"
    (tmp_path / "host.yaml").write_text(yaml.safe_dump(_disk_config(disk).model_dump(mode="json",
                                                                                      exclude_defaults=True)))
    host = Host(sock, capacity=64 * LAYOUT.nbytes(), slab_bytes=8 * LAYOUT.nbytes())
    port = _free_port()
    host.start("--config", str(tmp_path / "host.yaml"), "--metrics-port", str(port))
    try:
        subprocess.run([sys.executable, str(CLIENTS), "store", str(sock), "5"], cwd=ROOT, check=True, timeout=120)
        written = 'kvengine_stored_chunks_total{model="shared",tier="local_disk"} 3.0'
        deadline = time.monotonic() + 30
        while written not in _scrape(port) and time.monotonic() < deadline:  # written behind the store
            time.sleep(0.1)
        assert written in _scrape(port)
        assert "3 chunks" in host.stop()
        assert len(list(disk.rglob("*.kvc"))) == 3
        host.start("--config", str(tmp_path / "host.yaml"))
        with KVEngine(config(str(sock))) as engine:
            assert engine._core.has_lower_tiers and not engine._core.transports
            binding = engine.bind(Namespace(model="shared"), LAYOUT)
            assert engine.lookup_resident(binding, "cold", TOKENS) is None  # short in memory: ask the service
            assert _load_all(engine, 5) == (len(TOKENS), len(TOKENS), True)
            assert engine.metrics.value("kvengine_hit_tokens_total", model="shared") == len(TOKENS)
            assert engine.metrics.value("kvengine_loaded_bytes_total", tier="host") == 3 * LAYOUT.nbytes()
            res = engine.lookup_resident(binding, "warm", TOKENS)
            assert res is not None and res.tokens == len(TOKENS)
            engine.release(res)
        assert "3 chunks" in host.stop()
    finally:
        if host.proc is not None and host.proc.poll() is None:
            host.kill()


def test_records_corrupted_on_the_services_disk_are_misses_never_served(tmp_path):
    """The service verifies what its disk returns as an engine does: a flipped bit is a miss, counted, and the
    record is deleted."""
    disk, sock = tmp_path / "disk", tmp_path / "kvengine.sock"
    with _service(sock, disk), KVEngine(config(str(sock))) as engine:
        binding = engine.bind(Namespace(model="shared"), LAYOUT)
        assert engine.store(binding, TOKENS, FakeKV(len(TOKENS), seed=2).source).stored_chunks == 3
    files = sorted(disk.rglob("*.kvc"))
    assert len(files) == 3
    for f in files:  # one payload bit flipped in each
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x40
        f.write_bytes(bytes(data))
    with _service(sock, disk) as (service, lower), KVEngine(config(str(sock))) as engine:
        assert _load_all(engine, 2) == (0, 0, True)
        assert service.stats().chunks == 0
        assert lower.metrics.value("kvengine_integrity_failures_total", tier="local_disk",
                                   reason="payload_checksum") >= 1
    assert not list(disk.rglob("*.kvc"))  # deleted where they were found, never served later


def test_an_engine_with_tiers_of_its_own_refuses_a_service_that_owns_them(tmp_path):
    sock = tmp_path / "kvengine.sock"
    with _service(sock, tmp_path / "disk"):
        mixed = {**config(str(sock)), "disk": {"path": str(tmp_path / "own")}}
        with pytest.raises(ConfigError, match=r"owns the lower tiers.*remove them"):
            KVEngine(mixed)


def test_a_binding_whose_digest_does_not_match_its_namespace_is_refused(tmp_path):
    """The service verifies lower-tier records against the binding a client sends: one that does not hash to
    the digest its keys carry is refused, naming why."""
    sock = tmp_path / "kvengine.sock"
    with _service(sock, tmp_path / "disk"):
        memory = ServiceMemory(str(sock))
        try:
            good = ModelBinding.create(Namespace(model="a"), LAYOUT)
            memory.admit(good)
            forged = ModelBinding(Namespace(model="b"), LAYOUT, good.digest)
            with pytest.raises(ConfigError, match="do not hash to the binding's digest"):
                memory.admit(forged)
        finally:
            memory.close()


@pytest.mark.parametrize("body, error", [
    ({"chunk_size": CHUNK}, "has no lower tier"),
    ({"chunk_size": CHUNK, "memory": {"service": "unix:///x.sock"}}, "memory.service is a client's setting"),
])
def test_kvengine_host_refuses_a_configuration_without_lower_tiers_or_with_a_client_setting(tmp_path, body, error):
    (tmp_path / "host.yaml").write_text(yaml.safe_dump(body))
    run = subprocess.run([sys.executable, "-m", "kvengine", "host", "--socket", str(tmp_path / "s.sock"),
                          "--config", str(tmp_path / "host.yaml")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and error in run.stderr, run.stderr


def test_keyed_pages_a_restarted_service_holds_on_disk_are_found_and_read_exactly(tmp_path):
    """SGLang's path (keyed pages, no prefix): pages put through a service that owns a disk tier are, after
    the service restarts, found by ``exists`` (promoted into the arena) and read back exactly; a page
    never stored stays a miss."""
    disk, sock = tmp_path / "disk", tmp_path / "kvengine.sock"
    namespace = keyed_namespace(Namespace(model="keyed-host"), "test")
    data = pages(3)

    def open_store() -> tuple[KVEngine, SyncKeyedStore]:
        kv = KVEngine({"chunk_size": PAGE, "memory": {"service": str(sock)}})
        return kv, SyncKeyedStore(kv, kv.bind(namespace, page_layout()))

    with _service(sock, disk):
        kv, store = open_store()
        with kv:
            assert store.put(keys(3), lambda i: data[i]) == [PutOutcome.STORED] * 3
    assert len(list(disk.rglob("*.kvc"))) == 3
    with _service(sock, disk) as (service, _):
        kv, store = open_store()
        with kv:
            assert service.stats().chunks == 0
            assert store.exists([*keys(3), b"never"]) == [True] * 3 + [False]
            sink = Collect()
            assert store.get(keys(3), sink) == [GetOutcome.HIT] * 3
            assert all(torch.equal(a, b) for i in range(3) for a, b in zip(sink.got[i], data[i]))
            assert kv._core.memory.total_pins() == 0


class _SlowTier(DictTransport):
    """A lower tier in memory whose reads take ``delay`` seconds."""

    name = "slow"

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def get(self, keys):
        await asyncio.sleep(self.delay)
        return await super().get(keys)


def test_a_slow_promotion_holds_up_neither_the_engines_other_requests_nor_another_promotion(tmp_path):
    """Promotions run on connections of their own: while two lookups wait 1 s each for a slow tier, the same
    engine stores and asks the service's stats at once, and the two lookups end together, not one after
    the other; both load exactly."""
    sock, slow = tmp_path / "kvengine.sock", _SlowTier(1.0)
    lower = HostTiers(_disk_config(tmp_path / "unused"), transports=[slow])
    service = HostService(MemoryConfig(capacity_bytes=64 * LAYOUT.nbytes(), slab_bytes=8 * LAYOUT.nbytes()), sock,
                          lower=lower)
    service.start()
    try:
        with KVEngine(config(str(sock))) as engine:
            binding = engine.bind(Namespace(model="shared"), LAYOUT)
            prompts = {seed: [seed, *TOKENS[1:]] for seed in (1, 2)}
            for seed, tokens in prompts.items():
                engine.store(binding, tokens, FakeKV(len(tokens), seed=seed).source)
            deadline = time.monotonic() + 10
            while len(slow.blobs) < 6 and time.monotonic() < deadline:  # written behind
                time.sleep(0.05)
            assert len(slow.blobs) == 6
            for key in list(slow.blobs):
                engine._core.memory.discard(key)  # only the slow tier holds them now
            with ThreadPoolExecutor(2) as pool:
                t0 = time.monotonic()
                lookups = {seed: pool.submit(engine.lookup, binding, f"r{seed}", tokens)
                           for seed, tokens in prompts.items()}
                time.sleep(0.2)
                other = engine.store(binding, TOKENS, FakeKV(len(TOKENS), seed=9).source)
                beside = time.monotonic() - t0
                assert other.stored_chunks == 3 and beside < 0.9, beside
                results = {seed: f.result(timeout=30) for seed, f in lookups.items()}
                both = time.monotonic() - t0
            assert 1.0 <= both < 1.9, both
            for seed, res in results.items():
                kv = FakeKV(len(prompts[seed]), seed=seed)
                out = [torch.zeros_like(t) for t in kv.layers]
                assert res.tokens == len(TOKENS)
                assert engine.load(res, copier(out)).loaded_tokens == len(TOKENS)
                assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))
    finally:
        service.close()
