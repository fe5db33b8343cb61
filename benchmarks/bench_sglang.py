"""kvengine's SGLang HiCache backend vs SGLang's built-in HiCacheFile, same host pool, same run.

Usage (needs .venv-sglang, see docs/sglang.md)::

    .venv-sglang/bin/python benchmarks/bench_sglang.py [--rounds 5] [--layers 8] [--page 32] [--dir DIR]

One operation = one controller batch: 128 pages (SGLang's STORAGE_BATCH_SIZE)
moved between the host pool and storage, done the way HiCacheController
does it for each backend:

* kvengine: ``batch_set_v1`` / ``batch_get_v1`` (zero-copy: page regions via
  ``get_page_buffer_meta``), ``interface_v1`` as in the recommended config.
  - ``memory``: memory tier only (arena prefaulted, as in a server that has run a while).
  - ``disk``: memory + local disk, ``write_through`` (a set returns once the
    records are written, fsync "never" like HiCacheFile), and the get of a
    second engine opened on the same directory (memory empty: every page is
    read from disk, verified and promoted). The transport's default
    ``direct_io`` (O_DIRECT for large records): real disk I/O both ways.
  - ``disk_cached``: the same through the page cache (``direct_io: false``),
    which is what HiCacheFile does.
* HiCacheFile: the controller's generic path (HiCacheFile has no v1):
  ``get_data_page`` + ``batch_set``; ``batch_get`` into dummy pages +
  ``set_from_flat_data_page``. One file per page, no fsync.

Every set stores fresh keys; every get reads pages stored by an earlier set.
Backends alternate within each round; medians over rounds. Disk reads of
both are from the page cache (nothing is dropped): this compares software
paths (except kvengine_disk, which bypasses the page cache). torch runs one intra-op thread by default (``--threads``):
on a shared 2-core machine OpenMP's waits otherwise swamp both backends.
Results: ``benchmarks/results/sglang.json``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integrations import sglang_env

sglang_env.install_shims()

import torch
from _util import print_header, print_table, write_json
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheFile

from kvengine.integrations.sglang import extra_config
from kvengine.integrations.sglang.backend import KVEngineHiCacheStorage

PAGES = STORAGE_BATCH_SIZE  # 128
_counter = itertools.count()


def fresh_keys() -> list[str]:
    n = next(_counter)
    return [f"{n:032x}{i:032x}" for i in range(PAGES)]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class KVEngineCase:
    def __init__(self, host, layout: str, disk: Path | None, memory: str, *, direct_io: bool | None = None) -> None:
        self.host, self.layout, self.disk, self.memory, self.direct_io = host, layout, disk, memory, direct_io
        self.backend = self._open()
        self.reader: KVEngineHiCacheStorage | None = None

    def _open(self, *, prefault: bool = True) -> KVEngineHiCacheStorage:
        # prefault: a long-running server's arena is touched already; measure that, not first-touch faults.
        config: dict = {"memory": {"capacity_bytes": self.memory, "prefault": prefault}}
        if self.disk is not None:
            config.update(write_mode="write_through", disk={"path": str(self.disk), "fsync": "never",
                                                            "capacity_bytes": "16GiB"})
        backend = KVEngineHiCacheStorage(sglang_env.storage_config(
            layout=self.layout, model_name="bench/sglang",
            extra=extra_config(kvengine_config=config, disk_transport={"direct_io": self.direct_io},
                               model_fingerprint="bench-random-pages")), {})
        backend.register_mem_pool_host(self.host)
        return backend

    def set(self, keys: list[str], src: torch.Tensor) -> float:
        return timed(lambda: _all(self.backend.batch_set_v1(keys, src)))

    def get(self, keys: list[str], dst: torch.Tensor) -> float:
        if self.disk is None:
            return timed(lambda: _all(self.backend.batch_get_v1(keys, dst)))
        # A second engine on the same directory: its memory is empty, so every page comes from disk.
        reader = self._open()  # prefaulted before the timer, as a running server's arena is
        try:
            return timed(lambda: _all(reader.batch_get_v1(keys, dst)))
        finally:
            reader.close()
            gc.collect()  # a closed engine's arena is freed only by the cycle collector

    def close(self) -> None:
        self.backend.close()


class HiCacheFileCase:
    def __init__(self, host, layout: str, path: Path) -> None:
        self.host = host
        self.backend = HiCacheFile(sglang_env.storage_config(
            layout=layout, model_name="bench/sglang", extra={"file_storage_path": str(path)}), str(path))

    def set(self, keys: list[str], src: torch.Tensor) -> float:
        page = self.host.page_size

        def run() -> None:  # HiCacheController._generic_page_set
            data = [self.host.get_data_page(src[i * page]) for i in range(len(keys))]
            _all([self.backend.batch_set(keys, data)])

        return timed(run)

    def get(self, keys: list[str], dst: torch.Tensor) -> float:
        page = self.host.page_size

        def run() -> None:  # HiCacheController._generic_page_get
            targets = [self.host.get_dummy_flat_data_page() for _ in keys]
            got = self.backend.batch_get(keys, targets)
            for i, data in enumerate(got):
                assert data is not None
                self.host.set_from_flat_data_page(dst[i * page], data)

        return timed(run)

    def close(self) -> None:
        pass


def _all(results: list) -> None:
    if not all(results):
        raise RuntimeError(f"benchmark operation failed: {results.count(False)} of {len(results)} pages")


def run_layout(layout: str, args: argparse.Namespace, root: Path, *, with_file: bool) -> dict:
    geometry = sglang_env.PoolGeometry(layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                                       page=args.page, device_tokens=PAGES * args.page)
    _, host = sglang_env.make_mha_pools(layout, geometry, host_ratio=2.0)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(0)))
    page_bytes = host.get_data_page(0).numel() * host.dtype.itemsize
    src = torch.arange(0, PAGES * args.page)
    dst = torch.arange(PAGES * args.page, 2 * PAGES * args.page)
    cases: dict[str, object] = {"kvengine_memory": KVEngineCase(host, layout, None, args.memory)}
    if with_file:
        cases["kvengine_disk"] = KVEngineCase(host, layout, root / f"kvengine-{layout}", args.memory)
        cases["kvengine_disk_cached"] = KVEngineCase(host, layout, root / f"kvengine-cached-{layout}", args.memory,
                                                     direct_io=False)
        cases["hicache_file"] = HiCacheFileCase(host, layout, root / f"hicache-{layout}")
    samples: dict[str, dict[str, list[float]]] = {name: {"set": [], "get": []} for name in cases}
    expected = [host.get_data_page(int(src[i * args.page])).clone() for i in (0, PAGES - 1)]
    try:
        for r in range(args.rounds + 1):  # round 0 warms up (allocations, imports, page faults)
            order = list(cases.items()) if r % 2 else list(reversed(cases.items()))
            for name, case in order:
                keys = fresh_keys()
                t_set = case.set(keys, src)  # type: ignore[attr-defined]
                t_get = case.get(keys, dst)  # type: ignore[attr-defined]
                for i, want in zip((0, PAGES - 1), expected):
                    if not torch.equal(host.get_data_page(int(dst[i * args.page])), want):
                        raise RuntimeError(f"{name}: page {i} did not round-trip")
                if r:
                    samples[name]["set"].append(t_set)
                    samples[name]["get"].append(t_get)
    finally:
        for case in cases.values():
            case.close()  # type: ignore[attr-defined]
        cases.clear()
        gc.collect()
    result: dict = {"page_bytes": page_bytes, "batch_bytes": page_bytes * PAGES, "backends": {}}
    for name, ops in samples.items():
        result["backends"][name] = {
            op: {"median_s": statistics.median(ts), "samples_s": ts,
                 "pages_per_s": PAGES / statistics.median(ts),
                 "gb_per_s": page_bytes * PAGES / statistics.median(ts) / 1e9}
            for op, ts in ops.items()
        }
    if with_file:
        base = result["backends"]["hicache_file"]
        result["ratios_vs_hicache_file"] = {
            name: {op: base[op]["median_s"] / v["median_s"] for op, v in ops.items()}
            for name, ops in result["backends"].items() if name != "hicache_file"
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=32)
    parser.add_argument("--memory", default="1GiB", help="kvengine memory tier capacity")
    parser.add_argument("--dir", default=None, help="directory for both disk backends (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: OpenMP waits dominate on a shared 2-core box)")
    parser.add_argument("--layouts", default="page_first,layer_first,page_first_direct",
                        help="the first also runs the disk backends and HiCacheFile")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print_header()
    root = Path(tempfile.mkdtemp(prefix="bench-sglang-", dir=args.dir))
    results: dict = {}
    try:
        for i, layout in enumerate(args.layouts.split(",")):
            results[layout] = run_layout(layout, args, root, with_file=i == 0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for layout, res in results.items():
        for name, ops in res["backends"].items():
            ratio = res.get("ratios_vs_hicache_file", {}).get(name, {})
            rows.append([layout, name, ops["set"]["pages_per_s"], ops["set"]["gb_per_s"], ops["get"]["pages_per_s"],
                         ops["get"]["gb_per_s"], ratio.get("set", ""), ratio.get("get", "")])
    print_table(f"SGLang HiCache storage, {PAGES} pages per batch, medians of {args.rounds} rounds",
                ["layout", "backend", "set pages/s", "set GB/s", "get pages/s", "get GB/s", "set x file",
                 "get x file"], rows)
    path = write_json("sglang.json", {
        "config": {"pages_per_batch": PAGES, "rounds": args.rounds, "layers": args.layers, "heads": args.heads,
                   "head_dim": args.head_dim, "page": args.page, "dtype": "bfloat16", "memory": args.memory,
                   "torch_threads": args.threads, "dir": str(root.parent)},
        "layouts": results,
    })
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
