"""Effective disk-tier throughput with each lossless codec (issue 8), side by side in one run.

Run: .venv/bin/python benchmarks/bench_tier_codecs.py [--tokens 4096] [--repeats 3]

Per codec: a write-through store of one prompt's KV (encode + persist), then a
fresh engine's lookup + load of it from disk with the page cache dropped
(read + verify + decode + copy). GB/s are of *raw* KV bytes, so a codec that
compresses well can beat raw on a disk-bound machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table, write_json  # noqa: E402

from kvengine import ChunkLayout, KVCategory, KVEngine, Namespace, TensorSpec  # noqa: E402

CHUNK = 256
CODECS = ["raw", "lz4-bitshuffle", "zstd-byteshuffle"]


def kv_like(tokens: int) -> torch.Tensor:
    """bf16 KV with per-channel log-normal scales and a few outlier channels (see shared notes)."""
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(8, 128, generator=g) * 0.5)
    scale[:, :4] *= 20
    return (torch.randn(32, 2, tokens, 8, 128, generator=g) * scale).to(torch.bfloat16)


def drop_caches() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def run(codec: str, kv: torch.Tensor, toks: torch.Tensor, root: str, layout: ChunkLayout) -> tuple[float, float, int]:
    path = tempfile.mkdtemp(dir=root)
    cfg = {"chunk_size": CHUNK, "write_mode": "write_through",
           "memory": {"capacity_bytes": layout.nbytes() * (len(toks) // CHUNK) + (256 << 20)},
           "disk": {"path": path, "codec": codec, "capacity_bytes": "16GiB"}}
    with KVEngine(cfg) as eng:
        b = eng.bind(Namespace(model="bench"), layout)
        t0 = time.perf_counter()
        eng.store(b, toks, lambda i, s, e: [kv[:, :, s:e]])
        store = time.perf_counter() - t0
    disk_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    drop_caches()
    out = torch.empty_like(kv)
    with KVEngine(cfg) as eng:
        b = eng.bind(Namespace(model="bench"), layout)
        t0 = time.perf_counter()
        res = eng.lookup(b, "r", toks)
        result = eng.load(res, lambda v: out[:, :, v.token_range[0]:v.token_range[1]].copy_(v.tensors[0]))
        load = time.perf_counter() - t0
    assert result.loaded_tokens == len(toks) and torch.equal(out, kv), codec
    for f in os.listdir(path):
        os.unlink(os.path.join(path, f))
    os.rmdir(path)
    return store, load, disk_bytes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/work")
    args = ap.parse_args()
    torch.set_num_threads(2)
    layout = ChunkLayout(CHUNK, (TensorSpec(name="kv", group=0, category=KVCategory.FULL_ATTENTION,
                                            dtype=torch.bfloat16, shape=(32, 2, CHUNK, 8, 128), token_dim=2),))
    kv = kv_like(args.tokens)
    toks = torch.randint(0, 150_000, (args.tokens,))
    gb = kv.numel() * 2 / 1e9
    samples: dict[str, list[tuple[float, float, int]]] = {c: [] for c in CODECS}
    for _ in range(args.repeats):  # interleave codecs in every round
        for codec in CODECS:
            samples[codec].append(run(codec, kv, toks, args.dir, layout))
    rows, data = [], {}
    raw_store = statistics.median(s[0] for s in samples["raw"])
    raw_load = statistics.median(s[1] for s in samples["raw"])
    for codec in CODECS:
        store = statistics.median(s[0] for s in samples[codec])
        load = statistics.median(s[1] for s in samples[codec])
        ratio = gb * 1e9 / samples[codec][0][2]
        rows.append([codec, ratio, gb / store, gb / load, raw_store / store, raw_load / load])
        data[codec] = {"ratio": ratio, "store_gbps": gb / store, "load_gbps": gb / load}
    print_table(f"disk tier with compression, {gb:.2f} GB of bf16 KV, write-through + cold read, medians",
                ["codec", "ratio", "store GB/s", "load GB/s", "store vs raw", "load vs raw"], rows)
    print(f"\nwrote {write_json('tier_codecs.json', {'gb': gb, 'codecs': data})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
