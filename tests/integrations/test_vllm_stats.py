"""kvengine's counters reach vLLM's own stats path: its stat loggers and its Prometheus registry.

A real vLLM CPU engine (in-process topology, tiny Llama, memory tier only,
stats on) runs a cold pass and then a warm pass of the same prompts in a
child process (this file run as a script). The child records what vLLM's
stat loggers received as ``kv_connector_stats`` (rebuilt and aggregated
with the connector's ``build_kv_connector_stats``, as vLLM's logging
logger does), the ``vllm:kvengine_*`` samples of vLLM's Prometheus
registry, and kvengine's own metrics (scraped from its metrics port).

Run with the vLLM environment: ``.venv-vllm/bin/python -m pytest tests/integrations/test_vllm_stats.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (use .venv-vllm, see docs/vllm.md)"),
    pytest.mark.slow,
]

CONNECTOR = "kvengine.integrations.vllm.connector"
TIMEOUT_S = 600


def _child(work: Path, out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from ports import free_port
    from prometheus_client import REGISTRY
    from vllm import EngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    from kvengine.integrations.vllm.connector import KVEngineConnector
    from kvengine.integrations.vllm.tiny_models import build_model_dir
    from kvengine.metrics import scrape

    received: list[Any] = []

    class Capture(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None and scheduler_stats.kv_connector_stats:
                received.append(KVEngineConnector.build_kv_connector_stats(scheduler_stats.kv_connector_stats))

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    model = str(build_model_dir(work / "llama", "llama"))
    port = free_port()
    extra = {"kvengine": {"memory": {"capacity_bytes": "64MiB"}, "metrics_port": port}}
    args = EngineArgs(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, max_num_seqs=4,
                      enable_prefix_caching=False, seed=0, disable_log_stats=False,
                      kv_transfer_config={"kv_connector": "KVEngineConnector", "kv_connector_module_path": CONNECTOR,
                                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                          "kv_connector_extra_config": extra})
    engine = LLMEngine.from_engine_args(args, stat_loggers=[Capture])
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (700, 300, 1100)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        for run in ("cold", "warm"):
            for i, p in enumerate(prompts):
                engine.add_request(f"{run}-{i}", TokensPrompt(prompt_token_ids=p), sp)
            while engine.has_unfinished_requests():
                engine.step()
        kvengine = scrape(port)
    finally:
        engine.engine_core.shutdown()
    total = KVEngineConnector.build_kv_connector_stats()
    for stats in received:
        total = total.aggregate(stats)
    prom = {f"{s.name}{sorted(s.labels.items())}" if "tier" in s.labels or "outcome" in s.labels else s.name: s.value
            for m in REGISTRY.collect() for s in m.samples if s.name.startswith("vllm:kvengine_")}
    out.write_text(json.dumps({"logged": total.reduce(), "prom": prom, "kvengine": kvengine,
                               "reports": len(received)}))


def test_kvengine_counters_reach_vllm_stat_loggers_and_prometheus(tmp_path):
    """After a cold and a warm pass, the kvengine stats vLLM's stat loggers received and the
    vllm:kvengine_* counters in vLLM's Prometheus registry equal kvengine's own metrics for the run."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = tmp_path / "stats.json"
    proc = subprocess.run([sys.executable, __file__, str(tmp_path), str(out)], env=env, timeout=TIMEOUT_S,
                          capture_output=True, text=True)
    assert out.exists(), f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    got = json.loads(out.read_text())
    logged, prom, kv = got["logged"], got["prom"], got["kvengine"]
    assert kv["kvengine_hit_tokens_total"] > 0 and kv["kvengine_loaded_tokens_total"] > 0  # the warm pass hit
    for name, sample in [("hit_tokens", "kvengine_hit_tokens_total"), ("loaded_tokens", "kvengine_loaded_tokens_total"),
                         ("lookups", "kvengine_lookups_total")]:
        assert logged.get(name, 0) == kv[sample], (name, logged, kv)
        assert prom[f"vllm:kvengine_{name}_total"] == kv[sample], (name, prom)
    stored = kv['kvengine_stored_chunks_total{tier="memory"}']
    assert stored > 0
    assert logged["stored_chunks:memory"] == stored
    assert sum(v for k, v in prom.items() if k.startswith("vllm:kvengine_stored_chunks_total")) == stored
    assert logged.get("load_failed_tokens", 0) == kv.get("kvengine_load_failed_tokens_total", 0) == 0
    assert "reservations_held" in logged and "pinned_chunks" in logged


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
