"""Where a vLLM step's time goes, with and without the kvengine connector, on a cold workload (issue 36: "a
miss costs nothing").

Every prompt is unique (random token ids), so nothing can hit: whatever the connector adds is pure cost.
Each arm runs in a fresh process, in-process engine (as ``bench_serving.py``), the arms alternated
``--repeats`` times. Inside the arm, vLLM's and the connector's step functions are wrapped with timers
(wall clock, and the process's CPU time over the same interval, all threads): the scheduler, the model
executor, the connector's scheduler and worker hooks. A phase's *cores busy* is its CPU time over its wall
time: on a machine of ``N`` cores, ``N - cores busy`` is the share of that phase the machine idles. The
threads the connector starts (the engine's event loop, its pools) are reported with their own CPU time.

    .venv-vllm/bin/python benchmarks/step_timeline.py                 # SmolLM2, 6 users x 2048 tokens, 3 rounds
    .venv-vllm/bin/python benchmarks/step_timeline.py --arms vllm,kvengine-mem --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _util import print_header, print_table, write_json
from bench_serving import CONNECTOR, cpu_share, cpu_times, kv_bytes_per_token, model_dir, thread_env

#: An arm ending in ``+prefault`` sets ``memory.prefault`` (the arena touched at start).
ARMS = ("vllm", "kvengine-mem", "kvengine-mem+prefault", "kvengine-disk")


class Timeline:
    """Per phase: calls, wall seconds, process CPU seconds (all threads) over those intervals."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth = threading.local()

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        """Time ``owner.name`` (a class or an instance attribute) as ``phase``; nested timed calls count in
        their own phase and in the outer one."""
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.wall[phase] += time.perf_counter() - w0
                self.cpu[phase] += time.process_time() - c0
                self.calls[phase] += 1

        setattr(owner, name, timed)


def thread_cpu() -> dict[str, float]:
    """CPU seconds per Python thread (by name; the main thread and vLLM's OpenMP threads are not Python
    threads other than ``MainThread``), read from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = defaultdict(float)
    for thread in threading.enumerate():
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[thread.name.split("_")[0].rstrip("-0123456789")] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def instrument(engine: Any, timeline: Timeline) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    core = engine.engine_core.engine_core
    timeline.wrap(Scheduler, "schedule", "scheduler.schedule")
    timeline.wrap(Scheduler, "update_from_output", "scheduler.update_from_output")
    timeline.wrap(core.model_executor, "execute_model", "executor.execute_model")
    timeline.wrap(core.model_executor, "sample_tokens", "executor.sample_tokens")
    timeline.wrap(engine, "step", "engine.step")
    try:
        from kvengine.integrations.vllm.connector import KVEngineConnector
    except ImportError:
        return
    for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "request_finished", "update_connector_output"):
        timeline.wrap(KVEngineConnector, hook, f"connector(scheduler).{hook}")
    for hook in ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_transfer_results",
                 "get_finished"):
        if hasattr(KVEngineConnector, hook):
            timeline.wrap(KVEngineConnector, hook, f"connector(worker).{hook}")


def arm_process(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import EngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    args: dict[str, Any] = dict(model=spec["model"], dtype="float32", max_model_len=spec["prompt"] + spec["reply"] + 16,
                                enforce_eager=True, max_num_seqs=max(8, spec["users"]), enable_prefix_caching=True,
                                seed=0, kv_cache_memory_bytes=spec["kv_cache_bytes"])
    if spec["arm"] != "vllm":
        prefault = spec["prefault"] or spec["arm"].endswith("+prefault")
        section: dict[str, Any] = {"memory": {"capacity_bytes": spec["kvengine_bytes"], "prefault": prefault}}
        if spec["arm"].startswith("kvengine-disk"):
            section["memory"]["capacity_bytes"] = spec["kvengine_bytes"] // 4
            section["disk"] = {"path": spec["disk"]}
        args["kv_transfer_config"] = {"kv_connector": "KVEngineConnector", "kv_connector_module_path": CONNECTOR,
                                      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": {"kvengine": section}}
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    sp = SamplingParams(max_tokens=spec["reply"], temperature=0.0, ignore_eos=True)
    rng = random.Random(spec["seed"])
    counter = [0]

    def run_round() -> tuple[float, list[float]]:
        counter[0] += 1
        ids = [f"r{counter[0]}-u{u}" for u in range(spec["users"])]
        t = time.perf_counter()
        for rid in ids:
            engine.add_request(rid, TokensPrompt(prompt_token_ids=[rng.randrange(1000, 40000)
                                                                  for _ in range(spec["prompt"])]), sp)
        first: dict[str, float] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id not in first and o.outputs[0].token_ids:
                    first[o.request_id] = time.perf_counter() - t
        return time.perf_counter() - t, [first[r] for r in ids]

    run_round()  # warm-up: kernels, allocator, the connector's first stores
    timeline = Timeline()
    instrument(engine, timeline)
    threads0, cpu0, w0 = thread_cpu(), time.process_time(), time.perf_counter()
    machine0 = cpu_times()
    rounds, ttfts = [], []
    for _ in range(spec["rounds"]):
        wall, ttft = run_round()
        rounds.append(wall)
        ttfts += ttft
    wall, cpu = time.perf_counter() - w0, time.process_time() - cpu0
    machine1 = cpu_times()
    threads1 = thread_cpu()
    engine.engine_core.shutdown()
    return {"arm": spec["arm"], "wall_s": wall, "cpu_s": cpu, "rounds_s": rounds, "ttft_s": ttfts,
            "phases": {p: {"wall_s": timeline.wall[p], "cpu_s": timeline.cpu[p], "calls": timeline.calls[p]}
                       for p in timeline.wall},
            "threads_cpu_s": {k: threads1.get(k, 0.0) - threads0.get(k, 0.0) for k in threads1},
            "machine_idle": cpu_share(machine0, machine1).get("idle", float("nan"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=2048, help="tokens per prompt (every prompt unique)")
    ap.add_argument("--reply", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="arms alternated this many times")
    ap.add_argument("--prefault", action="store_true", help="kvengine arms: memory.prefault (arena touched at start)")
    ap.add_argument("--out", default="step_timeline.json")
    ap.add_argument("--arm-spec", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm_spec:
        spec = json.loads(args.arm_spec.read_text())
        Path(spec["out"]).write_text(json.dumps(arm_process(spec)))
        return 0
    print_header()
    model, _ = model_dir()
    per_token = kv_bytes_per_token(model, "float32")
    work = Path(tempfile.mkdtemp(prefix="timeline-"))
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for repeat in range(args.repeats):
        for arm in args.arms.split(","):
            spec = {"arm": arm, "model": str(model), "users": args.users, "prompt": args.prompt, "reply": args.reply,
                    "rounds": args.rounds, "seed": 100 + repeat, "prefault": args.prefault,
                    "kv_cache_bytes": per_token * (args.prompt + args.reply + 128) * args.users,
                    "kvengine_bytes": max(1 << 29, per_token * (args.prompt + args.reply) * args.users * (args.rounds + 2)),
                    "disk": str(work / f"disk-{arm}-{repeat}"), "out": str(work / f"{arm}-{repeat}.json")}
            (work / "spec.json").write_text(json.dumps(spec))
            env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
            env.update(thread_env("inproc"))
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--arm-spec", str(work / "spec.json")], env=env,
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                raise SystemExit(f"arm {arm} failed")
            results[arm].append(json.loads(Path(spec["out"]).read_text()))
            print(f"  {arm} repeat {repeat + 1}: {time.perf_counter() - t:.0f} s", flush=True)
    cores = os.cpu_count() or 1
    base = statistics.median(r["wall_s"] for r in results[args.arms.split(",")[0]])
    rows = []
    for arm, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        rows.append([arm, wall, wall / base, statistics.median(statistics.median(r["ttft_s"]) for r in runs),
                     statistics.median(r["cpu_s"] / r["wall_s"] for r in runs),
                     statistics.median(r["machine_idle"] for r in runs)])
    print_table(f"{args.users} users x {args.prompt} unique tokens, reply {args.reply}, {args.rounds} rounds; "
                f"medians of {args.repeats} alternated runs",
                ["arm", "rounds wall s", "vs first arm", "TTFT p50 s", "cores busy (process)", "machine idle"], rows)
    for arm, runs in results.items():
        phases = sorted({p for r in runs for p in r["phases"]})
        prows = []
        for p in phases:
            wall = statistics.median(r["phases"].get(p, {}).get("wall_s", 0.0) for r in runs)
            cpu = statistics.median(r["phases"].get(p, {}).get("cpu_s", 0.0) for r in runs)
            calls = statistics.median(r["phases"].get(p, {}).get("calls", 0) for r in runs)
            total = statistics.median(r["wall_s"] for r in runs)
            prows.append([p, calls, wall, wall / total, cpu / wall if wall else 0.0,
                          (cores - cpu / wall) * wall if wall else 0.0])
        outside = statistics.median(r["wall_s"] - r["phases"].get("engine.step", {}).get("wall_s", 0.0) for r in runs)
        prows.append(["(outside engine.step)", "-", outside, outside / total, "-", "-"])
        print_table(f"{arm}: phases (medians)", ["phase", "calls", "wall s", "share of run", "cores busy",
                                                  "core-seconds idle"], prows)
        threads = sorted({k for r in runs for k in r["threads_cpu_s"]})
        print_table(f"{arm}: CPU seconds per Python thread", ["thread", "CPU s"],
                    [[k, statistics.median(r["threads_cpu_s"].get(k, 0.0) for r in runs)] for k in threads])
    write_json(args.out, {"users": args.users, "prompt": args.prompt, "reply": args.reply, "rounds": args.rounds,
                          "repeats": args.repeats, "runs": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
