"""Memory cost of cached chunks beyond the arena: the engine's own index, per chunk.

The memory tier's arena is configured up front (and prefaulted here, so it is
resident from the start); what grows with the number of cached chunks is the
rest: the index that maps chunk keys to slots, eviction order, per-chunk
metadata. This stores tiny chunks (16 tokens, 64 bytes of KV each) up to
``--chunks`` and reports the process's resident memory beyond the arena at
checkpoints, and the slope: bytes per cached chunk.

    .venv/bin/python benchmarks/bench_memory.py --chunks 1000000
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
from _util import print_header, print_table, write_json

from kvengine import ChunkLayout, KVCategory, KVEngine, Namespace, TensorSpec

CHUNK = 16
#: chunks per store call (one prefix each)
BATCH = 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=1_000_000)
    args = ap.parse_args()
    print_header()
    layout = ChunkLayout(CHUNK, (TensorSpec(name="kv", group=0, category=KVCategory.FULL_ATTENTION,
                                            dtype=torch.uint8, shape=(CHUNK, 4)),))
    arena = args.chunks * 160  # a 64-byte payload takes a 128-byte slot (record header); headroom: nothing evicted
    checkpoints = sorted({args.chunks // 8, args.chunks // 4, args.chunks // 2, args.chunks})
    config = {"chunk_size": CHUNK, "memory": {"capacity_bytes": arena, "prefault": True}}
    rows, points = [], []
    with KVEngine(config, transports=[]) as engine:
        binding = engine.bind(Namespace(model="bench-memory"), layout)
        payload = [torch.zeros((CHUNK, 4), dtype=torch.uint8)]
        gc.collect()
        base = rss_bytes()
        stored, prefix, t0 = 0, 0, time.perf_counter()
        for target in checkpoints:
            while stored < target:
                n = min(BATCH, target - stored)
                tokens = [prefix, *range(1, n * CHUNK)]  # a distinct first token: a new prefix per call
                prefix += 1
                result = engine.store(binding, tokens, lambda i, s, e: payload)
                stored += result.stored_chunks
            gc.collect()
            grown = rss_bytes() - base
            points.append((stored, grown))
            rows.append([f"{stored:,}", grown / 2**20, grown / stored, time.perf_counter() - t0])
        evicted = engine.metrics.value("kvengine_evictions_total")
    slope = (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])
    rows.append(["slope (first to last checkpoint)", "", slope, ""])
    print_table(f"resident memory beyond the {arena / 2**20:.0f} MiB prefaulted arena, chunks of {CHUNK} tokens "
                f"(64 B of KV), {evicted:.0f} evicted", ["cached chunks", "MiB beyond arena", "bytes / chunk",
                                                        "s elapsed"], rows)
    write_json("memory.json", {"points": points, "bytes_per_chunk_slope": slope, "evicted": evicted})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
