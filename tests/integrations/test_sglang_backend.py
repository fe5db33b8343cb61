"""kvengine as SGLang's HiCache storage backend, against real SGLang 0.5.23 objects on CPU.

Run in .venv-sglang (see docs/sglang.md)::

    bash scripts/setup_sglang.sh && .venv-sglang/bin/python -m pytest tests/integrations/test_sglang_backend.py

Skipped, with the reason, where SGLang is not installed (the main .venv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integrations import sglang_env

sglang_env.require_sglang()

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_hash_str

from kvengine.errors import ConfigError, UnsupportedModelError
from kvengine.host.client import ServiceMemory
from kvengine.integrations.sglang import extra_config as backend_extra_config
from kvengine.integrations.sglang.backend import KVEngineHiCacheStorage
from kvengine.integrations.sglang.pages import SUPPORTED_LAYOUTS
from kvengine.keyed import keyed_chunk_key
from tests.host.host_process import Host
from tests.mooncake_master import Master, SegmentHolder

REPO = Path(__file__).resolve().parents[2]
PAGE = sglang_env.PoolGeometry().page


def extra_config(**own: object) -> dict[str, object]:
    """The backend's extra config with an explicit model fingerprint (the test models are not on disk)."""
    return backend_extra_config(**{"model_fingerprint": "tiny-test-weights", **own})


def fill_random(host, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g))


def page_keys(n: int, seed: int = 0) -> tuple[list[int], list[str]]:
    """Token ids of ``n`` pages and SGLang's own page hash chain over them."""
    g = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(0, 32000, (n * PAGE,), generator=g).tolist()
    return tokens, get_hash_str(tokens, None, page_size=PAGE)


def pages_at(host, indices: torch.Tensor) -> list[torch.Tensor]:
    return [host.get_data_page(int(indices[i])).clone() for i in range(0, len(indices), host.page_size)]


def make_backend(host, tmp_path: Path | None = None, *, layout: str | None = None, **storage: object):
    kv_config: dict = {"memory": {"capacity_bytes": "16MiB"}}
    if tmp_path is not None:
        kv_config["disk"] = {"path": str(tmp_path / "disk"), "fsync": "never"}
    config = sglang_env.storage_config(layout=layout or host.layout,
                                       extra=extra_config(kvengine_config=kv_config), **storage)
    backend = KVEngineHiCacheStorage(config, {})
    backend.register_mem_pool_host(host)
    return backend


@pytest.fixture(params=SUPPORTED_LAYOUTS)
def layout(request) -> str:
    return request.param


# -- v1 ------------------------------------------------------------------------------------------
def test_v1_round_trip_is_exact(layout: str) -> None:
    """Scenario: pages stored from some host slots load bit-exact into other slots, for every layout."""
    _, host = sglang_env.make_mha_pools(layout)
    fill_random(host)
    backend = make_backend(host)
    try:
        _, keys = page_keys(4)
        src, dst = torch.arange(PAGE, 5 * PAGE), torch.arange(20 * PAGE, 24 * PAGE)
        expected = pages_at(host, src)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, src) == [True] * 4
        assert backend.batch_exists(keys) == 4
        assert backend.batch_exists([*keys[:2], "f" * 64, keys[3]]) == 2
        assert backend.batch_get_v1([keys[1], "e" * 64, keys[3]], dst[: 3 * PAGE]) == [True, False, True]
        assert backend.batch_get_v1(keys, dst) == [True] * 4
        for got, want in zip(pages_at(host, dst), expected):
            assert torch.equal(got, want)
    finally:
        backend.close()


def test_copying_api_matches_zero_copy(layout: str) -> None:
    """SGLang's flat-page get/set read and write the same stored pages as the v1 path."""
    _, host = sglang_env.make_mha_pools(layout)
    fill_random(host, seed=1)
    backend = make_backend(host)
    try:
        _, keys = page_keys(3, seed=1)
        src = torch.arange(2 * PAGE, 5 * PAGE)
        expected = pages_at(host, src)
        assert backend.batch_set_v1(keys[:2], src[: 2 * PAGE]) == [True, True]
        assert backend.set(keys[2], expected[2])  # flat page, copying API
        assert backend.exists(keys[2])
        for key, want in zip(keys, expected):
            got = backend.get(key, host.get_dummy_flat_data_page())
            assert got is not None and torch.equal(got, want)
        dst = torch.arange(10 * PAGE, 13 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        for got, want in zip(pages_at(host, dst), expected):
            assert torch.equal(got, want)
        assert backend.get("d" * 64, host.get_dummy_flat_data_page()) is None
    finally:
        backend.close()


# -- through a real HiCacheController --------------------------------------------------------------
@pytest.mark.parametrize("hybrid", [False, True], ids=["HiCacheController", "HybridCacheController"])
def test_controller_writes_then_prefetches(layout: str, hybrid: bool) -> None:
    """Scenario: SGLang's controller backs pages up through the dynamic backend, then prefetches them by
    token ids into fresh host slots, bit-exact. HybridCacheController over a KV-only pool group is the
    path SGLang 0.5.23's unified radix cache takes for every plain model."""
    device, host = sglang_env.make_mha_pools(layout)
    fill_random(host, seed=2)
    kv_config = {"memory": {"capacity_bytes": "16MiB"}}
    controller = sglang_env.make_controller(device, host, backend="dynamic", hybrid=hybrid,
                                            extra_config=extra_config(kvengine_config=kv_config))
    try:
        assert isinstance(controller.storage_backend, KVEngineHiCacheStorage)
        assert controller.page_get_func == controller._page_get_zero_copy
        n_pages = 6
        tokens, hashes = page_keys(n_pages, seed=2)
        src = host.alloc(n_pages * PAGE)
        expected = pages_at(host, src)
        controller.write_storage(src, tokens, hash_value=hashes)
        op = controller.ack_backup_queue.get(timeout=60)
        assert op.completed_tokens == n_pages * PAGE

        prefetch = controller.prefetch(sglang_env.RequestHandle("req-1") if hybrid else "req-1", tokens)
        hit = controller.prefetch_hit_queue.get(timeout=60)
        assert hit is prefetch and hit.storage_hit_count == n_pages * PAGE
        dst = host.alloc(n_pages * PAGE)
        hit.host_indices = dst
        controller.prefetch_buffer.put(hit)
        completed = 0
        while True:
            ack = controller.ack_prefetch_queue.get(timeout=60)
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if ack.completed_req:
                break
        assert completed == n_pages * PAGE
        for got, want in zip(pages_at(host, dst), expected):
            assert torch.equal(got, want)

        miss = controller.prefetch(sglang_env.RequestHandle("req-2") if hybrid else "req-2",
                                   page_keys(2, seed=99)[0])
        assert controller.prefetch_hit_queue.get(timeout=60) is miss and miss.storage_hit_count == 0
    finally:
        controller.detach_storage_backend()


# -- refusals ---------------------------------------------------------------------------------------
def test_unknown_layout_is_refused() -> None:
    """A host layout whose pages this backend does not know (page_head) fails at start-up, saying which to use."""
    _, host = sglang_env.make_mha_pools("page_head")
    with pytest.raises(UnsupportedModelError, match="--hicache-mem-layout one of layer_first, page_first"):
        make_backend(host, layout="page_head")


def test_unknown_layout_is_refused_through_the_controller() -> None:
    """Scenario: SGLang attaching the backend to a page_head pool gets the refusal, storage stays off."""
    device, host = sglang_env.make_mha_pools("page_head")
    with pytest.raises(UnsupportedModelError, match="page_head"):
        sglang_env.make_controller(device, host, backend="dynamic", extra_config=extra_config())


def test_unsupported_hybrid_pools_are_refused() -> None:
    """Extra pools the backend cannot serve exactly (indexer, draft, compressed state) are refused, by pool name,
    at registration; so is a v2 call naming a pool that was never registered."""
    _, host = sglang_env.make_mha_pools("page_first")
    _, other = sglang_env.make_mha_pools("page_first")
    backend = make_backend(host)
    try:
        backend.register_mem_host_pool_v2(host, PoolName.KV)  # the KV anchor itself is fine
        for name in (PoolName.INDEXER, PoolName.DRAFT, PoolName.AUXILIARY_SWA, PoolName.DEEPSEEK_V4_C4):
            with pytest.raises(UnsupportedModelError, match=f"'{name.value}' host pool"):
                backend.register_mem_host_pool_v2(other, name)
        with pytest.raises(UnsupportedModelError, match="'kv' host pool"):
            backend.register_mem_host_pool_v2(other, PoolName.KV)  # a KV pool that is not the anchor
        with pytest.raises(UnsupportedModelError, match="'mamba' pool is object"):
            backend.register_mem_host_pool_v2(object(), PoolName.MAMBA)
        with pytest.raises(UnsupportedModelError, match="'swa' host pool was never registered"):
            backend.batch_exists_v2(["a" * 64], [PoolTransfer(name=PoolName.SWA, keys=["a" * 64])])
        with pytest.raises(UnsupportedModelError, match="'indexer' host pool"):
            backend.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=["a" * 64])])
    finally:
        backend.close()


def test_hybrid_pools_are_refused_when_they_cannot_be_served_exactly() -> None:
    """An SWA pool whose page size differs from the KV pool's, an SWA pool on an MLA model, a Mamba pool in
    a layout SGLang's Mamba pool does not address per slot, and any pool registered after start-up: refused."""
    _, host = sglang_env.make_mha_pools("page_first")
    _, small_pages = sglang_env.make_mha_pools("page_first", sglang_env.PoolGeometry(page=8))
    backend = make_backend(host)
    try:
        with pytest.raises(UnsupportedModelError, match="page size 8 differs"):
            backend.register_mem_host_pool_v2(small_pages, PoolName.SWA)
        mamba = sglang_env.make_mamba_host_pool()
        mamba.layout = "layer_first"  # as SGLang's NPU/legacy paths would hand it
        with pytest.raises(UnsupportedModelError, match="layout 'layer_first'"):
            backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        backend.on_host_pools_registered()
        with pytest.raises(UnsupportedModelError, match="after the kvengine HiCache backend started serving"):
            backend.register_mem_host_pool_v2(sglang_env.make_mamba_host_pool(), PoolName.MAMBA)
    finally:
        backend.close()
    _, mla_host = sglang_env.make_mla_host_pool("page_first")
    mla = make_backend(mla_host, is_mla=True)
    try:
        with pytest.raises(UnsupportedModelError, match="MLA model"):
            mla.register_mem_host_pool_v2(sglang_env.make_mha_pools("page_first")[1], PoolName.SWA)
    finally:
        mla.close()


def test_hybrid_model_attaches_through_the_controller() -> None:
    """Scenario: HybridCacheController attaches the backend for a KV + sliding-window model (all pools
    registered, then on_host_pools_registered); a model with an indexer sidecar fails at start-up, naming it."""
    device, host = sglang_env.make_mha_pools("page_first")
    swa_device, swa_host = sglang_env.make_mha_pools("page_first")
    controller = sglang_env.make_controller(device, host, backend="dynamic", hybrid=True,
                                            extra_config=extra_config(kvengine_config={"memory": {
                                                "capacity_bytes": "16MiB"}}),
                                            extra_pools={PoolName.SWA: (swa_device, swa_host)})
    try:
        backend = controller.storage_backend
        assert isinstance(backend, KVEngineHiCacheStorage)
        assert set(backend.registered_pools) == {PoolName.KV, PoolName.SWA} and backend._sealed
    finally:
        controller.detach_storage_backend()
    device, host = sglang_env.make_mha_pools("page_first")
    idx_device, idx_host = sglang_env.make_mha_pools("page_first")
    with pytest.raises(UnsupportedModelError, match="'indexer' host pool"):
        sglang_env.make_controller(device, host, backend="dynamic", hybrid=True, extra_config=extra_config(),
                                   extra_pools={PoolName.INDEXER: (idx_device, idx_host)})


# -- hybrid models: Mamba state and sliding-window KV (v2) -----------------------------------------
def trailing(name: PoolName, n: int = 1) -> PoolTransfer:
    """A prefetch query's transfer for a trailing-window pool: placeholder keys, only their count counts."""
    return PoolTransfer(name=name, keys=["__placeholder__"] * n, hit_policy=PoolHitPolicy.TRAILING_PAGES)


def state_at(pool, slot: int) -> list[torch.Tensor]:
    return [pool.temporal_buffer[slot].clone(), *(c[slot].clone() for c in pool.conv_buffer)]


def fill_mamba(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for buffer in (pool.temporal_buffer, *pool.conv_buffer):
        buffer.copy_(torch.randn(buffer.shape, generator=g))


def make_hybrid_backend(host, tmp_path: Path | None, extra: dict) -> KVEngineHiCacheStorage:
    """A backend registered the way HybridCacheController does: anchor, then every pool, then the end mark."""
    backend = make_backend(host, tmp_path)
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    for name, pool in extra.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


MAMBA_WRITER = textwrap.dedent("""
    import json, sys, torch
    from tests.integrations import sglang_env
    sglang_env.install_shims()
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from kvengine.integrations.sglang import extra_config
    from kvengine.integrations.sglang.backend import KVEngineHiCacheStorage
    args = json.loads(sys.argv[1])
    keys, page = args["keys"], 16
    _, host = sglang_env.make_mha_pools("page_first")
    mamba = sglang_env.make_mamba_host_pool()
    g = torch.Generator().manual_seed(21)
    for buffer in (host.kv_buffer, mamba.temporal_buffer, *mamba.conv_buffer):
        buffer.copy_(torch.randn(buffer.shape, generator=g))
    config = sglang_env.storage_config(extra=extra_config(kvengine_config={
        "memory": {"capacity_bytes": "16MiB"}, "disk": {"path": args["disk"], "fsync": "data"}},
        model_fingerprint="tiny-test-weights"))
    backend = KVEngineHiCacheStorage(config, {})
    backend.register_mem_pool_host(host)
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    # Two radix nodes end at pages 2 and 4: each backs up its state (batch_set_v2, keyed by the node's last
    # page hash) before its KV pages (batch_set_v1). Page 5 belongs to a node whose state was not stored.
    states = {}
    for prefix, slot in ((2, 3), (4, 6)):
        t = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=[keys[prefix - 1]],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert backend.batch_set_v2([t]) == {PoolName.MAMBA: [True]}
        states[prefix] = [mamba.temporal_buffer[slot].clone(), *(c[slot].clone() for c in mamba.conv_buffer)]
    assert backend.batch_set_v1(keys, torch.arange(0, len(keys) * page)) == [True] * len(keys)
    backend.close()
    torch.save({"kv": [host.get_data_page(i * page).clone() for i in range(len(keys))], "states": states},
               args["expected"])
""")


def test_mamba_state_and_kv_are_restored_exactly_in_another_process(tmp_path: Path) -> None:
    """Scenario (hybrid KV + Mamba): one process stores 5 KV pages and the Mamba states of the prefixes of 2
    and 4 pages and exits; a fresh process finds, through the disk tier, exactly the prefixes with a state
    (restorable_prefix_pages), never a shorter or longer one, and restores KV and state bit-exact."""
    _, keys = page_keys(5, seed=21)
    args = {"disk": str(tmp_path / "disk"), "keys": keys, "expected": str(tmp_path / "exp.pt")}
    proc = subprocess.run([sys.executable, "-c", MAMBA_WRITER, json.dumps(args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = torch.load(tmp_path / "exp.pt")
    _, host = sglang_env.make_mha_pools("page_first")
    mamba = sglang_env.make_mamba_host_pool()
    backend = make_hybrid_backend(host, tmp_path, {PoolName.MAMBA: mamba})
    try:
        result = backend.batch_exists_v2(keys, [trailing(PoolName.MAMBA)])
        assert result.restorable_prefix_pages == [2, 4]
        assert result.kv_hit_pages == 4
        assert result.extra_pool_hit_pages == {PoolName.KV: 5, PoolName.MAMBA: 4}
        # Shorter queries: a state is only good for exactly its own prefix.
        assert backend.batch_exists_v2(keys[:3], [trailing(PoolName.MAMBA)]).restorable_prefix_pages == [2]
        assert backend.batch_exists_v2(keys[:1], [trailing(PoolName.MAMBA)]).restorable_prefix_pages == []
        assert backend.batch_exists_v2(keys[:1], [trailing(PoolName.MAMBA)]).kv_hit_pages == 0
        # A longer prefix whose last pages are not stored: the usable part stops at the stored KV.
        longer = backend.batch_exists_v2([*keys, *page_keys(1, seed=77)[1]], [trailing(PoolName.MAMBA)])
        assert (longer.kv_hit_pages, longer.restorable_prefix_pages) == (4, [2, 4])

        # Load what the controller loads for a hit of 4 pages: KV pages 0..3, the state keyed by page 4's hash.
        dst = torch.arange(8 * PAGE, 12 * PAGE)
        assert backend.batch_get_v1(keys[:4], dst) == [True] * 4
        for got, want in zip(pages_at(host, dst), expected["kv"]):
            assert torch.equal(got, want)
        get = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5]), keys=[keys[3]],
                           hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert backend.batch_get_v2([get]) == {PoolName.MAMBA: [True]}
        for got, want in zip(state_at(mamba, 5), expected["states"][4]):
            assert torch.equal(got, want)
        # Prefixes 3 and 5 have no state of their own: nothing is delivered for them.
        for prefix in (3, 5):
            miss = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=[keys[prefix - 1]])
            assert backend.batch_get_v2([miss]) == {PoolName.MAMBA: [False]}
        assert backend.kv.metrics.value("kvengine_loaded_bytes_total", tier="local_disk") > 0
    finally:
        backend.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mamba_state_round_trip_in_each_layout(layout: str) -> None:
    """Both page-first Mamba host layouts, float32 temporal + bf16 conv state (two conv buffers), bit-exact;
    a Mamba record is never served to the KV pool under the same key."""
    _, host = sglang_env.make_mha_pools("page_first")
    mamba = sglang_env.make_mamba_host_pool(layout, conv_shapes=((3, 10), (5,)))
    fill_mamba(mamba, seed=30)
    backend = make_hybrid_backend(host, None, {PoolName.MAMBA: mamba})
    try:
        key = "m" * 64
        want = state_at(mamba, 2)
        put = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=[key])
        assert backend.batch_set_v2([put]) == {PoolName.MAMBA: [True]}
        assert backend.batch_exists([key]) == 0  # the KV pool never sees the Mamba record
        assert backend.batch_get_v1([key], torch.arange(0, PAGE)) == [False]
        get = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([7]), keys=[key])
        assert backend.batch_get_v2([get]) == {PoolName.MAMBA: [True]}
        for got, expect in zip(state_at(mamba, 7), want):
            assert torch.equal(got, expect)
    finally:
        backend.close()


def test_sliding_window_pages_follow_the_trailing_window(tmp_path: Path) -> None:
    """Scenario (hybrid KV + SWA, with a Mamba pool too): a node's SWA pages are stored under the same page
    hashes as its KV pages, in a namespace of their own. A prefix is restorable only where the trailing window
    of SWA pages is stored; pages come back bit-exact after a restart; records of one pool never reach
    another."""
    _, host = sglang_env.make_mha_pools("page_first")
    _, swa = sglang_env.make_mha_pools("page_first", sglang_env.PoolGeometry(layers=1))
    mamba = sglang_env.make_mamba_host_pool()
    fill_random(host, seed=40)
    fill_random(swa, seed=41)
    fill_mamba(mamba, seed=42)
    _, keys = page_keys(5, seed=40)
    a = make_hybrid_backend(host, tmp_path, {PoolName.SWA: swa, PoolName.MAMBA: mamba})
    swa_src = torch.arange(2 * PAGE, 5 * PAGE)  # the node keeps the SWA pages of its last 3 pages only
    want_swa = pages_at(swa, swa_src)
    put = PoolTransfer(name=PoolName.SWA, host_indices=swa_src, keys=keys[2:5],
                       hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert a.batch_set_v2([put]) == {PoolName.SWA: [True] * 3}
    assert a.batch_set_v1(keys, torch.arange(0, 5 * PAGE)) == [True] * 5
    only_mamba = "n" * 64
    assert a.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]),
                                        keys=[only_mamba])]) == {PoolName.MAMBA: [True]}
    a.close()

    _, host2 = sglang_env.make_mha_pools("page_first")
    _, swa2 = sglang_env.make_mha_pools("page_first", sglang_env.PoolGeometry(layers=1))
    b = make_hybrid_backend(host2, tmp_path, {PoolName.SWA: swa2, PoolName.MAMBA: sglang_env.make_mamba_host_pool()})
    try:
        result = b.batch_exists_v2(keys, [trailing(PoolName.SWA, 2)])
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (5, [4, 5])
        assert result.extra_pool_hit_pages == {PoolName.KV: 5, PoolName.SWA: 5}
        assert b.batch_exists_v2(keys, [trailing(PoolName.SWA, 3)]).restorable_prefix_pages == [5]
        assert b.batch_exists_v2(keys[:3], [trailing(PoolName.SWA, 2)]).restorable_prefix_pages == []
        both = b.batch_exists_v2(keys, [trailing(PoolName.SWA, 2), trailing(PoolName.MAMBA)])
        assert (both.kv_hit_pages, both.restorable_prefix_pages) == (0, [])  # no Mamba state at 4 or 5

        dst = torch.arange(10 * PAGE, 12 * PAGE)
        get = PoolTransfer(name=PoolName.SWA, host_indices=dst, keys=keys[3:5], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert b.batch_get_v2([get]) == {PoolName.SWA: [True, True]}
        for got, want in zip(pages_at(swa2, dst), want_swa[1:]):
            assert torch.equal(got, want)
        # Pool isolation: KV pages are not SWA pages, nor a Mamba state an SWA page, under one key.
        not_swa = PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, 2 * PAGE), keys=[keys[0], only_mamba])
        assert b.batch_get_v2([not_swa]) == {PoolName.SWA: [False, False]}
    finally:
        b.close()


def test_bad_extra_config_is_refused() -> None:
    """A typo in the extra config names the allowed keys; a chunk_size other than the page size is refused."""
    _, host = sglang_env.make_mha_pools("page_first")
    with pytest.raises(ConfigError, match="allowed"):
        KVEngineHiCacheStorage(sglang_env.storage_config(extra=extra_config(kvengine_confg={})), {})
    # Any explicit chunk_size but the page size is refused, the engine's former default (256) too.
    for chunk in (64, 256):
        backend = KVEngineHiCacheStorage(
            sglang_env.storage_config(extra=extra_config(kvengine_config={"chunk_size": chunk})), {})
        with pytest.raises(ConfigError, match=f"chunk_size {chunk} differs from SGLang's page size {PAGE}"):
            backend.register_mem_pool_host(host)


@pytest.mark.parametrize("chunk", ["auto", PAGE, None])
def test_chunk_size_auto_or_the_page_size_is_the_page_size(chunk: object) -> None:
    """chunk_size "auto", unset or equal to SGLang's page size: the engine's chunk is one page."""
    _, host = sglang_env.make_mha_pools("page_first")
    kv_config = {"memory": {"capacity_bytes": "16MiB"}} | ({} if chunk is None else {"chunk_size": chunk})
    backend = KVEngineHiCacheStorage(sglang_env.storage_config(extra=extra_config(kvengine_config=kv_config)), {})
    backend.register_mem_pool_host(host)
    try:
        assert backend.kv.config.chunk_size == host.page_size == PAGE
    finally:
        backend.close()


# -- namespaces -----------------------------------------------------------------------------------
def _write_then_read(tmp_path: Path, writer_host, reader_host, *, writer: dict, reader: dict) -> list[bool]:
    fill_random(writer_host, seed=3)
    _, keys = page_keys(2, seed=3)
    a = make_backend(writer_host, tmp_path, **writer)
    assert a.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
    a.close()
    b = make_backend(reader_host, tmp_path, **reader)
    try:
        return b.batch_get_v1(keys, torch.arange(4 * PAGE, 6 * PAGE))
    finally:
        b.close()


@pytest.mark.parametrize("change", ["dtype", "layout", "tp_rank", "model"])
def test_pages_are_never_read_as_other_bytes(tmp_path: Path, change: str) -> None:
    """Regression (SGLang issue #33268: keys without dtype let bf16 and fp8 runs collide): pages written
    under one dtype, layout, TP shard or model are misses for every other one."""
    _, writer_host = sglang_env.make_mha_pools("page_first")
    reader_layout = "page_first_direct" if change == "layout" else "page_first"
    geometry = sglang_env.PoolGeometry(dtype=torch.float16 if change == "dtype" else None)
    _, reader_host = sglang_env.make_mha_pools(reader_layout, geometry)
    writer = {"tp_size": 2}
    reader = {"tp_size": 2, "tp_rank": 1 if change == "tp_rank" else 0,
              "model_name": "tiny/other-model" if change == "model" else "tiny/test-model"}
    assert _write_then_read(tmp_path, writer_host, reader_host, writer=writer, reader=reader) == [False, False]


def test_mla_pages_of_another_latent_rope_split_of_the_same_width_are_misses(tmp_path: Path) -> None:
    """Regression: MLA pages were keyed by the total latent width only, so pages written as 16 + 8
    (kv_lora_rank + rope) were read by a 20 + 4 model (both 24 wide). The split is in the namespace."""
    _, writer_host = sglang_env.make_mla_host_pool("page_first", lora_rank=16, rope_dim=8)
    _, reader_host = sglang_env.make_mla_host_pool("page_first", lora_rank=20, rope_dim=4)
    assert writer_host.kv_cache_dim == reader_host.kv_cache_dim == 24
    same = {"is_mla": True}
    assert _write_then_read(tmp_path, writer_host, reader_host, writer=same, reader=same) == [False, False]
    # control: the same split hits
    _, again = sglang_env.make_mla_host_pool("page_first", lora_rank=16, rope_dim=8)
    (tmp_path / "b").mkdir()  # a disk tier's parent must exist (a missing one is refused as a missing mount)
    assert _write_then_read(tmp_path / "b", writer_host, again, writer=same, reader=same) == [True, True]


def test_without_a_fingerprint_the_weights_files_are_the_identity(tmp_path: Path) -> None:
    """No model_fingerprint: the model path's weight files are hashed, so other weights at another path
    (or the same path rewritten) never share pages; a model that cannot be found to hash is refused."""
    dirs = [tmp_path / "model-a", tmp_path / "model-b"]
    for i, d in enumerate(dirs):
        d.mkdir()
        (d / "model.safetensors").write_bytes(bytes([i]) * 4096)
    _, writer_host = sglang_env.make_mha_pools("page_first")
    _, reader_host = sglang_env.make_mha_pools("page_first")
    kv = {"memory": {"capacity_bytes": "16MiB"}, "disk": {"path": str(tmp_path / "disk"), "fsync": "never"}}

    def backend(host, model: Path):
        b = KVEngineHiCacheStorage(sglang_env.storage_config(model_name=str(model), extra=backend_extra_config(
            kvengine_config=kv)), {})
        b.register_mem_pool_host(host)
        return b

    fill_random(writer_host, seed=8)
    _, keys = page_keys(2, seed=8)
    a = backend(writer_host, dirs[0])
    assert a.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
    a.close()
    for model, hit in ((dirs[1], False), (dirs[0], True)):
        b = backend(reader_host, model)
        try:
            assert b.batch_get_v1(keys, torch.arange(4 * PAGE, 6 * PAGE)) == [hit, hit]
        finally:
            b.close()
    _, host = sglang_env.make_mha_pools("page_first")
    unknown = KVEngineHiCacheStorage(sglang_env.storage_config(extra=backend_extra_config()), {})
    with pytest.raises(ConfigError, match="model_fingerprint"):
        unknown.register_mem_pool_host(host)


def test_same_namespace_hits_across_restarts(tmp_path: Path) -> None:
    """Control for the test above: the same settings do hit after a restart (through the disk tier)."""
    _, writer_host = sglang_env.make_mha_pools("page_first")
    _, reader_host = sglang_env.make_mha_pools("page_first")
    assert _write_then_read(tmp_path, writer_host, reader_host, writer={}, reader={}) == [True, True]
    assert torch.equal(reader_host.get_data_page(4 * PAGE), writer_host.get_data_page(0))


def test_mla_pages_are_shared_by_ranks_and_written_once(tmp_path: Path, layout: str) -> None:
    """MLA KV is the same on every TP rank: rank 1 reads what rank 0 wrote, and rank 1 never writes."""
    _, host0 = sglang_env.make_mla_host_pool(layout)
    _, host1 = sglang_env.make_mla_host_pool(layout)
    fill_random(host0, seed=4)
    fill_random(host1, seed=5)
    _, keys = page_keys(2, seed=4)
    rank1 = make_backend(host1, tmp_path, is_mla=True, tp_rank=1, tp_size=2)
    assert rank1.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]  # not the writer: skipped
    assert rank1.batch_exists(keys) == 0
    rank1.close()
    rank0 = make_backend(host0, tmp_path, is_mla=True, tp_rank=0, tp_size=2)
    assert rank0.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
    rank0.close()
    rank1 = make_backend(host1, tmp_path, is_mla=True, tp_rank=1, tp_size=2)
    try:
        assert rank1.batch_get_v1(keys, torch.arange(4 * PAGE, 6 * PAGE)) == [True, True]
        assert torch.equal(host1.get_data_page(5 * PAGE), host0.get_data_page(PAGE))
    finally:
        rank1.close()


# -- another process ----------------------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import json, sys, torch
    from tests.integrations import sglang_env
    sglang_env.install_shims()
    from kvengine.integrations.sglang import extra_config
    from kvengine.integrations.sglang.backend import KVEngineHiCacheStorage
    args = json.loads(sys.argv[1])
    _, host = sglang_env.make_mha_pools(args["layout"])
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(7)))
    config = sglang_env.storage_config(layout=args["layout"], extra=extra_config(kvengine_config=args["kv"],
                                                                                 model_fingerprint="tiny-test-weights"))
    backend = KVEngineHiCacheStorage(config, {})
    backend.register_mem_pool_host(host)
    n = len(args["keys"])
    assert backend.batch_set_v1(args["keys"], torch.arange(0, n * host.page_size)) == [True] * n
    backend.close()
    torch.save([host.get_data_page(i * host.page_size).clone() for i in range(n)], args["expected"])
""")


def test_exists_counts_only_pages_that_verify(tmp_path: Path) -> None:
    """Regression (issue 18): batch_exists answered from the disk index, so a page with a damaged payload was
    counted and SGLang's prefetch promised more pages than it could load. Now the answer stops at the damaged
    page, and every page it counts then loads exactly."""
    _, writer_host = sglang_env.make_mha_pools("page_first")
    fill_random(writer_host, seed=4)
    _, keys = page_keys(4, seed=4)
    src = torch.arange(0, 4 * PAGE)
    expected = pages_at(writer_host, src)
    writer = make_backend(writer_host, tmp_path)
    assert writer.batch_set_v1(keys, src) == [True] * 4
    damaged = keyed_chunk_key(writer.binding, keys[2].encode()).chunk_hash.hex()
    writer.close()
    victim = next(p for p in (tmp_path / "disk").rglob("*") if p.is_file() and damaged in p.name)
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0xFF
    victim.write_bytes(bytes(raw))
    _, reader_host = sglang_env.make_mha_pools("page_first")
    reader = make_backend(reader_host, tmp_path)
    try:
        assert reader.batch_exists(keys) == 2
        dst = torch.arange(8 * PAGE, 10 * PAGE)
        assert reader.batch_get_v1(keys[:2], dst) == [True, True]
        for got, want in zip(pages_at(reader_host, dst), expected):
            assert torch.equal(got, want)
    finally:
        reader.close()


def _write_in_another_process(tmp_path: Path, layout: str, keys: list[str], kv: dict) -> None:
    """Run :data:`WRITER` (its backend configured by ``kv``); the pages it stored are saved to exp.pt."""
    args = {"layout": layout, "keys": keys, "kv": kv, "expected": str(tmp_path / "exp.pt")}
    proc = subprocess.run([sys.executable, "-c", WRITER, json.dumps(args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_second_process_reads_what_the_first_wrote(tmp_path: Path) -> None:
    """Scenario: one SGLang rank process stores pages and exits; a new process loads them from disk, exact."""
    layout = "page_first"
    _, keys = page_keys(5, seed=6)
    _write_in_another_process(tmp_path, layout, keys, {
        "memory": {"capacity_bytes": "16MiB"}, "disk": {"path": str(tmp_path / "disk"), "fsync": "data"}})
    expected = torch.load(tmp_path / "exp.pt")
    _, host = sglang_env.make_mha_pools(layout)
    backend = make_backend(host, tmp_path)
    try:
        assert backend.batch_exists(keys) == 5
        dst = torch.arange(8 * PAGE, 13 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 5
        for got, want in zip(pages_at(host, dst), expected):
            assert torch.equal(got, want)
        assert backend.kv.metrics.value("kvengine_loaded_bytes_total", tier="local_disk") > 0
    finally:
        backend.close()


def test_pages_stored_through_the_host_service_are_read_by_another_process_and_held_once(tmp_path: Path) -> None:
    """Scenario (issue 35): SGLang rank processes attach to one ``kvengine host`` by configuration alone, the
    service owning a disk tier. One stores 5 pages and exits; a fresh one, with no tier of its own, finds
    all 5 (batch_exists), loads them exactly from the shared arena, and storing them again adds no copy.
    The service is restarted on its disk (its arena empty): a fresh rank finds all 5 again (promoted by the
    service from its disk) and loads them exactly."""
    layout = "page_first"
    _, keys = page_keys(5, seed=8)
    _, probe = sglang_env.make_mha_pools(layout)
    page_bytes = probe.get_data_page(0).numel() * probe.get_data_page(0).element_size()
    (tmp_path / "host.yaml").write_text(f"disk:\n  path: {tmp_path / 'host_disk'}\n")
    service = Host(tmp_path / "kvengine.sock", capacity=64 * page_bytes, slab_bytes=8 * page_bytes)
    service.start("--config", str(tmp_path / "host.yaml"))
    kv = {"memory": {"service": str(service.path)}}

    def read_all(expected: list[torch.Tensor]) -> KVEngineHiCacheStorage:
        """A fresh rank's backend that found and loaded all 5 pages exactly (left open)."""
        _, host = sglang_env.make_mha_pools(layout)
        backend = KVEngineHiCacheStorage(sglang_env.storage_config(layout=layout,
                                                                   extra=extra_config(kvengine_config=kv)), {})
        backend.register_mem_pool_host(host)
        assert isinstance(backend.kv._core.memory, ServiceMemory)
        assert backend.batch_exists(keys) == 5
        dst = torch.arange(8 * PAGE, 13 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 5
        for got, want in zip(pages_at(host, dst), expected):
            assert torch.equal(got, want)
        assert backend.kv.metrics.value("kvengine_loaded_bytes_total", tier="memory") == 5 * page_bytes
        return backend

    try:
        _write_in_another_process(tmp_path, layout, keys, kv)
        expected = torch.load(tmp_path / "exp.pt")
        backend = read_all(expected)
        try:
            memory = backend.kv._core.memory
            held = memory.service_stats()
            assert held.chunks == 5
            dst = torch.arange(8 * PAGE, 13 * PAGE)
            assert backend.batch_set_v1(keys, dst) == [True] * 5  # already held: nothing is added
            assert memory.service_stats().used_bytes == held.used_bytes
        finally:
            backend.close()
        assert "5 chunks" in service.stop()  # writes what is queued to its disk
        service.start("--config", str(tmp_path / "host.yaml"))
        backend = read_all(expected)
        backend.close()
    finally:
        if service.proc is not None and service.proc.poll() is None:
            service.kill()


# -- through a real Mooncake master -------------------------------------------------------------------
MOONCAKE_NODE = textwrap.dedent("""
    import json, sys, torch
    from tests.integrations import sglang_env
    sglang_env.install_shims()
    from kvengine.integrations.sglang import extra_config
    from kvengine.integrations.sglang.backend import KVEngineHiCacheStorage
    from kvengine.transports.mooncake_store import MooncakeStoreTransport
    args = json.loads(sys.argv[1])
    _, host = sglang_env.make_mha_pools("page_first")
    page, keys = host.page_size, args["keys"]
    config = sglang_env.storage_config(extra=extra_config(kvengine_config={
        "memory": {"capacity_bytes": "16MiB"},
        "mooncake": {"master": args["master"], "local_hostname": args["host"], "segment_bytes": 0, "timeout": 10.0}},
        model_fingerprint="tiny-test-weights"))
    backend = KVEngineHiCacheStorage(config, {})
    backend.register_mem_pool_host(host)
    (tier,) = [t for t in backend.kv._core.tiers.transports if isinstance(t, MooncakeStoreTransport)]
    assert tier.wait_connected(30.0), "no connection to the mooncake master"
    value = backend.kv.metrics.value
    if args["role"] == "writer":
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(11)))
        slots = torch.arange(0, len(keys) * page)
        report = {"set": backend.batch_set_v1(keys, slots)}
        backend.kv.flush()  # the write-behind puts into Mooncake are done
        report["stored_chunks"] = value("kvengine_stored_chunks_total", tier="mooncake")
        report["put_failures"] = value("kvengine_tier_put_failures_total", tier="mooncake")
        torch.save([host.get_data_page(int(i)).clone() for i in slots[::page]], args["pages"])
    else:  # the reader: its memory is empty, so every page it counts or loads comes from Mooncake
        slots = torch.arange(8 * page, (8 + len(keys)) * page)
        report = {"exists": backend.batch_exists(keys), "unknown": backend.batch_exists(["f" * 64]),
                  "get": backend.batch_get_v1(keys, slots)}
        torch.save([host.get_data_page(int(i)).clone() for i in slots[::page]], args["pages"])
        report["loaded_bytes"] = {t: value("kvengine_loaded_bytes_total", tier=t) for t in ("mooncake", "memory")}
        report["integrity_failures"] = value("kvengine_integrity_failures_total")
    backend.close()
    print(json.dumps(report))
""")


def _mooncake_node(role: str, host: str, master: str, keys: list[str], pages: Path) -> dict:
    """Run one SGLang rank process whose backend's only tier below memory is the Mooncake tier; its report."""
    env = {k: v for k, v in os.environ.items() if k != "MC_TCP_BIND_ADDRESS"}  # the tier sets it from host
    args = {"role": role, "host": host, "master": master, "keys": keys, "pages": str(pages)}
    proc = subprocess.run([sys.executable, "-c", MOONCAKE_NODE, json.dumps(args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{role} failed:\n{proc.stderr[-3000:]}"
    report: dict = json.loads(proc.stdout.splitlines()[-1])
    return report


def test_pages_stored_in_one_process_are_served_to_another_through_mooncake(tmp_path: Path) -> None:
    """Scenario: a real mooncake_master on loopback and a process holding the cluster's only segment. One SGLang
    rank process (a Mooncake client on 127.0.0.2 contributing no memory) stores pages through the backend and
    exits; a second one (127.0.0.3, empty memory, no disk) finds them all (batch_exists) and loads the exact
    bytes (batch_get_v1), every one read from Mooncake."""
    n = 6
    _, keys = page_keys(n, seed=11)
    # The segment is held by a process of its own: Mooncake drops a segment's objects when its owner leaves,
    # and the writer is gone before the reader starts.
    with Master() as master, SegmentHolder(master.address, host="127.0.0.4", segment_bytes=16 << 20):
        wrote = _mooncake_node("writer", "127.0.0.2", master.address, keys, tmp_path / "written.pt")
        read = _mooncake_node("reader", "127.0.0.3", master.address, keys, tmp_path / "read.pt")
    assert wrote["set"] == [True] * n
    assert (wrote["stored_chunks"], wrote["put_failures"]) == (n, 0)
    assert read["exists"] == n and read["unknown"] == 0
    assert read["get"] == [True] * n
    written, got = torch.load(tmp_path / "written.pt"), torch.load(tmp_path / "read.pt")
    assert len(got) == n and all(torch.equal(a, b) for a, b in zip(got, written))
    page_bytes = written[0].numel() * written[0].element_size()
    assert read["loaded_bytes"] == {"mooncake": n * page_bytes, "memory": n * page_bytes}
    assert read["integrity_failures"] == 0
