"""Tenants' shares of the host service's arena: a flood evicts only its own tenant's chunks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvengine import KVEngine, Namespace
from kvengine.cli.host import main as host_main
from kvengine.config import MemoryConfig
from kvengine.errors import ConfigError
from kvengine.host.service import HostService

from ..conftest import CHUNK, FakeKV, copier, make_layout

LAYOUT = make_layout()
SLAB = 2 * LAYOUT.nbytes()  # two chunks a slab


@pytest.fixture
def service(tmp_path: Path) -> Iterator[HostService]:
    memory = MemoryConfig(capacity_bytes=32 * SLAB, slab_bytes=SLAB)
    s = HostService(memory, tmp_path / "s.sock", quotas={"a": 4 * SLAB, "c": 4 * SLAB})
    s.start()
    yield s
    s.close()


def engine(service: HostService, tenant: str) -> KVEngine:
    return KVEngine({"chunk_size": CHUNK, "memory": {"service": str(service.path), "tenant": tenant}})


def test_a_tenants_flood_evicts_only_its_own_share(service):
    """Tenant a stores far more than its quota: it evicts its own chunks only, never beyond its share; the
    chunks of tenant c (a quota of its own) and of tenant b (the shared rest) all stay, and load exactly."""
    with engine(service, "a") as a, engine(service, "b") as b, engine(service, "c") as c:
        kept = {}
        for name, eng in (("b", b), ("c", c)):
            binding = eng.bind(Namespace(model="m"), LAYOUT)
            tokens = [ord(name), *range(1, 3 * CHUNK)]
            assert eng.store(binding, tokens, FakeKV(len(tokens), seed=ord(name)).source).stored_chunks == 3
            kept[name] = (eng, binding, tokens)
        binding = a.bind(Namespace(model="m"), LAYOUT)
        for i in range(40):  # 120 chunks into a share of 8
            a.store(binding, [1000 + i, *range(1, 3 * CHUNK)], FakeKV(3 * CHUNK, seed=i).source)
        pools = service.stats().pools
        assert pools["a"].evictions >= 120 - 8 and pools["a"].used_bytes <= pools["a"].capacity_bytes == 4 * SLAB
        assert pools[""].evictions == pools["c"].evictions == 0
        for name, (eng, bound, tokens) in kept.items():
            res = eng.lookup(bound, f"check-{name}", tokens)
            assert res.tokens == len(tokens), name
            kv = FakeKV(len(tokens), seed=ord(name))
            out = [torch.zeros_like(t) for t in kv.layers]
            assert eng.load(res, copier(out)).loaded_tokens == len(tokens)
            assert all(torch.equal(o, k) for o, k in zip(out, kv.layers)), name
        stats = a._core.memory.service_stats()
        assert (stats.capacity_bytes, stats.chunks) == (4 * SLAB, 8)  # a client sees its own pool


def test_pools_do_not_see_each_others_chunks(service):
    with engine(service, "a") as a, engine(service, "b") as b:
        tokens = list(range(2 * CHUNK))
        a.store(a.bind(Namespace(model="m"), LAYOUT), tokens, FakeKV(len(tokens)).source)
        assert b.lookup(b.bind(Namespace(model="m"), LAYOUT), "r", tokens).tokens == 0


@pytest.mark.parametrize("quotas, message", [
    ({"a": 40 * SLAB}, "leave less than one slab"),
    ({"a": SLAB // 2}, "below one slab"),
    ({"bad name": 4 * SLAB}, "tenant name"),
])
def test_quotas_the_arena_cannot_hold_are_refused(tmp_path, quotas, message):
    with pytest.raises(ConfigError, match=message):
        HostService(MemoryConfig(capacity_bytes=32 * SLAB, slab_bytes=SLAB), tmp_path / "s.sock", quotas=quotas)


@pytest.mark.parametrize("argv, message", [
    (["--quota", "team-a"], "a quota is NAME=SIZE"),
    (["--quota", "team a=1GiB"], "tenant name"),
    (["--quota", "a=lots"], "not a size"),
])
def test_the_command_refuses_a_malformed_quota(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        host_main(["--socket", str(tmp_path / "s.sock"), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_an_engine_refuses_a_malformed_tenant():
    with pytest.raises(ConfigError, match="memory.tenant.*tenant name"):
        KVEngine({"memory": {"service": "/run/k.sock", "tenant": "a b"}})


def test_each_tenants_pool_is_counted_in_the_services_metrics(service):
    from kvengine.host.metrics import host_registry
    from kvengine.metrics import scrape, serve_registry

    from ..integrations.ports import free_port

    port = free_port()
    stop = serve_registry(host_registry(service), port)
    try:
        with engine(service, "a") as a:
            binding = a.bind(Namespace(model="m"), LAYOUT)
            for i in range(4):  # 12 chunks into a share of 8
                a.store(binding, [1000 + i, *range(1, 3 * CHUNK)], FakeKV(3 * CHUNK, seed=i).source)
            a._core.memory.service_stats()  # answered once the service has handled every earlier frame of a's
            m = scrape(port)
        assert m['kvengine_host_capacity_bytes{tenant="a"}'] == 4 * SLAB
        assert m['kvengine_host_used_bytes{tenant="a"}'] == 4 * SLAB and m['kvengine_host_chunks{tenant="a"}'] == 8
        assert m['kvengine_host_evictions_total{tenant="a"}'] == 4
        assert m['kvengine_host_evictions_total{tenant=""}'] == m['kvengine_host_chunks{tenant="c"}'] == 0
        assert m["kvengine_host_connections"] == 1 and m["kvengine_host_pins"] == 0
    finally:
        stop()


def test_an_arena_beyond_physical_memory_is_refused_before_anything_maps_it(tmp_path):
    from kvengine.core.allocator import physical_memory_bytes

    physical = physical_memory_bytes()
    if physical is None:
        pytest.skip("this system does not say its physical memory")
    with pytest.raises(ConfigError, match="memory.capacity_bytes: .*exceeds this machine's physical memory"):
        HostService(MemoryConfig(capacity_bytes=2 * physical), tmp_path / "s.sock")
