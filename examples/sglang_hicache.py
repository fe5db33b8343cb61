"""kvengine as SGLang's HiCache L3 storage: how to turn it on, and what it does.

1. Print the server flags that load the backend (any machine, no SGLang needed)::

       python examples/sglang_hicache.py flags --disk /var/cache/kvengine --memory 8GiB

2. Drive the backend the way SGLang's controller does, on CPU, with a real
   SGLang host pool (needs .venv-sglang: ``bash scripts/setup_sglang.sh``)::

       .venv-sglang/bin/python examples/sglang_hicache.py demo

   It stores 8 pages, loads them back bit-exact into other host slots, shows
   the disk tier serving a fresh process's worth of engine, and shows what a
   refused configuration looks like.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    sys.path.insert(0, str(REPO))
    from tests.integrations import sglang_env  # SGLang's CPU quirks (torchvision stub, host budget)

    sglang_env.install_shims()
    import torch
    from sglang.srt.mem_cache.utils import get_hash_str

    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.sglang import extra_config
    from kvengine.integrations.sglang.backend import KVEngineHiCacheStorage

    page = 16
    _, host = sglang_env.make_mha_pools("page_first")
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape))
    tokens = list(range(1000, 1000 + 8 * page))
    keys = get_hash_str(tokens, None, page_size=page)  # SGLang's page hash chain
    src, dst = torch.arange(0, 8 * page), torch.arange(16 * page, 24 * page)

    with tempfile.TemporaryDirectory() as disk:
        def open_backend() -> KVEngineHiCacheStorage:
            config = sglang_env.storage_config(extra=extra_config(kvengine_config={
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

    _, page_head = sglang_env.make_mha_pools("page_head")
    try:
        KVEngineHiCacheStorage(sglang_env.storage_config(layout="page_head", extra=extra_config()), {}) \
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
    sub.add_parser("demo", help="store and load pages through a real SGLang host pool (needs .venv-sglang)")
    args = parser.parse_args(argv)
    if args.cmd == "flags":
        print("python -m sglang.launch_server --model-path MODEL " + shlex.join(
            server_flags(args.disk, args.memory, args.model)))
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())
