"""Restart to first hit: a vLLM engine started again gets its first hit from the host service's memory,
against one that reads the disk tier (page cache dropped) and one without a cache, side by side.

Model: the random ~80M-parameter Llama of ``bench_vllm.py``, float32 (fast on CPUs without native bf16).
Each engine process is fresh: ``seed-disk`` and ``seed-host`` store a 4096-token prompt (a disk tier, or
``kvengine host``) and exit; then ``restart-disk`` / ``restart-host`` (alternating, ``--repeats`` each)
and ``restart-cold`` start, and each serves one request sharing the 3584-token prefix (``max_tokens=1``).
Reported per run: start-up (``LLM(...)``), the first request's time and cached tokens, and their sum:
restart to first hit. Results: ``benchmarks/results/host_vllm.json``.

    .venv-vllm/bin/python benchmarks/bench_host_vllm.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_vllm import MODEL, PREFIX, TAIL, THREAD_ENV, free_port, tokens

from kvengine.metrics import scrape

CONNECTOR = "kvengine.integrations.vllm.connector"


def worker(mode: str, model: str, disk: str, socket_path: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prefix = tokens(1, PREFIX)
    prompt = prefix + tokens(2 if mode.startswith("seed") else 3 + time.time_ns() % 10**6, TAIL)
    args: dict[str, Any] = dict(model=model, dtype="float32", max_model_len=PREFIX + TAIL + 64, enforce_eager=True,
                                enable_prefix_caching=False, seed=0)
    port = free_port()
    tier = {"disk": {"path": disk}, "memory": {"capacity_bytes": "1GiB"}} if mode.endswith("disk") else \
        {"memory": {"service": socket_path}}
    if not mode.endswith("cold"):
        args["kv_transfer_config"] = {
            "kv_connector": "KVEngineConnector", "kv_connector_module_path": CONNECTOR, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kvengine": {
                **tier, "metrics_port": port}}}
    t0 = time.perf_counter()
    llm = LLM(**args)
    started = time.perf_counter() - t0
    t1 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - t1
    if mode == "seed-disk":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the write-behind disk tier
            m = scrape(port)
            if m.get('kvengine_stored_chunks_total{tier="local_disk"}', 0) >= m['kvengine_stored_chunks_total{tier="memory"}']:
                break
            time.sleep(0.2)
    return {"mode": mode, "startup_s": started, "first_request_s": first, "restart_to_first_s": started + first,
            "cached_tokens": int(out[0].num_cached_tokens or 0)}


def run(mode: str, model: str, disk: str, socket_path: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", mode, "--model", model, "--disk", disk, "--socket", socket_path]
    proc = subprocess.run(cmd, env=dict(os.environ, **THREAD_ENV), capture_output=True, text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{mode} failed (exit {proc.returncode})")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    print(f"  {mode}: start-up {result['startup_s']:.1f} s, first request {result['first_request_s']:.3f} s, "
          f"{result['cached_tokens']} tokens cached", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker")
    ap.add_argument("--model")
    ap.add_argument("--disk")
    ap.add_argument("--socket")
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.model, args.disk, args.socket)), flush=True)
        return 0
    from _util import drop_caches, print_header, write_json

    from kvengine.integrations.vllm.tiny_models import build_model_dir

    print_header()
    work = Path(tempfile.mkdtemp(prefix="bench-host-vllm-"))
    model = str(build_model_dir(work / "llama80m", "llama", vocab_size=4096, dtype="float32", **MODEL))
    disk, socket_path = str(work / "disk"), str(work / "host.sock")
    host = subprocess.Popen([sys.executable, "-m", "kvengine", "host", "--socket", socket_path, "--capacity", "1GiB",
                             "--prefault"], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline().startswith("kvengine host:")
        runs = [run("seed-disk", model, disk, socket_path), run("seed-host", model, disk, socket_path)]
        dropped = ""
        for _ in range(args.repeats):
            dropped = drop_caches([p for p in Path(disk).rglob("*") if p.is_file()])
            runs += [run("restart-disk", model, disk, socket_path), run("restart-host", model, disk, socket_path)]
        runs.append(run("restart-cold", model, disk, socket_path))
    finally:
        host.terminate()
        host.wait()

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    summary = {m: {k: median(m, k) for k in ("startup_s", "first_request_s", "restart_to_first_s")}
               for m in ("restart-disk", "restart-host", "restart-cold")}
    summary["first_request_host_over_disk"] = \
        summary["restart-host"]["first_request_s"] / summary["restart-disk"]["first_request_s"]
    summary["restart_to_first_hit_host_over_disk"] = \
        summary["restart-host"]["restart_to_first_s"] / summary["restart-disk"]["restart_to_first_s"]
    write_json("host_vllm.json", {"workload": {"prompt_tokens": PREFIX + TAIL, "shared_prefix": PREFIX,
                                               "dtype": "float32", "repeats": args.repeats},
                                  "page_cache": dropped, "env": THREAD_ENV, "summary": summary, "runs": runs})
    print(f"\nfirst request after a restart (median of {args.repeats}, page cache dropped by {dropped}):")
    for m in ("restart-disk", "restart-host", "restart-cold"):
        s = summary[m]
        print(f"  {m:13s} start-up {s['startup_s']:6.1f} s  first request {s['first_request_s']:6.3f} s  "
              f"restart to first {s['restart_to_first_s']:6.1f} s")
    print(f"  host / disk: first request {summary['first_request_host_over_disk']:.2f}x, restart to first hit "
          f"{summary['restart_to_first_hit_host_over_disk']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
