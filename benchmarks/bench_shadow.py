"""What shadow verification costs: throughput of a generate loop at 0% and 1% (and 10%) sampled hits.

    .venv/bin/python benchmarks/bench_shadow.py [--requests 200] [--rounds 3] [--threads 2]

A small random Llama (hidden 256, 4 layers, fp32) on the HF integration with a memory tier; every
request shares a 1024-token prefix (4 chunks of 256) and adds 64 tokens of its own, 4 new tokens
each. Per arm (``shadow.fraction`` 0, 0.01, 0.1; ``first_hits`` 0) the same request list runs on a
fresh engine; arms are interleaved per round and the median requests/s and TTFT are reported with
their ratio to the 0% arm of the same round. A shadowed request prefills its whole prompt instead
of loading the prefix and then compares the chunks, so the expected cost is about
``fraction x (full prefill - hit prefill)``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_header, print_table, write_json

from kvengine import KVEngine
from kvengine.integrations.hf import attach

PREFIX, OWN, NEW, CHUNK = 1024, 64, 4, 256
FRACTIONS = (0.0, 0.01, 0.1)


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=32, vocab_size=4096, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def run_arm(model, prompts: list[torch.Tensor], fraction: float) -> dict[str, float]:
    config = {"chunk_size": CHUNK, "memory": {"capacity_bytes": "512MiB"}, "shadow": {"fraction": fraction, "seed": 1}}
    with KVEngine(config) as engine:
        am = attach(model, engine)
        am.generate(prompts[0], max_new_tokens=1)  # the shared prefix is cached
        ttfts, shadowed = [], 0
        t0 = time.perf_counter()
        for ids in prompts:
            out = am.generate(ids, max_new_tokens=NEW, eos_token_id=None, store=False)
            ttfts.append(out.ttft_s)
            shadowed += out.shadow is not None
        wall = time.perf_counter() - t0
        mismatches = engine.metrics.value("kvengine_provenance_checks_total", check="shadow", outcome="mismatch")
    return {"req_per_s": len(prompts) / wall, "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_mean_ms": 1e3 * statistics.fmean(ttfts), "shadowed": shadowed, "mismatches": mismatches}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print_header()
    model = build_model()
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(4, 4096, (PREFIX,), generator=g)
    prompts = [torch.cat([prefix, torch.randint(4, 4096, (OWN,), generator=g)]) for _ in range(args.requests)]
    rounds: dict[float, list[dict[str, float]]] = {f: [] for f in FRACTIONS}
    for r in range(args.rounds):
        order = FRACTIONS if r % 2 == 0 else tuple(reversed(FRACTIONS))
        for fraction in order:
            rounds[fraction].append(run_arm(model, prompts, fraction))
    base = [x["req_per_s"] for x in rounds[0.0]]
    rows, summary = [], {}
    for fraction in FRACTIONS:
        xs = rounds[fraction]
        ratio = statistics.median(x["req_per_s"] / b for x, b in zip(xs, base))
        entry = {"req_per_s": statistics.median(x["req_per_s"] for x in xs),
                 "ttft_p50_ms": statistics.median(x["ttft_p50_ms"] for x in xs),
                 "ttft_mean_ms": statistics.median(x["ttft_mean_ms"] for x in xs),
                 "shadowed_per_round": statistics.median(x["shadowed"] for x in xs),
                 "mismatches": sum(x["mismatches"] for x in xs), "throughput_vs_0": ratio}
        summary[str(fraction)] = entry
        rows.append([f"{fraction:.0%}", entry["req_per_s"], entry["ttft_p50_ms"], entry["ttft_mean_ms"],
                     entry["shadowed_per_round"], ratio])
    print_table(f"shadow verification overhead, {args.requests} requests sharing {PREFIX} tokens, "
                f"median of {args.rounds} interleaved rounds",
                ["sampled", "req/s", "TTFT p50 ms", "TTFT mean ms", "shadowed", "throughput vs 0%"], rows)
    path = write_json("shadow.json", {"requests": args.requests, "rounds": args.rounds, "prefix": PREFIX,
                                      "own": OWN, "new_tokens": NEW, "arms": summary})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
