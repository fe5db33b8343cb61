"""Core benchmarks: hashing, L1 store/retrieve bandwidth vs raw torch copy, control-path overhead.

Run: .venv/bin/python benchmarks/bench_core.py [--tokens 32768] [--repeats 5]

Everything is measured side by side in one run; figures are medians and the
headline numbers are ratios (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _util import median_time, print_header, print_table, write_json

from kvengine import ChunkLayout, KVCategory, KVEngine, Namespace, TensorSpec
from kvengine.chunks.hashing import prefix_hashes
from kvengine.core.copies import copy_all

CHUNK = 256


def bench_hashing(tokens: int, repeats: int) -> list[list[object]]:
    ids = torch.randint(0, 150_000, (tokens,))
    as_list = ids.tolist()
    seed = Namespace(model="bench").digest()
    rows = []
    for name, value in [("list[int]", as_list), ("torch.Tensor", ids), ("numpy int64", ids.numpy())]:
        t = median_time(lambda value=value: prefix_hashes(value, CHUNK, seed), max(repeats * 20, 50))
        rows.append([f"hashing ({name})", tokens / t / 1e6, "M tok/s", "target >= 100"])
    return rows


def stacked_layout(layers: int, heads: int, dim: int) -> ChunkLayout:
    """All layers of a chunk in one tensor [L, 2, chunk, H, D] (per-layer access: index dim 0)."""
    return ChunkLayout(CHUNK, (TensorSpec(name="kv", group=0, category=KVCategory.FULL_ATTENTION,
                                          dtype=torch.bfloat16, shape=(layers, 2, CHUNK, heads, dim),
                                          token_dim=2),))


def per_layer_layout(layers: int, heads: int, dim: int) -> ChunkLayout:
    return ChunkLayout(CHUNK, tuple(
        TensorSpec(name=f"layer{i}", group=0, category=KVCategory.FULL_ATTENTION, dtype=torch.bfloat16,
                   shape=(2, CHUNK, heads, dim), token_dim=1) for i in range(layers)))


class L1Case:
    """Store and retrieve one prompt's KV through the engine, and the raw copies to compare with."""

    def __init__(self, tokens: int, layers: int, heads: int, dim: int, per_layer: bool) -> None:
        self.tokens = torch.randint(0, 150_000, (tokens,))
        self.src = torch.randn(layers, 2, tokens, heads, dim).to(torch.bfloat16)
        self.dst = torch.zeros_like(self.src)
        self.layout = (per_layer_layout if per_layer else stacked_layout)(layers, heads, dim)
        self.per_layer = per_layer
        self.nbytes = self.src.numel() * self.src.element_size()
        # One prompt plus slack: each timed store uses fresh keys and evicts the previous prompt.
        capacity = self.layout.nbytes() * (tokens // CHUNK) + (512 << 20)
        self.engine = KVEngine({"chunk_size": CHUNK, "lease_seconds": 600,
                                "memory": {"capacity_bytes": capacity, "prefault": True}}, transports=[])
        self.round = 0
        self.binding = None

    def source(self, i: int, s: int, e: int) -> list[torch.Tensor]:
        if self.per_layer:
            return list(self.src[:, :, s:e].unbind(0))
        return [self.src[:, :, s:e]]

    def sink(self, view) -> None:
        s, e = view.token_range
        if self.per_layer:
            copy_all(self.dst[:, :, s:e].unbind(0), view.tensors)
        else:
            self.dst[:, :, s:e].copy_(view.tensors[0])

    def new_namespace(self) -> None:
        """Fresh keys, so the next store really copies (the older prompt gets evicted)."""
        self.round += 1
        self.binding = self.engine.bind(Namespace(model="bench", cache_salt=str(self.round)), self.layout)

    def store(self) -> None:
        st = self.engine.store(self.binding, self.tokens, self.source)
        assert st.stored_chunks == len(self.tokens) // CHUNK, st

    def store_again(self) -> None:
        st = self.engine.store(self.binding, self.tokens, self.source)
        assert st.stored_chunks == 0

    def retrieve(self) -> None:
        res = self.engine.lookup(self.binding, f"r{self.round}", self.tokens)
        result = self.engine.load(res, self.sink)
        assert result.ok and result.loaded_tokens == len(self.tokens)

    def raw_bulk(self) -> None:
        self.dst.copy_(self.src)

    def raw_chunked(self) -> None:
        for s in range(0, len(self.tokens), CHUNK):
            self.dst[:, :, s : s + CHUNK].copy_(self.src[:, :, s : s + CHUNK])


def bench_l1(tokens: int, repeats: int, per_layer: bool) -> tuple[list[list[object]], dict]:
    """Interleave raw copy, store and retrieve in every round so that machine noise hits all alike."""
    case = L1Case(tokens, 32, 8, 128, per_layer)
    gb = case.nbytes / 1e9
    case.dst.zero_()
    case.new_namespace()
    case.store()  # warm-up: first touch of the pages on every path
    case.retrieve()
    rounds = []
    for _ in range(repeats):
        raw_bulk = median_time(case.raw_bulk, 1)
        raw_chunked = median_time(case.raw_chunked, 1)
        store = median_time(case.store, 1, setup=case.new_namespace)
        retrieve = median_time(case.retrieve, 1)
        rounds.append((raw_bulk, raw_chunked, store, retrieve))
    assert torch.equal(case.dst, case.src)
    again = median_time(case.store_again, repeats)
    case.engine.close()
    med = [statistics.median(r[i] for r in rounds) for i in range(4)]
    store_ratio = statistics.median(r[0] / r[2] for r in rounds)
    retrieve_ratio = statistics.median(r[0] / r[3] for r in rounds)
    raw_bulk, raw_chunked, store, retrieve = med
    label = "per-layer tensors" if per_layer else "stacked [L,2,T,H,D]"
    rows = [
        [f"raw torch copy, one call ({gb:.2f} GB)", gb / raw_bulk, "GB/s", "1.00"],
        ["raw torch copy, per 256-token chunk", gb / raw_chunked,
         "GB/s", f"{statistics.median(r[0] / r[1] for r in rounds):.2f}"],
        [f"L1 store, {label}", gb / store, "GB/s", f"{store_ratio:.2f} (target >= 0.8)"],
        [f"L1 retrieve (lookup+load), {label}", gb / retrieve, "GB/s", f"{retrieve_ratio:.2f} (target >= 0.8)"],
        ["store of an already cached prompt", again * 1e3, "ms", "-"],
    ]
    data = {"layout": label, "gb": gb, "raw_bulk_gbps": gb / raw_bulk, "raw_chunked_gbps": gb / raw_chunked,
            "store_gbps": gb / store, "retrieve_gbps": gb / retrieve,
            "store_ratio": store_ratio, "retrieve_ratio": retrieve_ratio, "store_again_ms": again * 1e3,
            "rounds_seconds": rounds}
    return rows, data


def bench_control(tokens: int, repeats: int) -> tuple[list[list[object]], dict]:
    """Per-chunk cost of everything but the data copy: a 1-element chunk makes the copy ~free."""
    layout = ChunkLayout(CHUNK, (TensorSpec(name="x", group=0, category=KVCategory.OPAQUE,
                                            dtype=torch.uint8, shape=(1,), token_dim=None),))
    ids = torch.randint(0, 150_000, (tokens,))
    one = [torch.zeros(1, dtype=torch.uint8)]
    n = tokens // CHUNK
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "64MiB"}}, transports=[]) as eng:
        state = {"round": 0}

        def fresh():
            state["round"] += 1
            state["b"] = eng.bind(Namespace(model="ctl", cache_salt=str(state["round"])), layout)

        store = median_time(lambda: eng.store(state["b"], ids, lambda i, s, e: one), repeats * 4, setup=fresh)

        def retrieve():
            state["round"] += 1
            res = eng.lookup(state["b"], f"r{state['round']}", ids)
            assert eng.load(res, lambda v: None).loaded_tokens == tokens

        retrieve_t = median_time(retrieve, repeats * 4)
        lookup_t = median_time(lambda: eng.release(eng.lookup(state["b"], "x", ids)), repeats * 4)
    rows = [
        ["control path: store, per chunk", store / n * 1e6, "us", "target <= 20"],
        ["control path: lookup+load, per chunk", retrieve_t / n * 1e6, "us", "target <= 20"],
        [f"lookup+release of a {tokens}-token hit", lookup_t * 1e3, "ms", "-"],
    ]
    return rows, {"store_us_per_chunk": store / n * 1e6, "retrieve_us_per_chunk": retrieve_t / n * 1e6,
                  "lookup_release_ms": lookup_t * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-per-layer", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print_header()
    rows = bench_hashing(args.tokens, args.repeats)
    ctl_rows, ctl = bench_control(args.tokens, args.repeats)
    l1_rows, l1 = bench_l1(args.tokens, args.repeats, per_layer=False)
    rows += ctl_rows + l1_rows
    results = {"threads": args.threads, "tokens": args.tokens,
               "hashing_mtoks": {r[0]: r[1] for r in rows[:3]}, "control": ctl, "l1_stacked": l1}
    if not args.skip_per_layer:
        pl_rows, pl = bench_l1(args.tokens, args.repeats, per_layer=True)
        rows += pl_rows[2:4]
        results["l1_per_layer"] = pl
    print_table(f"kvengine core, {args.tokens}-token prompt, 32 layers x 8 KV heads x 128, bf16, "
                f"chunk {CHUNK}, {args.threads} threads (medians)", ["what", "value", "unit", "ratio / target"], rows)
    print(f"\nwrote {write_json('core.json', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
