"""Test-only set-up that lets SGLang 0.5.23 run its HiCache pieces on a CPU box.

None of this belongs in the backend (``kvengine.integrations.sglang``): these
are quirks of running SGLang without a GPU or a server.

* ``torchvision``: SGLang's config package imports it at load time; the PyPI
  build is CUDA-only and breaks beside CPU torch. A stub import hook serves
  every ``torchvision.*`` module; touching anything in it raises.
* Host memory budget: SGLang keeps 10 GiB of host RAM in reserve, which on a
  24 GiB machine leaves a negative budget for any host pool. Patched to a
  fixed generous number.
* Parallel state: ``HiCacheController`` asks a gloo process group and the
  global parallel context for ranks; a one-process group and a permanent
  override give it tp=pp=cp=1.

Import :func:`require_sglang` first; it skips the calling test module with a
clear reason when SGLang is not installed (the main ``.venv`` never has it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from dataclasses import dataclass

import pytest

from tests.integrations.ports import free_port

SKIP_REASON = ("sglang is not importable in this environment; run `bash scripts/setup_sglang.sh` and use "
               ".venv-sglang/bin/python -m pytest tests/integrations/test_sglang_*.py")

HOST_BUDGET_BYTES = 64 << 30


def require_sglang() -> None:
    """Skip the calling module unless SGLang can be imported; then install the shims."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    install_shims()


# -- torchvision stub -----------------------------------------------------------------
class _Unavailable:
    """Stands for any torchvision attribute; using it says why it is missing."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"{self._name}: torchvision is stubbed out in the kvengine SGLang tests")

    def __getattr__(self, attr: str) -> _Unavailable:
        return _Unavailable(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple) -> tuple:  # ``class X(torchvision.Foo)``
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so submodules import
        module.__getattr__ = lambda attr, _n=spec.name: _Unavailable(f"{_n}.{attr}")  # type: ignore[attr-defined]
        if spec.name == "torchvision":
            module.__version__ = "0.0.0+kvengine-stub"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_installed = False
_lock = threading.Lock()


def install_shims() -> None:
    """Idempotent: torchvision stub and the host-memory budget patch."""
    global _installed
    with _lock:
        if _installed:
            return
        if importlib.util.find_spec("torchvision") is None:
            sys.meta_path.insert(0, _StubFinder())
        import sglang.srt.mem_cache.pool_host.base as pool_base
        import sglang.srt.mem_cache.pool_host.mamba as pool_mamba
        import sglang.srt.mem_cache.pool_host.mha as pool_mha
        import sglang.srt.mem_cache.pool_host.mla as pool_mla

        def budget(requested_bytes: int = 0, *, auto_size: bool = False) -> int:
            return HOST_BUDGET_BYTES

        for module in (pool_base, pool_mamba, pool_mha, pool_mla):
            if hasattr(module, "host_memory_budget_bytes"):
                module.host_memory_budget_bytes = budget  # type: ignore[attr-defined]
        _installed = True


# -- pools ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolGeometry:
    layers: int = 3
    heads: int = 2
    head_dim: int = 8
    page: int = 16
    device_tokens: int = 256
    dtype: object = None  # torch dtype; bfloat16 when None


def make_mha_pools(layout: str, geometry: PoolGeometry = PoolGeometry(), *, host_ratio: float = 2.0):
    """A CPU ``MHATokenToKVPool`` and its ``MHATokenToKVPoolHost`` in ``layout``."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    g = geometry
    dtype = g.dtype or torch.bfloat16
    device = MHATokenToKVPool(g.device_tokens, g.page, dtype, g.heads, g.head_dim, g.layers, "cpu", False,
                              start_layer=0, end_layer=g.layers)
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, host_ratio, 0, g.page, layout, pin_memory=False,
        device="cpu", device_capacity_tokens=device.size, start_layer=device.start_layer,
        end_layer=device.end_layer,
    )
    return device, host


def make_mla_host_pool(layout: str, *, layers: int = 2, lora_rank: int = 16, rope_dim: int = 8, page: int = 16,
                       device_tokens: int = 256):
    """A CPU ``MLATokenToKVPoolHost`` (the device pool it mirrors is built on CPU too)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(device_tokens, page, torch.bfloat16, lora_rank, rope_dim, layers, "cpu", False,
                              start_layer=0, end_layer=layers)
    info = device.get_device_pool_infos()[0].buffer_info
    host = MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=device.size, start_layer=0, end_layer=layers,
                                target_layer_num=layers)
    return device, host


def make_mamba_host_pool(layout: str = "page_first", *, layers: int = 2, slots: int = 8,
                         temporal_shape: tuple = (4, 6), conv_shapes: tuple = ((3, 10),), temporal_dtype=None,
                         conv_dtype=None):
    """A CPU ``MambaPoolHost`` (one state slot per radix node) over a CPU ``MambaStateBufferInfo``.

    No CUDA or Triton is involved: the host pool's storage path only reads its own
    temporal / conv host buffers.
    """
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, *temporal_shape, dtype=temporal_dtype or torch.float32),
        conv=tuple(torch.zeros(layers, slots, *shape, dtype=conv_dtype or torch.bfloat16) for shape in conv_shapes),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout)


def storage_config(*, tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False, layout: str = "page_first",
                   model_name: str = "tiny/test-model", extra: dict | None = None):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name=model_name, extra_config=dict(extra or {}),
    )


# -- a one-process "cluster" for HiCacheController ----------------------------------------
def init_single_process_parallel() -> None:
    """gloo world of one and SGLang's parallel context pinned to tp=pp=cp=1 (idempotent)."""
    import torch.distributed as dist

    if not dist.is_initialized():  # an address of its own (not the environment's: child processes inherit it)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
        attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0, attn_cp_rank=0, attn_cp_size=1,
    )


def make_controller(device_pool, host_pool, *, backend: str, extra_config: dict | None,
                    model_name: str = "tiny/test-model", write_policy: str = "write_through",
                    hybrid: bool = False, extra_pools: dict | None = None):
    """A real controller over a paged CPU allocator with ``backend`` attached.

    ``hybrid=False``: ``HiCacheController`` (what SGLang's decode offload uses).
    ``hybrid=True``: ``HybridCacheController`` over a ``HostPoolGroup`` (what the
    unified radix cache uses for every model in 0.5.23); ``extra_pools`` maps
    pool names to (device pool, host pool) sidecars, as a hybrid model has.
    """
    import threading as _threading

    import torch.distributed as dist
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    init_single_process_parallel()
    allocator = PagedTokenToKVPoolAllocator(device_pool.size, device_pool.page_size, device_pool.dtype, "cpu",
                                            device_pool, need_sort=False)
    common = dict(write_policy=write_policy, io_backend="direct", storage_backend=backend, prefetch_threshold=0,
                  model_name=model_name, storage_backend_extra_config=extra_config)
    if not hybrid:
        from sglang.srt.managers.cache_controller import HiCacheController

        return HiCacheController(allocator, host_pool, device_pool.page_size, dist.group.WORLD,
                                 _threading.Event(), **common)
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.pool_host import HostPoolGroup

    layers = device_pool.layer_num
    entries = [build_pool_entry(name=PoolName.KV, host_pool=host_pool, device_pool=device_pool,
                                layer_mapping={i: i for i in range(layers)}, transfer_layer_id_max=layers,
                                is_anchor=True)]
    for name, (device, host) in (extra_pools or {}).items():
        entries.append(build_pool_entry(name=name, host_pool=host, device_pool=device,
                                        layer_mapping={i: i for i in range(device.layer_num)},
                                        transfer_layer_id_max=layers))
    return HybridCacheController(allocator, HostPoolGroup(entries), device_pool.page_size, dist.group.WORLD,
                                 _threading.Event(), transfer_layer_id_max=layers, **common)


class RequestHandle:
    """Stands for the scheduler's request handle in ``HybridCacheController.prefetch``."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
