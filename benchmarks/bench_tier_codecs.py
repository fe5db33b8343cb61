"""Effective disk- and peer-tier throughput with each lossless codec (issue 8), side by side in one run.

Run: .venv/bin/python benchmarks/bench_tier_codecs.py [--tokens 4096] [--repeats 3] [--tiers disk,peer]

Per tier and codec: a write-through store of one prompt's KV (encode + write),
then a fresh engine's lookup + load of it (read + verify + decode + copy). The
disk tier reads with the page cache dropped; the peer tier is a ``kvengine
serve`` process (memory store, ZeroMQ) on loopback, so its wire costs CPU on
the same two cores. GB/s are of *raw* KV bytes, so a codec that compresses
well can beat raw where the disk or the network is the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import drop_caches, print_header, print_table, write_json

from kvengine import ChunkLayout, KVCategory, KVEngine, Namespace, TensorSpec

CHUNK = 256
CODECS = ["raw", "lz4-bitshuffle", "zstd-byteshuffle"]


def kv_like(tokens: int) -> torch.Tensor:
    """bf16 KV with per-channel log-normal scales and a few outlier channels (see shared notes)."""
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(8, 128, generator=g) * 0.5)
    scale[:, :4] *= 20
    return (torch.randn(32, 2, tokens, 8, 128, generator=g) * scale).to(torch.bfloat16)


def run_disk(codec: str, kv: torch.Tensor, toks: torch.Tensor, root: str, layout: ChunkLayout,
             namespace: Namespace) -> tuple[float, float, int]:
    path = tempfile.mkdtemp(dir=root)
    cfg = {"disk": {"path": path, "codec": codec, "capacity_bytes": "16GiB"}}
    store, load = store_then_load(cfg, kv, toks, layout, namespace, before_load=lambda: drop_caches([]))
    disk_bytes = sum(f.stat().st_size for f in Path(path).glob("*.kvc"))  # the records, not the notes beside them
    shutil.rmtree(path)
    return store, load, disk_bytes


def run_peer(codec: str, kv: torch.Tensor, toks: torch.Tensor, address: str, layout: ChunkLayout,
             namespace: Namespace) -> tuple[float, float, int]:
    cfg = {"peers": {"peers": [address], "replicas": 1, "codec": codec, "request_timeout": 30,
                     "read_deadline": 60, "write_timeout": 60, "max_inflight_write_bytes": "2GiB"}}
    sent: list[float] = []
    store, load = store_then_load(cfg, kv, toks, layout, namespace, sent=sent)
    return store, load, int(sent[0])


def store_then_load(tier: dict, kv: torch.Tensor, toks: torch.Tensor, layout: ChunkLayout, namespace: Namespace, *,
                    before_load=None, sent: list[float] | None = None) -> tuple[float, float]:
    """Seconds of a write-through store, then of a fresh engine's lookup + load (checked exact)."""
    cfg = {"chunk_size": CHUNK, "write_mode": "write_through",
           "memory": {"capacity_bytes": layout.nbytes() * (len(toks) // CHUNK) + (256 << 20)}, **tier}
    with KVEngine(cfg) as eng:
        b = eng.bind(namespace, layout)
        t0 = time.perf_counter()
        eng.store(b, toks, lambda i, s, e: [kv[:, :, s:e]])
        store = time.perf_counter() - t0
        if sent is not None:
            sent.append(sum(eng.metrics.value("kvengine_stored_bytes_total", tier=t.name) for t in eng._core.transports))
    if before_load is not None:
        before_load()
    out = torch.empty_like(kv)
    with KVEngine(cfg) as eng:
        b = eng.bind(namespace, layout)
        t0 = time.perf_counter()
        res = eng.lookup(b, "r", toks)
        result = eng.load(res, lambda v: out[:, :, v.token_range[0]:v.token_range[1]].copy_(v.tensors[0]))
        load = time.perf_counter() - t0
    assert result.loaded_tokens == len(toks) and torch.equal(out, kv), tier
    return store, load


@contextmanager
def peer_server(capacity: str) -> Iterator[str]:
    """A ``kvengine serve`` process on 127.0.0.2 (memory store); yields its address."""
    proc = subprocess.Popen([sys.executable, "-m", "kvengine.cli", "serve", "--bind", "127.0.0.2:0",
                             "--capacity", capacity], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "kvengine serve: zmq on HOST:PORT, store ..."
        yield line.split(" on ")[1].split(",")[0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/work")
    ap.add_argument("--tiers", default="disk,peer")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print_header()
    layout = ChunkLayout(CHUNK, (TensorSpec(name="kv", group=0, category=KVCategory.FULL_ATTENTION,
                                            dtype=torch.bfloat16, shape=(32, 2, CHUNK, 8, 128), token_dim=2),))
    kv = kv_like(args.tokens)
    toks = torch.randint(0, 150_000, (args.tokens,))
    gb = kv.numel() * 2 / 1e9
    tiers = args.tiers.split(",")
    results: dict[str, dict] = {"gb": gb}
    with peer_server(f"{int(3 * gb * 1e9)}B") as address:
        runners = {"disk": lambda c, ns: run_disk(c, kv, toks, args.dir, layout, ns),
                   "peer": lambda c, ns: run_peer(c, kv, toks, address, layout, ns)}
        samples = {(t, c): [] for t in tiers for c in CODECS}
        for r in range(args.repeats):  # interleave tiers and codecs in every round
            for tier in tiers:
                for codec in CODECS:
                    # A namespace per run: the peer keeps earlier runs' records.
                    namespace = Namespace(model=f"bench-{tier}-{codec}-{r}")
                    samples[tier, codec].append(runners[tier](codec, namespace))
    for tier in tiers:
        raw_store = statistics.median(s[0] for s in samples[tier, "raw"])
        raw_load = statistics.median(s[1] for s in samples[tier, "raw"])
        rows, data = [], {}
        for codec in CODECS:
            store = statistics.median(s[0] for s in samples[tier, codec])
            load = statistics.median(s[1] for s in samples[tier, codec])
            ratio = gb * 1e9 / samples[tier, codec][0][2]
            rows.append([codec, ratio, gb / store, gb / load, raw_store / store, raw_load / load])
            data[codec] = {"ratio": ratio, "store_gbps": gb / store, "load_gbps": gb / load,
                           "store_vs_raw": raw_store / store, "load_vs_raw": raw_load / load}
        results[tier] = data
        print_table(f"{tier} tier with compression, {gb:.2f} GB of bf16 KV, write-through store + cold load, medians",
                    ["codec", "ratio", "store GB/s", "load GB/s", "store vs raw", "load vs raw"], rows)
    results["machine"] = {"load_average": os.getloadavg()[0]}
    print(f"\nwrote {write_json('tier_codecs.json', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
