"""The host cache service against the in-process memory tier, on the same bytes, side by side.

For each mode (``in-process``: the engine's own arena; ``service``: ``kvengine
host`` in another process, the engine attached through ``memory.service``) it
measures, median of ``--repeats``:

* store throughput: ``--chunks`` new chunks of a Llama-like layout (``--layers``
  layers of K and V, 8 heads of 128, bf16) copied in, GB/s;
* load throughput: a lookup of all of them and their copy out into the
  engine's tensors, GB/s;
* control path: one lookup of a resident one-chunk prompt, and its release, µs
  each, both modes' engines alive at once and asked in turn, 5,000 rounds (the
  service's difference is the control path's cost per call: a lookup is one
  round trip, a release one frame sent);
* bytes held when two engines store the same prompts (two arenas in-process,
  one shared arena through the service);
* cold load from disk: the same chunks dropped from memory and loaded again
  (lookup, promotion from the disk tier, copy out), GB/s, median of
  ``--repeats``: ``in-process`` with a disk tier of the engine's own,
  ``service`` from a second service that owns a disk tier (``kvengine host
  --config``), the engine configuring none (the files in the page cache in
  both modes).

    .venv/bin/python benchmarks/bench_host.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _util import median_time, print_header, print_table, write_json

from kvengine import ChunkLayout, KVCategory, KVEngine, Namespace, TensorSpec
from kvengine.chunks.hashing import prefix_hashes
from kvengine.chunks.keys import ChunkKey

CHUNK = 256


def layout_of(layers: int) -> ChunkLayout:
    return ChunkLayout(CHUNK, tuple(
        TensorSpec(name=f"layer{i}", group=0, category=KVCategory.FULL_ATTENTION, dtype=torch.bfloat16,
                   shape=(2, 8, CHUNK, 128), token_dim=2) for i in range(layers)))


def measure(config: dict[str, Any], layout: ChunkLayout, chunks: int, repeats: int) -> dict[str, float]:
    tokens = chunks * CHUNK
    kv = [torch.randn(2, 8, tokens, 128).to(torch.bfloat16) for _ in layout.tensors]
    out = [torch.empty_like(t) for t in kv]
    nbytes = chunks * layout.nbytes()

    def source(_i: int, start: int, end: int) -> list[torch.Tensor]:
        return [t[:, :, start:end] for t in kv]

    def sink(view: Any) -> None:
        s, e = view.token_range
        for dst, src in zip(out, view.tensors):
            dst[:, :, s:e].copy_(src)

    with KVEngine(config) as engine:
        binding = engine.bind(Namespace(model="bench-host"), layout)
        prompts = iter(range(10**6))
        store_s = median_time(lambda: engine.store(binding, [next(prompts), *range(1, tokens)], source), repeats)
        stored = [next(prompts), *range(1, tokens)]
        engine.store(binding, stored, source)
        ids = iter(range(10**6))

        def load() -> None:
            res = engine.lookup(binding, f"l{next(ids)}", stored)
            assert engine.load(res, sink).loaded_tokens == tokens

        load_s = median_time(load, repeats)
        assert all(torch.equal(o, k) for o, k in zip(out, kv))
    return {"store_gbps": nbytes / store_s / 1e9, "load_gbps": nbytes / load_s / 1e9}


def control_latencies(configs: dict[str, dict[str, Any]], layout: ChunkLayout,
                      rounds: int) -> dict[str, tuple[float, float]]:
    """Median µs of a lookup of a resident one-chunk prompt and of its release, per mode, the modes'
    engines alive at once and asked in turn (so drifting machine load falls on all of them alike)."""
    engines = {mode: KVEngine(config) for mode, config in configs.items()}
    try:
        asks = []
        for engine in engines.values():
            binding = engine.bind(Namespace(model="bench-host-lookup"), layout)
            engine.store(binding, list(range(CHUNK)), lambda _i, s, e: [torch.zeros(2, 8, e - s, 128,
                                                                                    dtype=torch.bfloat16)
                                                                        for _ in layout.tensors])
            asks.append(binding)
        lookups: dict[str, list[float]] = {mode: [] for mode in engines}
        releases: dict[str, list[float]] = {mode: [] for mode in engines}
        prompt = list(range(CHUNK))
        for _ in range(rounds):
            for (mode, engine), binding in zip(engines.items(), asks):
                t0 = time.perf_counter()
                res = engine.lookup(binding, "short", prompt)
                t1 = time.perf_counter()
                engine.release(res)
                lookups[mode].append(t1 - t0)
                releases[mode].append(time.perf_counter() - t1)
        return {mode: (statistics.median(lookups[mode]) * 1e6, statistics.median(releases[mode]) * 1e6)
                for mode in engines}
    finally:
        for engine in engines.values():
            engine.close()


def cold_from_disk(config: dict[str, Any], layout: ChunkLayout, chunks: int, repeats: int,
                   disk: Path) -> float:
    """GB/s of a lookup and load of ``chunks`` stored chunks that memory no longer holds, from ``disk``."""
    tokens = chunks * CHUNK
    kv = [torch.randn(2, 8, tokens, 128).to(torch.bfloat16) for _ in layout.tensors]
    out = [torch.empty_like(t) for t in kv]
    with KVEngine(config) as engine:
        binding = engine.bind(Namespace(model="bench-host-disk"), layout)
        prompt = list(range(tokens))
        engine.store(binding, prompt, lambda _i, s, e: [t[:, :, s:e] for t in kv])
        engine.flush()
        deadline = time.monotonic() + 60
        while len(list(disk.rglob("*.kvc"))) < chunks and time.monotonic() < deadline:  # the service's: behind
            time.sleep(0.05)
        keys = [ChunkKey(binding.digest, h) for h in prefix_hashes(prompt, CHUNK, binding.digest)]
        ids = iter(range(10**6))

        def sink(view: Any) -> None:
            s, e = view.token_range
            for dst, src in zip(out, view.tensors):
                dst[:, :, s:e].copy_(src)

        def cold_load() -> None:
            res = engine.lookup(binding, f"c{next(ids)}", prompt)
            assert engine.load(res, sink).loaded_tokens == tokens

        times = []
        for _ in range(repeats):
            for key in keys:
                engine._core.memory.discard(key)
            t0 = time.perf_counter()
            cold_load()
            times.append(time.perf_counter() - t0)
        assert all(torch.equal(o, k) for o, k in zip(out, kv))
    return chunks * layout.nbytes() / statistics.median(times) / 1e9


def held_by_two(config: dict[str, Any], layout: ChunkLayout, chunks: int) -> int:
    """Bytes held after two engines each store the same prompt."""
    kv = [torch.zeros(2, 8, chunks * CHUNK, 128, dtype=torch.bfloat16) for _ in layout.tensors]
    with KVEngine(config) as a, KVEngine(config) as b:
        shared = "service" in config["memory"]
        before = a._core.memory.used_bytes + (0 if shared else b._core.memory.used_bytes)
        for engine in (a, b):
            binding = engine.bind(Namespace(model="bench-host-two"), layout)
            engine.store(binding, list(range(chunks * CHUNK)), lambda _i, s, e: [t[:, :, s:e] for t in kv])
        return a._core.memory.used_bytes + (0 if shared else b._core.memory.used_bytes) - before


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefault", action="store_true", help="both arenas resident from the start")
    ap.add_argument("--rounds", type=int, default=5000, help="lookups per mode")
    ap.add_argument("--out", default=None, help="results file (default results/host[_prefault].json)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print_header()
    layout = layout_of(args.layers)
    capacity = (args.repeats + 3) * args.chunks * layout.nbytes()  # nothing evicted
    own = {"chunk_size": CHUNK, "memory": {"capacity_bytes": capacity, "prefault": args.prefault}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "host.sock"
        host = subprocess.Popen([sys.executable, "-m", "kvengine", "host", "--socket", str(path),
                                 "--capacity", str(capacity), *(["--prefault"] if args.prefault else [])], stdout=subprocess.PIPE, text=True)
        (Path(tmp) / "host.yaml").write_text(f"disk:\n  path: {Path(tmp) / 'service_disk'}\n  capacity_bytes: "
                                             f"{4 * args.chunks * layout.nbytes()}\n")
        disk_path = Path(tmp) / "host_disk.sock"
        disk_host = subprocess.Popen([sys.executable, "-m", "kvengine", "host", "--socket", str(disk_path),
                                      "--capacity", str(capacity), "--config", str(Path(tmp) / "host.yaml"),
                                      *(["--prefault"] if args.prefault else [])], stdout=subprocess.PIPE, text=True)
        try:
            assert host.stdout is not None and host.stdout.readline().startswith("kvengine host:")
            assert disk_host.stdout is not None and disk_host.stdout.readline().startswith("kvengine host:")
            service = {"chunk_size": CHUNK, "memory": {"service": str(path)}}
            own_disk = {**own, "disk": {"path": str(Path(tmp) / "own_disk"),
                                        "capacity_bytes": 4 * args.chunks * layout.nbytes()}}
            cold = {"in-process": cold_from_disk(own_disk, layout, args.chunks, args.repeats, Path(tmp) / "own_disk"),
                    "service": cold_from_disk({"chunk_size": CHUNK, "memory": {"service": str(disk_path)}}, layout,
                                              args.chunks, args.repeats, Path(tmp) / "service_disk")}
            results = {"in-process": measure(own, layout, args.chunks, args.repeats),
                       "service": measure(service, layout, args.chunks, args.repeats)}
            held = {"in-process": held_by_two(own, layout, args.chunks),
                    "service": held_by_two(service, layout, args.chunks)}
            control = control_latencies({"in-process": own, "service": service}, layout, args.rounds)
            for mode, (lookup_us, release_us) in control.items():
                results[mode].update(lookup_us=lookup_us, release_us=release_us)
        finally:
            for proc in (host, disk_host):
                proc.terminate()
                proc.wait()
    for mode, gbps in cold.items():
        results[mode]["cold_disk_gbps"] = gbps
    a, s = results["in-process"], results["service"]
    ratios = {"store": s["store_gbps"] / a["store_gbps"], "load": s["load_gbps"] / a["load_gbps"],
              "lookup_overhead_us": s["lookup_us"] - a["lookup_us"],
              "release_overhead_us": s["release_us"] - a["release_us"], "held": held["service"] / held["in-process"],
              "cold_disk": s["cold_disk_gbps"] / a["cold_disk_gbps"]}
    mib = args.chunks * layout.nbytes() / 2**20
    print_table(f"{args.chunks} chunks of {CHUNK} tokens, {layout.nbytes() / 2**20:.0f} MiB each ({mib:.0f} MiB), "
                f"median of {args.repeats}, arenas {'prefaulted' if args.prefault else 'faulted in by first copies'}", ["mode", "store GB/s", "load GB/s", "lookup µs", "release µs", "two engines hold MiB",
                 "cold load from disk GB/s"],
                [[m, r["store_gbps"], r["load_gbps"], r["lookup_us"], r["release_us"], held[m] / 2**20,
                  r["cold_disk_gbps"]] for m, r in results.items()])
    print(f"\nservice / in-process: store {ratios['store']:.2f}x, load {ratios['load']:.2f}x, lookup "
          f"+{ratios['lookup_overhead_us']:.0f} µs, release +{ratios['release_overhead_us']:.0f} µs, two engines hold {ratios['held']:.2f}x the bytes, "
          f"cold load from disk {ratios['cold_disk']:.2f}x")
    write_json(args.out or f"host{'_prefault' if args.prefault else ''}.json", {"chunks": args.chunks, "prefault": args.prefault, "chunk_bytes": layout.nbytes(), "repeats": args.repeats,
                             "results": results, "held_bytes": held, "ratios": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
