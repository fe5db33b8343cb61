"""Cluster serving benchmark: vLLM instances behind a router, sharing KV through kvengine or not.

The multi-round chat of ``bench_serving.py`` (its texts, model, chat template and sizing rules) served by
``--instances`` vLLM CPU engines (default 2), each in a process of its own with one core to itself
(``VLLM_CPU_OMP_THREADS_BIND``), as nodes of a cluster. Users come and go: in each round every user is active
with probability ``--active`` (seeded: the same schedule in every arm), and the active users' turns arrive in a
shuffled order. A turn is the user's whole conversation so far plus a new question; the reply (``--reply``
tokens, greedy, EOS ignored) is appended. The router places each turn as it arrives, at most
``ceil(active / instances)`` per instance and round (balanced load), so users move between instances. Round
``r + 1`` starts when every reply of round ``r`` is complete; TTFT counts from the round's submission.

Arms, each a fresh set of engine processes (arms interleaved, ``--repeats`` times):

* ``rr-vllm``         -- round-robin in arrival order; vLLM alone (its prefix cache on, as in every arm);
* ``rr-kvengine``     -- round-robin; each instance with the kvengine connector and a memory tier of its own,
  sized to hold the whole working set: no sharing;
* ``rr-mooncake``     -- round-robin; each instance's kvengine also writes to and reads from a Mooncake Store
  (a real ``mooncake_master`` on loopback; every instance lends it a segment): a user who moved finds the
  history it built elsewhere there;
* ``router-kvengine`` -- the KV-aware router of ``examples/kv_router.py``: it reads each instance's KV events
  and sends a turn where most of its prefix is cached (within the load cap); no sharing;
* ``router-mooncake`` -- the router, sharing through Mooncake as ``rr-mooncake`` (a chunk in Mooncake counts
  for every instance, one in an instance's memory ranks it first);
* ``router-host``     -- all instances on one ``kvengine host`` service (one arena in shared memory, this
  host's memory tier): every chunk is local to every instance, so the router has only load to go by.

Per arm: throughput (prompt and generated tokens per second of the rounds), TTFT p50/p95, hit rate (vLLM's
``num_cached_tokens``: its own prefix cache and the connector's), moved turns (a user's turn on another
instance than its previous one) with their hit rate and TTFT, cross-instance hits (tokens of moved turns
cached beyond the shared system prompt), bytes read from Mooncake and the tier's read time per MB.
vLLM's KV cache per instance is ``1/--pressure`` of the whole working set.

    .venv-vllm/bin/python benchmarks/bench_cluster.py                # ~20 min here
    .venv-vllm/bin/python benchmarks/bench_cluster.py --quick        # ~5 min smoke run
    .venv/bin/python benchmarks/bench_cluster.py --from-json benchmarks/results/cluster.json [more.json ...]

Writes ``benchmarks/results/cluster.json`` and ``docs/benchmarks_cluster.png`` (matplotlib is not in
``.venv-vllm``: the plot is then rendered with ``.venv/bin/python ... --from-json``).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _util import print_header, print_table, write_json
from bench_serving import (
    PAGE,
    _Capture,
    build_workload,
    cpu_share,
    cpu_times,
    free_port,
    kv_bytes_per_token,
    model_dir,
    pct,
    quiet_gate,
    run_requests,
)

PNG = REPO / "docs" / "benchmarks_cluster.png"
ARMS = ("rr-vllm", "rr-kvengine", "rr-mooncake", "router-kvengine", "router-mooncake", "router-host")
LABELS = {"rr-vllm": "round-robin, vLLM alone", "rr-kvengine": "round-robin, kvengine per instance",
          "rr-mooncake": "round-robin, shared through Mooncake",
          "router-kvengine": "KV-aware router, kvengine per instance",
          "router-mooncake": "KV-aware router, shared through Mooncake",
          "router-host": "router, shared through kvengine host"}
CONNECTOR = "kvengine.integrations.vllm.connector"
MOONCAKE = "MOONCAKE"  # the medium of the Mooncake tier's KV events


# -- the schedule: who is active, in which order, and where each turn goes --------------------------------------------
def schedule(users: int, rounds: int, active: float, seed: int = 0) -> list[list[int]]:
    """Per round, the active users in arrival order (at least one each round)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        here = [u for u in range(users) if rng.random() < active] or [rng.randrange(users)]
        rng.shuffle(here)
        out.append(here)
    return out


def place_round_robin(order: Sequence[int], instances: int, start: int) -> dict[int, int]:
    """Turns to instances in arrival order, continuing the rotation from ``start``."""
    return {u: (start + k) % instances for k, u in enumerate(order)}


def place_by_cache(order: Sequence[int], cached: Mapping[int, Sequence[tuple[int, int]]], instances: int) -> dict[int, int]:
    """Turns to instances in arrival order: of the instances under the round's cap (``ceil(turns / instances)``),
    the one that can load the longest prefix (``cached[user][i]``: (tokens it can load, of them on its own
    media)), then the less loaded, then the lower index."""
    cap = math.ceil(len(order) / instances)
    load = [0] * instances
    out = {}
    for u in order:
        best = max((i for i in range(instances) if load[i] < cap),
                   key=lambda i: (cached[u][i][0], cached[u][i][1], -load[i], -i))
        out[u] = best
        load[best] += 1
    return out


# -- an instance: one vLLM engine in its own process, serving rounds sent over a pipe -----------------------------------
def serve_instance(spec: dict[str, Any], conn: Any) -> None:
    """Start an engine, warm it up, then run each round sent (``("round", [(id, prompt), ...])``) and reply with
    each request's tokens, TTFT and cached tokens; ``("stats",)`` replies with vLLM's and kvengine's counters."""
    log = open(spec["log"], "w")  # vLLM logs to stdout and stderr: to a file
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    os.environ.update({"VLLM_CPU_OMP_THREADS_BIND": str(spec["core"]), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        _serve(spec, conn)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _serve(spec: dict[str, Any], conn: Any) -> None:
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    from kvengine.metrics import scrape

    logger = type("CaptureStatsLogger", (_Capture, StatLoggerBase), {})
    args: dict[str, Any] = dict(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                                enforce_eager=True, max_num_seqs=8, enable_prefix_caching=True, seed=0,
                                kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], disable_log_stats=False)
    if spec.get("kv_transfer_config"):
        args["kv_transfer_config"] = spec["kv_transfer_config"]
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[logger])
    cache = engine.vllm_config.cache_config
    info = {"startup_s": time.perf_counter() - t0, "block_size": int(cache.block_size),
            "kv_capacity_tokens": int(cache.block_size) * int(cache.num_gpu_blocks or 0)}
    sp = SamplingParams(max_tokens=spec["reply"], temperature=0.0, ignore_eos=True)

    rng = random.Random(7 + spec["core"])  # warm-up, not measured: two unrelated prompts decoded together
    run_requests(engine, [(f"warm{n}", [rng.randrange(1000, 40000) for _ in range(n)]) for n in (512, 384)], sp)
    stats0, port = dict(_Capture.totals), spec.get("metrics_port")
    m0 = scrape(port) if port else {}
    conn.send(("ready", info))
    while True:
        message = conn.recv()
        if message[0] == "round":
            conn.send(("done", run_requests(engine, message[1], sp)))
        elif message[0] == "stats":
            stats1 = dict(_Capture.totals)
            out: dict[str, Any] = {"vllm_stats": {k: stats1.get(k, 0) - stats0.get(k, 0) for k in stats1}}
            if port:
                deadline = time.monotonic() + 30  # queued lower-tier writes hold pins until written
                while (m1 := scrape(port)).get("kvengine_vllm_pinned_chunks", 0) and time.monotonic() < deadline:
                    time.sleep(0.2)
                out["metrics"] = {k: v - m0.get(k, 0.0) for k, v in m1.items()}
            conn.send(("stats", out))
        else:
            engine.engine_core.shutdown()
            conn.send(("stopped",))
            return


class Instances:
    """The arm's engine processes, started together."""

    def __init__(self, specs: list[dict[str, Any]], timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.conns, self.procs = [], []
        for spec in specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve_instance, args=(spec, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.info = self._all("ready")

    def _reply(self, i: int, expect: str) -> Any:
        if not self.conns[i].poll(self.timeout_s):
            raise TimeoutError(f"instance {i} did not answer within {self.timeout_s} s")
        message = self.conns[i].recv()
        if message[0] != expect:
            raise RuntimeError(f"instance {i}: {message[1] if message[0] == 'error' else message}")
        return message[1] if len(message) > 1 else None

    def _all(self, expect: str) -> list[Any]:
        return [self._reply(i, expect) for i in range(len(self.conns))]

    def round(self, batches: list[list[tuple[str, list[int]]]]) -> list[dict[str, dict[str, Any]]]:
        for conn, batch in zip(self.conns, batches):
            conn.send(("round", batch))
        return self._all("done")

    def stats(self) -> list[dict[str, Any]]:
        for conn in self.conns:
            conn.send(("stats",))
        return self._all("stats")

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                if proc.is_alive():
                    conn.send(("stop",))
                    conn.poll(30)
            except (OSError, EOFError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()


# -- one arm --------------------------------------------------------------------------------------------------------
def instance_specs(arm: str, spec: dict[str, Any], work: Path, shared: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for i in range(spec["instances"]):
        s = dict(spec, core=spec["cores"][i % len(spec["cores"])], log=str(work / f"{arm}-{i}.log"))
        if arm != "rr-vllm":
            s["metrics_port"] = free_port()
            section: dict[str, Any] = {"metrics_port": s["metrics_port"]}
            if arm == "router-host":
                section["memory"] = {"service": f"unix://{shared['host_socket']}"}
            else:
                section["memory"] = {"capacity_bytes": spec["kvengine_mem_bytes"], "slab_bytes": spec["slab_bytes"]}
                s["events"] = f"tcp://127.0.0.1:{free_port()}"
                s["replay"] = f"tcp://127.0.0.1:{free_port()}"
                section["events"] = {"endpoint": s["events"], "bind": True, "replay_endpoint": s["replay"]}
            if arm.endswith("-mooncake"):
                section["mooncake"] = {"master": shared["mooncake_master"], "local_hostname": f"127.0.0.{2 + i}",
                                       "segment_bytes": spec["mooncake_segment_bytes"], "timeout": 5.0}
            s["kv_transfer_config"] = {"kv_connector": "KVEngineConnector", "kv_connector_module_path": CONNECTOR,
                                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                       "kv_connector_extra_config": {"kvengine": section}}
        out.append(s)
    return out


class SharedServices:
    """What an arm's instances share: a ``mooncake_master`` or a ``kvengine host`` service, or nothing."""

    def __init__(self, arm: str, spec: dict[str, Any], work: Path) -> None:
        self.addresses: dict[str, str] = {}
        self._master: Any = None
        self._host: subprocess.Popen[str] | None = None
        if arm.endswith("-mooncake"):
            if str(REPO) not in sys.path:
                sys.path.insert(0, str(REPO))
            from tests.mooncake_master import Master

            self._master = Master()
            self._master.__enter__()
            self.addresses["mooncake_master"] = self._master.address
        elif arm == "router-host":
            path = work / f"host-{os.getpid()}.sock"
            self._host = subprocess.Popen(
                [sys.executable, "-m", "kvengine", "host", "--socket", str(path), "--capacity",
                 str(spec["host_capacity_bytes"]), "--slab-bytes", str(spec["slab_bytes"])],
                stdout=subprocess.PIPE, text=True)
            assert self._host.stdout is not None
            line = self._host.stdout.readline()
            if not line.startswith("kvengine host:"):
                raise RuntimeError(f"kvengine host did not start: {line!r}")
            self.addresses["host_socket"] = str(path)

    def close(self) -> None:
        if self._master is not None:
            self._master.__exit__(None, None, None)
        if self._host is not None:
            self._host.terminate()
            self._host.wait(30)


def _router(specs: list[dict[str, Any]], shared_media: frozenset[str]) -> Any:
    sys.path.insert(0, str(REPO / "examples"))
    from kv_router import Instance, KVRouter

    router = KVRouter([Instance.from_metrics(str(i), f"http://127.0.0.1:{s['metrics_port']}/metrics", s["events"],
                                             s["replay"]) for i, s in enumerate(specs)], shared_media=shared_media)
    router.catch_up()
    return router


def run_arm(arm: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    waited = quiet_gate(spec["quiet_wait_s"]) if spec["quiet_wait_s"] > 0 else 0.0
    print(f"  {arm}: running ...", end="", flush=True)
    t_arm = time.perf_counter()
    shared = SharedServices(arm, spec, work)
    instances: Instances | None = None
    router = None
    try:
        specs = instance_specs(arm, spec, work, shared.addresses)
        instances = Instances(specs, spec["arm_timeout_s"])
        if arm.startswith("router-") and "events" in specs[0]:
            router = _router(specs, frozenset({MOONCAKE}) if arm == "router-mooncake" else frozenset())
        n, users = spec["instances"], spec["workload"]["users"]
        convo = [list(u["first"]) for u in users]
        turn = [0] * len(users)
        where: dict[int, int] = {}
        requests, rounds = [], []
        cpu0, rr = cpu_times(), 0
        for r, order in enumerate(spec["schedule"]):
            if router is not None:
                router.poll(0.05)
                cached = {u: [router.cached(str(i), convo[u]) for i in range(n)] for u in order}
                placed = place_by_cache(order, cached, n)
            elif arm.startswith("router-"):
                placed = place_by_cache(order, {u: [(0, 0)] * n for u in order}, n)
            else:
                placed = place_round_robin(order, n, rr)
                rr += len(order)
            batches: list[list[tuple[str, list[int]]]] = [[] for _ in range(n)]
            for u in order:
                batches[placed[u]].append((f"r{r}-u{u}", convo[u]))
            t = time.perf_counter()
            results = instances.round(batches)
            rounds.append(time.perf_counter() - t)
            for u in order:
                i = placed[u]
                res = results[i][f"r{r}-u{u}"]
                requests.append({"round": r, "user": u, "turn": turn[u] + 1, "instance": i,
                                 "moved": u in where and where[u] != i, "prompt_tokens": len(convo[u]),
                                 "generated_tokens": len(res["tokens"]), "cached_tokens": res["cached_tokens"],
                                 "ttft_s": res["ttft_s"], "e2e_s": res["e2e_s"]})
                where[u] = i
                follow = users[u]["follow"]
                convo[u] = convo[u] + res["tokens"] + follow[turn[u] % len(follow)]
                turn[u] += 1
            if router is not None:
                router.poll(0.2)  # the round's stores, published as they commit
        machine = cpu_share(cpu0, cpu_times())
        stats = instances.stats()
        info = instances.info
    except Exception as exc:  # an arm that fails is reported, the others still run
        print(f" fails: {exc}", flush=True)
        return {"arm": arm, "error": str(exc)[:300]}
    finally:
        if router is not None:
            router.close()
        if instances is not None:
            instances.close()
        shared.close()
    res = {"arm": arm, "rounds_s": rounds, "requests": requests, "instances": info, "stats": stats,
           "machine_during": dict(machine, waited_for_quiet_s=waited), "process_wall_s": time.perf_counter() - t_arm}
    res["summary"] = summarize(res, spec["workload"]["shared_prefix_tokens"])
    s = res["summary"]
    print(f" {res['process_wall_s']:.0f} s (rounds {s['wall_s']:.0f} s, TTFT p50 {s['ttft_p50_s']:.2f} s, "
          f"hits {100 * s['cached_rate']:.0f}%, moved turns {s['moved_turns']} hit "
          f"{100 * s['moved_cached_rate']:.0f}%)", flush=True)
    return res


def _sum_tier(stats: list[dict[str, Any]], family: str, tier: str) -> float:
    """A per-tier sample summed over the instances (keyed as exposed: one label, the tier)."""
    return sum(st.get("metrics", {}).get(f'{family}{{tier="{tier}"}}', 0.0) for st in stats)


def cross_instance_tokens(reqs: Sequence[Mapping[str, Any]], shared_prefix: int) -> int:
    """Cached tokens no cache of the serving instance could have supplied: beyond the system prompt and beyond
    what that instance itself computed for the user before (its prompt and reply, less the reply's last token)."""
    own: dict[tuple[int, int], int] = {}
    total = 0
    for r in sorted(reqs, key=lambda r: r["round"]):
        where = (r["instance"], r["user"])
        total += max(0, r["cached_tokens"] - max(shared_prefix, own.get(where, 0)))
        own[where] = r["prompt_tokens"] + r["generated_tokens"] - 1
    return total


def summarize(res: dict[str, Any], shared_prefix: int) -> dict[str, Any]:
    reqs = res["requests"]
    wall = sum(res["rounds_s"])
    prompt = sum(r["prompt_tokens"] for r in reqs)
    moved = [r for r in reqs if r["moved"]]
    stayed = [r for r in reqs if r["turn"] > 1 and not r["moved"]]
    s: dict[str, Any] = {
        "wall_s": wall, "requests": len(reqs), "prompt_tokens": prompt,
        "prompt_tok_per_s": prompt / wall, "generated_tok_per_s": sum(r["generated_tokens"] for r in reqs) / wall,
        "ttft_p50_s": pct([r["ttft_s"] for r in reqs], 50), "ttft_p95_s": pct([r["ttft_s"] for r in reqs], 95),
        "cached_rate": sum(r["cached_tokens"] for r in reqs) / prompt,
        "moved_turns": len(moved), "later_turns": len(moved) + len(stayed),
        "moved_cached_rate": sum(r["cached_tokens"] for r in moved) / max(1, sum(r["prompt_tokens"] for r in moved)),
        "moved_ttft_p50_s": pct([r["ttft_s"] for r in moved], 50),
        "stayed_ttft_p50_s": pct([r["ttft_s"] for r in stayed], 50),
        "cross_instance_hit_tokens": cross_instance_tokens(reqs, shared_prefix),
        "preemptions": sum(st["vllm_stats"].get("preemptions", 0) for st in res["stats"]),
    }
    loaded, seconds = (_sum_tier(res["stats"], "kvengine_loaded_bytes_total", "mooncake"),
                       _sum_tier(res["stats"], "kvengine_tier_read_seconds_sum", "mooncake"))
    if loaded:
        s["mooncake_loaded_bytes"] = loaded
        s["mooncake_read_ms_per_mb"] = 1e3 * seconds / (loaded / 1e6)
        s["mooncake_bytes_per_moved_turn"] = loaded / max(1, len(moved))
    s["cpu_idle"] = res["machine_during"].get("idle")
    return s


# -- report ---------------------------------------------------------------------------------------------------------
def medians(runs: list[dict[str, Any]], arm: str) -> dict[str, float] | None:
    ok = [r["summary"] for r in runs if r["arm"] == arm and "summary" in r]
    if not ok:
        return None
    return {k: statistics.median(s[k] for s in ok) for k in ok[0] if isinstance(ok[0][k], (int, float))
            and all(isinstance(s.get(k), (int, float)) and not math.isnan(s[k]) for s in ok)}


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each arm's medians over repeats, and its ratios to round-robin with vLLM alone and with kvengine unshared."""
    out: dict[str, Any] = {}
    base, unshared = medians(runs, "rr-vllm"), medians(runs, "rr-kvengine")
    for arm in ARMS:
        m = medians(runs, arm)
        if m is None:
            continue
        out[arm] = {"medians": m}
        for name, ref in (("vs_rr_vllm", base), ("vs_rr_kvengine", unshared)):
            if ref and arm != name[3:].replace("_", "-"):
                out[arm][name] = {"throughput": m["prompt_tok_per_s"] / ref["prompt_tok_per_s"],
                                  "ttft_p50_speedup": ref["ttft_p50_s"] / m["ttft_p50_s"],
                                  "ttft_p95_speedup": ref["ttft_p95_s"] / m["ttft_p95_s"]}
    return out


def report(data: dict[str, Any]) -> None:
    rows = []
    for arm, v in data["verdict"].items():
        m, x = v["medians"], v.get("vs_rr_vllm", {})
        moved = m["moved_turns"] > 0
        rows.append([LABELS[arm], f"{m['prompt_tok_per_s']:.0f}", f"{m['ttft_p50_s']:.2f}", f"{m['ttft_p95_s']:.2f}",
                     f"{100 * m['cached_rate']:.0f}%", f"{m['moved_turns']:.0f}/{m['later_turns']:.0f}",
                     f"{100 * m['moved_cached_rate']:.0f}%" if moved else "-",
                     f"{m['moved_ttft_p50_s']:.2f}" if "moved_ttft_p50_s" in m else "-",
                     f"{m['cross_instance_hit_tokens']:.0f}",
                     f"{x['throughput']:.2f}x" if x else "-", f"{x['ttft_p50_speedup']:.2f}x" if x else "-"])
    print_table(f"{data['instances']} instances, medians of {data['repeats']} runs ({data.get('cpu', '')})", ["arm", "prompt tok/s", "TTFT p50 s", "TTFT p95 s", "hits", "moved turns", "moved hits",
                 "moved TTFT p50 s", "cross-instance hit tok", "throughput vs rr", "TTFT p50 vs rr"], rows)
    for r in data["runs"]:
        if "error" in r:
            print(f"  {r['arm']} failed: {r['error']}")


def plot(data: dict[str, Any], png: Path = PNG) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed here"
    arms = list(data["verdict"])
    m = [data["verdict"][a]["medians"] for a in arms]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, key, title in ((axes[0], "prompt_tok_per_s", "prompt tokens/s (higher is better)"),
                           (axes[1], "ttft_p50_s", "TTFT p50, s (lower is better)"),
                           (axes[2], "moved_cached_rate", "hit rate of turns that moved instance")):
        ax.bar(range(len(arms)), [x.get(key, 0.0) for x in m],
               color=["#999", "#6a9fd4", "#d9a25f", "#3b6fb0", "#d08a2c", "#4c9a55"][:len(arms)])
        ax.set_xticks(range(len(arms)), arms, fontsize=8, rotation=25, ha="right")
        ax.set_title(title, fontsize=10)
    cpu = data.get("cpu", "")
    fig.suptitle(f"{data['instances']} vLLM instances (1 core each), {data['workload']['users']} users, "
                 f"medians of {data['repeats']} runs; {cpu}", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return str(png)


def from_json(paths: list[Path], out: Path | None, png: Path) -> int:
    """Merge runs of the same workload (e.g. another repeat run later), summarize them again, report and plot."""
    first = json.loads(paths[0].read_text())
    for path in paths[1:]:
        more = json.loads(path.read_text())
        if more["workload"] != first["workload"] or more["instances"] != first["instances"]:
            raise SystemExit(f"{path}: another workload than {paths[0]}'s")
        first["runs"] += more["runs"]
        first["command"] += " + " + more["command"]
    shared = first["workload"]["shared_prefix_tokens"]
    for run in first["runs"]:
        if "requests" in run:
            run["summary"] = summarize(run, shared)
    first["repeats"] = max(sum(r["arm"] == arm for r in first["runs"]) for arm in ARMS)
    first["verdict"] = verdict(first["runs"])
    if out is not None:
        write_json(out, first)
    report(first)
    print(plot(first, png))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 users, 3 rounds, short texts, 1 repeat")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--users", type=int, default=None, help="default 8 (quick: 4)")
    ap.add_argument("--rounds", type=int, default=None, help="default 6 (quick: 3)")
    ap.add_argument("--active", type=float, default=0.75, help="chance a user is active in a round (default 0.75)")
    ap.add_argument("--system-tokens", type=int, default=None, help="shared system prompt (default 512; quick 256)")
    ap.add_argument("--history-tokens", type=int, default=None, help="each user's history (default 1536; quick 384)")
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--pressure", type=float, default=4.0, help="working set over one instance's vLLM KV (default 4)")
    ap.add_argument("--repeats", type=int, default=None, help="arms interleaved this many times (default 2; quick 1)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--quiet-wait", type=float, default=60.0)
    ap.add_argument("--arm-timeout", type=int, default=900)
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/cluster.json)")
    ap.add_argument("--png", type=Path, default=PNG)
    ap.add_argument("--from-json", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                    help="no run: merge these results' runs (same workload), summarize, report and plot")
    args = ap.parse_args()
    if args.from_json:
        return from_json(args.from_json, args.out, args.png)
    arms = [a for a in args.arms.split(",") if a]
    if arms[0] != "rr-vllm" or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: from {','.join(ARMS)}, rr-vllm first (it reports the block size)")
    t_start = time.perf_counter()
    users = args.users or (4 if args.quick else 8)
    rounds = args.rounds or (3 if args.quick else 6)
    repeats = args.repeats or (1 if args.quick else 2)
    print_header()
    model, tok = model_dir()
    order = schedule(users, rounds, args.active)
    turns = max(sum(u in o for o in order) for u in range(users))
    workload = build_workload(tok, users, max(turns, 2), args.system_tokens or (256 if args.quick else 512),
                              args.history_tokens or (384 if args.quick else 1536), args.reply)
    per_token = kv_bytes_per_token(model, args.dtype)
    cpus = sorted(os.sched_getaffinity(0))
    max_len = workload["max_len"] + 16
    kv_tokens = max(int(workload["working_set_tokens"] / args.pressure), max_len + 256)
    ws_bytes = workload["working_set_tokens"] * per_token
    print(f"model {model.name} {args.dtype}: {per_token} B of KV per token; working set "
          f"{workload['working_set_tokens']} tokens ({ws_bytes / 1e6:.0f} MB); each instance's vLLM KV "
          f"{kv_tokens} tokens; {args.instances} instances on cores {cpus}", flush=True)
    spec: dict[str, Any] = {"model": str(model), "dtype": args.dtype, "reply": args.reply, "max_model_len": max_len,
                            "kv_cache_memory_bytes": kv_tokens * per_token, "instances": args.instances,
                            "cores": cpus, "workload": workload, "schedule": order,
                            "arm_timeout_s": args.arm_timeout, "quiet_wait_s": args.quiet_wait}
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    runs: list[dict[str, Any]] = []
    from kvengine.integrations.vllm.layout import AUTO_CHUNK_TARGET

    for rep in range(repeats):
        print(f"repeat {rep + 1}/{repeats}", flush=True)
        for arm in arms:
            r = run_arm(arm, spec, work)
            if "slab_bytes" not in spec:
                if "error" in r:
                    raise SystemExit(f"vLLM alone failed: {r['error']} (logs under {work})")
                block = r["instances"][0]["block_size"]
                chunk = block * -(-AUTO_CHUNK_TARGET // block)
                slab = -(-chunk * per_token // PAGE) * PAGE
                memory = max(4, int(1.25 * ws_bytes) // slab) * slab
                spec.update(slab_bytes=slab, kvengine_mem_bytes=memory, mooncake_segment_bytes=memory,
                            host_capacity_bytes=memory)
            runs.append(r)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    data: dict[str, Any] = {
        "benchmark": "cluster_serving", "command": "python benchmarks/bench_cluster.py " + " ".join(sys.argv[1:]),
        "cpu": model_name + (" AVX-512" if "avx512f" in cpu else "") + (" AMX" if "amx" in cpu else ""),
        "model": {"name": "SmolLM2-135M-Instruct", "dtype": args.dtype, "kv_bytes_per_token": per_token},
        "instances": args.instances, "repeats": repeats,
        "workload": {"users": users, "rounds": rounds, "active": args.active, "reply_tokens": args.reply,
                     "shared_prefix_tokens": workload["shared_prefix_tokens"],
                     "working_set_tokens": workload["working_set_tokens"], "schedule": order},
        "sizes": {"vllm_kv_tokens_per_instance": kv_tokens, "kvengine_mem_bytes": spec.get("kvengine_mem_bytes"),
                  "slab_bytes": spec.get("slab_bytes")},
        "runs": runs, "verdict": verdict(runs), "duration_s": time.perf_counter() - t_start}
    path = write_json(args.out if args.out else "cluster.json", data)
    report(data)
    where = plot(data, args.png)
    venv = REPO / ".venv" / "bin" / "python"
    if where.startswith("matplotlib") and venv.is_file():
        proc = subprocess.run([str(venv), __file__, "--from-json", str(path), "--png", str(args.png)],
                              capture_output=True, text=True)
        where = proc.stdout.strip().rpartition("\n")[2] or proc.stderr.strip()[-300:]
    print(f"\nwhole run {data['duration_s'] / 60:.1f} min -> {path}; plot: {where}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
