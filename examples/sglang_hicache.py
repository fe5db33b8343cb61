"""kvengine as SGLang's HiCache L3 storage: how to turn it on, and what it does.

1. Print the server flags that load the backend (any machine, no SGLang needed)::

       python examples/sglang_hicache.py flags --disk /var/cache/kvengine --memory 8GiB

2. Drive the backend the way SGLang's controller does, on CPU, with a real
   SGLang host pool (needs SGLang 0.5.23: ``bash scripts/setup_sglang.sh``
   makes .venv-sglang; exit 2 with that hint when SGLang is missing)::

       .venv-sglang/bin/python examples/sglang_hicache.py demo

   It stores 8 pages, loads them back bit-exact into other host slots, shows
   the disk tier serving a fresh process's worth of engine, and shows what a
   refused configuration looks like.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import shlex
import sys
import tempfile
import types

INSTALL = ("pip install --no-deps 'sglang==0.5.23' plus the modules its imports need "
           "(bash scripts/setup_sglang.sh does both, into .venv-sglang)")
HOST_BUDGET_BYTES = 64 << 30


def require(module: str, install: str) -> None:
    """Exit 2 with one line naming the install command when ``module`` is not installed."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != module:
            raise  # installed but broken: the real error says more than an install hint
        print(f"examples/sglang_hicache.py demo needs {module}, which is not installed; install it with: {install}",
              file=sys.stderr)
        sys.exit(2)


# -- SGLang on a CPU box, outside a server (quirks of SGLang, not of the backend) ---------------------
class _Unavailable:
    """Stands for any torchvision attribute; using it says why it is missing."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"{self._name}: torchvision is stubbed out in this example")

    def __getattr__(self, attr: str) -> _Unavailable:
        return _Unavailable(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple) -> tuple:  # ``class X(torchvision.Foo)``
        return (object,)


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """SGLang's config package imports torchvision at load time; the PyPI build is CUDA-only."""

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


def install_shims() -> None:
    """Stub torchvision when absent; give SGLang's host pools a fixed budget (it reserves 10 GiB of RAM)."""
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _TorchvisionStub())
    import sglang.srt.mem_cache.pool_host.base as pool_base
    import sglang.srt.mem_cache.pool_host.mha as pool_mha
    import sglang.srt.mem_cache.pool_host.mla as pool_mla

    def budget(requested_bytes: int = 0, *, auto_size: bool = False) -> int:
        return HOST_BUDGET_BYTES

    for module in (pool_base, pool_mha, pool_mla):
        if hasattr(module, "host_memory_budget_bytes"):
            module.host_memory_budget_bytes = budget  # type: ignore[attr-defined]


def make_mha_pools(layout: str, *, layers: int = 3, heads: int = 2, head_dim: int = 8, page: int = 16,
                   device_tokens: int = 256):
    """A CPU ``MHATokenToKVPool`` and its ``MHATokenToKVPoolHost`` (twice its size) in ``layout``."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(device_tokens, page, torch.bfloat16, heads, head_dim, layers, "cpu", False,
                              start_layer=0, end_layer=layers)
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout, pin_memory=False,
        device="cpu", device_capacity_tokens=device.size, start_layer=device.start_layer,
        end_layer=device.end_layer,
    )
    return device, host


def storage_config(*, layout: str = "page_first", extra: dict | None = None):
    """What SGLang's controller hands a storage backend, for one rank (tp=pp=cp=1)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name="tiny/example-model", extra_config=dict(extra or {}),
    )


def server_flags(disk: str | None, memory: str, model: str | None) -> list[str]:
    from kvengine.integrations.sglang import extra_config

    kv: dict = {"memory": {"capacity_bytes": memory}}
    if disk:
        kv["disk"] = {"path": disk}
    own: dict = {"kvengine_config": kv}
    if model:
        own["model"] = model
    return ["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first",
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra_config(**own))]


def demo() -> int:
    require("sglang", INSTALL)
    install_shims()
    import torch
    from sglang.srt.mem_cache.utils import get_hash_str

    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.sglang import extra_config
    from kvengine.integrations.sglang.backend import KVEngineHiCacheStorage

    page = 16
    _, host = make_mha_pools("page_first")
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape))
    tokens = list(range(1000, 1000 + 8 * page))
    keys = get_hash_str(tokens, None, page_size=page)  # SGLang's page hash chain
    src, dst = torch.arange(0, 8 * page), torch.arange(16 * page, 24 * page)

    with tempfile.TemporaryDirectory() as disk:
        def open_backend() -> KVEngineHiCacheStorage:
            config = storage_config(extra=extra_config(kvengine_config={
                "memory": {"capacity_bytes": "64MiB"}, "disk": {"path": disk}},
                model_fingerprint="demo-random-pages"))  # a real server hashes its model's weight files
            backend = KVEngineHiCacheStorage(config, {})  # what SGLang's factory does ...
            backend.register_mem_pool_host(host)  # ... then it hands over the host pool
            return backend

        backend = open_backend()
        print("namespace:", backend.binding.namespace)
        print("stored:", backend.batch_set_v1(keys, src))
        print("batch_exists:", backend.batch_exists(keys), "of", len(keys))
        backend.close()  # flushes the disk tier

        backend = open_backend()  # a new engine: memory empty, pages come from disk
        print("loaded:", backend.batch_get_v1(keys, dst))
        same = all(torch.equal(host.get_data_page(int(src[i])), host.get_data_page(int(dst[i])))
                   for i in range(0, len(src), page))
        print("bit-exact:", same)
        backend.close()

    _, page_head = make_mha_pools("page_head")
    try:
        KVEngineHiCacheStorage(storage_config(layout="page_head", extra=extra_config()), {}) \
            .register_mem_pool_host(page_head)
    except UnsupportedModelError as exc:
        print("refused:", exc)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    flags = sub.add_parser("flags", help="print the sglang.launch_server flags")
    flags.add_argument("--disk", default=None, help="disk tier directory (omit: memory only)")
    flags.add_argument("--memory", default="4GiB", help="kvengine memory tier capacity")
    flags.add_argument("--model", default=None, help="model identity for the namespace (default: SGLang's)")
    sub.add_parser("demo", help="store and load pages through a real SGLang host pool (needs SGLang: .venv-sglang)")
    args = parser.parse_args(argv)
    if args.cmd == "flags":
        print("python -m sglang.launch_server --model-path MODEL " + shlex.join(
            server_flags(args.disk, args.memory, args.model)))
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())
