"""TTFT and throughput of vLLM (CPU) with the kvengine connector, without it, and with vLLM's prefix cache.

Model: a random ~80M-parameter Llama (hidden 768, 12 layers, 12 query heads,
4 KV heads of 64, MLP 2048, vocab 4096), bf16. Workload: 4096-token prompts
sharing a 3584-token prefix (14 chunks of 256) with different 512-token tails.

Every configuration runs in its own fresh engine process, one after the
other in this run, with ``VLLM_CPU_OMP_THREADS_BIND=0-1
VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (both cores for the forward):

* ``seed``      -- a connector engine stores prefix + tail A to a disk tier, then exits;
* ``connector`` -- a *fresh* connector engine on that disk tier (vLLM's prefix
  cache off): the first request's 3584-token hit comes from disk (promoted to
  memory), later ones from memory;
* ``paired``    -- a fresh connector engine with vLLM's prefix cache *on*: the
  first request hits the connector (disk), the next ones hit vLLM's own cache
  (the loaded blocks are in it now). Both kinds of hit are measured back to
  back in one process, so machine load affects them alike: this is the
  headline ratio on a shared, noisy machine;
* ``cold``      -- no connector, no prefix cache: every prompt is prefilled in full;
* ``prefix``    -- no connector, vLLM's own in-memory prefix cache, warmed with prefix + tail A.

In each process: one unrelated warm-up request, then ``--repeats`` TTFT
samples (prefix + tail B_i, ``max_tokens=1``; ``--cold-repeats`` for cold),
then a throughput batch (``--batch`` prompts prefix + tail C_i, ``--decode``
tokens each). The target is: connector hit from a fresh engine <= 1.2x vLLM's
own prefix-cache hit. Results: ``benchmarks/results/vllm.json``.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--repeats 3] [--cold-repeats 1] [--batch 2] [--decode 32]

On CPUs without native bf16 (AVX2 only, like the project machine) vLLM's
bf16 matmuls are slow: a cold 4096-token prefill takes over a minute and the
whole run ~20 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvengine.metrics import scrape

PREFIX, TAIL = 3584, 512
MODEL = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64)
THREAD_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


MODES = ("seed", "connector", "paired", "cold", "prefix")


def prompts(mode: str) -> dict[str, Any]:
    """The shared prefix with tails of this mode's own: connector processes store their prompts' new
    chunks on the shared disk tier, and a later process must not hit another mode's tails."""
    prefix, k = tokens(1, PREFIX), 1000 * (MODES.index(mode) + 1)
    return {"warmup": tokens(k + 2, 1024), "seed": prefix + tokens(3, TAIL),
            "ttft": [prefix + tokens(k + 10 + i, TAIL) for i in range(16)],
            "batch": [prefix + tokens(k + 100 + i, TAIL) for i in range(64)]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ one engine process --
def worker(mode: str, model: str, disk: str, repeats: int, batch: int, decode: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    p = prompts(mode)
    args: dict[str, Any] = dict(model=model, dtype="bfloat16", max_model_len=PREFIX + TAIL + decode + 64,
                                enforce_eager=True, max_num_seqs=max(8, batch), max_num_batched_tokens=8192,
                                enable_prefix_caching=mode in ("prefix", "paired"), seed=0)
    port = free_port()
    if mode in ("seed", "connector", "paired"):
        args["kv_transfer_config"] = {
            "kv_connector": "KVEngineConnector", "kv_connector_module_path": "kvengine.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvengine": {"memory": {"capacity_bytes": "1GiB"},
                                                       "disk": {"path": disk}, "metrics_port": port}}}
    t0 = time.perf_counter()
    llm = LLM(**args)
    out: dict[str, Any] = {"mode": mode, "startup_s": time.perf_counter() - t0}

    def gen(ps: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ps], sp, use_tqdm=False)
        return time.perf_counter() - t, res

    if mode == "seed":
        out["seed_s"], res = gen([p["seed"]], 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait for the write-behind disk tier
            m = scrape(port)
            if m.get('kvengine_stored_chunks_total{tier="local_disk"}', 0) >= m['kvengine_stored_chunks_total{tier="memory"}']:
                break
            time.sleep(0.2)
        out["stored_chunks"] = m['kvengine_stored_chunks_total{tier="local_disk"}']
        return out
    gen([p["warmup"]], 1)
    if mode == "prefix":
        gen([p["seed"]], 1)  # vLLM's own cache now holds the shared prefix
    samples = []
    for i in range(repeats):
        wall, res = gen([p["ttft"][i]], 1)
        samples.append({"ttft_s": wall, "cached_tokens": int(res[0].num_cached_tokens or 0)})
    out["ttft"] = samples
    wall, res = gen(p["batch"][:batch], decode)
    out["batch"] = {"wall_s": wall, "requests": batch, "prompt_tokens": batch * (PREFIX + TAIL),
                    "output_tokens": sum(len(r.outputs[0].token_ids) for r in res),
                    "cached_tokens": sum(int(r.num_cached_tokens or 0) for r in res)}
    out["batch"]["output_tok_per_s"] = out["batch"]["output_tokens"] / wall
    out["batch"]["requests_per_s"] = batch / wall
    if mode in ("connector", "paired"):
        m = scrape(port)
        out["engine"] = {k: v for k, v in m.items() if k.startswith(("kvengine_loaded", "kvengine_hit",
                                                                        "kvengine_load_failed"))}
    return out


# ------------------------------------------------------------ driver --
def run_mode(mode: str, model: str, disk: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, **THREAD_ENV)
    repeats = args.cold_repeats if mode == "cold" else args.repeats
    cmd = [sys.executable, __file__, "--worker", mode, "--model", model, "--disk", disk, "--repeats",
           str(repeats), "--batch", str(args.batch), "--decode", str(args.decode)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{mode} failed (exit {proc.returncode})")
    result = json.loads(lines[-1][len("RESULT "):])
    result["process_wall_s"] = time.perf_counter() - t
    print(f"  {mode}: done in {result['process_wall_s']:.0f} s", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold-repeats", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--worker", choices=MODES)
    ap.add_argument("--model")
    ap.add_argument("--disk")
    args = ap.parse_args()
    if args.worker:
        res = worker(args.worker, args.model, args.disk, args.repeats, args.batch, args.decode)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _util import print_header, write_json

    from kvengine.integrations.vllm.tiny_models import build_model_dir

    print_header()  # the driver's; the workers' threads are set by THREAD_ENV

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = str(build_model_dir(work / "llama80m", "llama", vocab_size=4096, dtype="bfloat16", **MODEL))
    disk = str(work / "disk")
    runs = {mode: run_mode(mode, model, disk, args) for mode in MODES}

    def ttft(mode: str) -> list[float]:
        return [s["ttft_s"] for s in runs[mode]["ttft"]]

    connector_fresh, connector_memory = ttft("connector")[0], statistics.median(ttft("connector")[1:] or [0.0])
    paired_fresh, paired_prefix = ttft("paired")[0], statistics.median(ttft("paired")[1:])
    prefix_hit, cold = statistics.median(ttft("prefix")), statistics.median(ttft("cold"))
    measured = ("connector", "paired", "cold", "prefix")
    summary = {
        "ttft_s": {"connector_fresh_engine_disk_hit": connector_fresh, "connector_memory_hit": connector_memory,
                   "paired_connector_fresh_engine_disk_hit": paired_fresh,
                   "paired_vllm_prefix_cache_hit": paired_prefix,
                   "vllm_prefix_cache_hit": prefix_hit, "no_cache": cold},
        "cached_tokens": {m: [s["cached_tokens"] for s in runs[m]["ttft"]] for m in measured},
        "ratio_paired_connector_fresh_over_prefix_hit": paired_fresh / paired_prefix,
        "ratio_connector_fresh_over_prefix_hit_across_processes": connector_fresh / prefix_hit,
        "ratio_connector_memory_over_prefix_hit_across_processes": connector_memory / prefix_hit,
        "ratio_no_cache_over_prefix_hit": cold / prefix_hit,
        "target": "connector hit from a fresh engine <= 1.2x vLLM's own prefix-cache hit (paired ratio)",
        "target_met": paired_fresh <= 1.2 * paired_prefix,
        "throughput_output_tok_per_s": {m: runs[m]["batch"]["output_tok_per_s"] for m in measured},
        "throughput_requests_per_s": {m: runs[m]["batch"]["requests_per_s"] for m in measured},
    }
    data = {
        "benchmark": "vllm_connector_ttft",
        "model": {"family": "llama", **MODEL, "vocab": 4096, "dtype": "bfloat16", "params_m": 81},
        "workload": {"prompt_tokens": PREFIX + TAIL, "shared_prefix": PREFIX, "chunk_size": "auto",
                     "repeats": args.repeats, "cold_repeats": args.cold_repeats, "batch": args.batch,
                     "decode_tokens": args.decode},
        "env": THREAD_ENV,
        "summary": summary, "runs": runs,
    }
    path = write_json("vllm.json", data)
    print("\nTTFT, 4096-token prompt sharing 3584 tokens")
    print(f"  paired (one process, back to back): connector fresh-engine disk hit {paired_fresh:.3f} s, "
          f"vLLM prefix-cache hit {paired_prefix:.3f} s -> {paired_fresh / paired_prefix:.2f}x")
    rows = [("connector, fresh engine (disk hit)", connector_fresh), ("connector, memory hit", connector_memory),
            ("vLLM prefix cache hit", prefix_hit), ("no cache", cold)]
    for name, v in rows:
        print(f"  {name:36s} {v:7.3f} s  ({v / prefix_hit:4.2f}x prefix-cache hit, separate processes)")
    print("throughput (output tok/s):", {k: round(v, 1) for k, v in summary["throughput_output_tok_per_s"].items()})
    print(f"target met: {summary['target_met']}  -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
