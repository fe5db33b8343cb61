"""``kvengine verify vllm`` on real vLLM CPU engines, and what its record unlocks.

Each proof runs the CLI in a subprocess (``python -m kvengine verify vllm``:
vLLM without the connector, a writer engine with it, a fresh reader engine
over a disk tier or the writer again with memory only; preemption included)
on a tiny model built here. The Llama record then unlocks a real engine whose
backend is made to need proof (``vllm_scenarios.py unlock``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
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

ROOT = Path(__file__).parents[2]
TIMEOUT_S = 900
SECRET = b"0123456789abcdef0123456789abcdef"
VERDICT = re.compile(r"^(group \d+ \(\w+\)): (EXACT|DIFFERS).*tokens loaded (\d+).*max logprob error (\S+)$", re.M)


def _env() -> dict[str, str]:
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))


def _verify(work: Path, family: str, *, dtype: str, disk: bool, extra: tuple[str, ...] = ()) -> tuple[int, str, Path]:
    """Build ``family`` under ``work/model`` and prove it: (exit status, stdout, records dir)."""
    from kvengine.integrations.vllm.tiny_models import build_model_dir

    model = build_model_dir(work / "model", family, dtype=dtype)
    (work / "secret").write_bytes(SECRET)
    config = work / "kvengine.yaml"
    config.write_text("memory:\n  capacity_bytes: 64MiB\n" + (f"disk:\n  path: {work / 'disk'}\n" if disk else ""))
    records = work / "records"
    with (work / "verify.log").open("w") as log:
        proc = subprocess.run([sys.executable, "-m", "kvengine", "verify", "vllm", "--model", str(model), "--dtype",
                               dtype, "--config", str(config), "--records", str(records), "--secret-file",
                               str(work / "secret"), *extra], stdout=subprocess.PIPE, stderr=log, text=True,
                              env=_env(),
                              timeout=TIMEOUT_S, cwd=ROOT)
    (work / "verify.out").write_text(proc.stdout)  # whole, for a failure's diagnosis (the message has its end)
    return proc.returncode, proc.stdout, records


def _verdicts(out: str) -> list[tuple[str, str, int, float]]:
    return [(g, v, int(n), float(e)) for g, v, n, e in VERDICT.findall(out)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path, Path]:
    work = tmp_path_factory.mktemp("verify_llama")
    code, out, records = _verify(work, "llama", dtype="float32", disk=True)
    return code, out, records, work


def _assert_proven(code: int, out: str, records: Path, groups: list[str]) -> dict[str, Any]:
    assert code == 0, out[-4000:]
    verdicts = _verdicts(out)
    assert [g for g, *_ in verdicts] == groups, out[-4000:]
    assert all(v == "EXACT" and n > 0 for _, v, n, _ in verdicts), verdicts
    preempted = int(re.search(r"vLLM preempted (\d+) requests", out).group(1))  # type: ignore[union-attr]
    assert preempted > 0
    (path,) = records.glob("*.json")
    assert f"record written to {path} (sealed)" in out
    data = json.loads(path.read_text())
    assert "seal" in data
    return data["record"]


def test_llama_is_exact_over_a_fresh_engine_reading_the_disk_tier_and_writes_a_record(llama):
    """The proof over a disk tier (fresh reader process), preemption included: EXACT with tokens loaded and a
    sealed record of the running platform (vLLM, its CPU backend and layout, fp32 KV)."""
    code, out, records, _ = llama
    record = _assert_proven(code, out, records, ["group 0 (full_attention)"])
    assert "reader: a fresh engine process" in out
    platform = record["platform"]
    assert (platform["engine"], platform["engine_version"], platform["attention_backend"], platform["kv_dtype"]) == \
        ("vllm", "0.32.0", "CPU_ATTN", "float32")
    assert platform["kv_layout_id"].startswith("vllm-0.32.0/vllm:CPU_ATTN:LBHNC") and platform["accelerator"] == "cpu"
    assert record["groups"][0]["max_state_error"] is None and record["groups"][0]["max_logprob_error"] <= 1e-4


def _amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


#: vLLM's CPU rotary kernel is wrong for MLA's rope inputs: served with its plain-torch rotary embedding
MLA_ARGS = ("--engine-args", json.dumps({"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}))


@pytest.mark.parametrize("family, dtype, groups, extra", [
    ("gemma2", "float32", ["group 0 (sliding_window)", "group 1 (full_attention)"], ()),
    ("qwen3_next", "bfloat16", ["group 0 (recurrent_state)", "group 1 (full_attention)"], ()),
    pytest.param("deepseek_v2", "bfloat16", ["group 0 (mla_latent)"], MLA_ARGS,
                 marks=pytest.mark.skipif(not _amx(), reason="vLLM serves MLA on CPU through AMX_MLA only")),
])
def test_sliding_window_hybrid_and_mla_models_are_exact(tmp_path, family, dtype, groups, extra):
    """Gemma2 (sliding window + full attention; memory only: the writer engine reads its own chunks),
    Qwen3-Next (linear-attention state + full attention, bf16, prefix caching on; fresh reader over disk) and,
    on AMX CPUs, DeepSeek-V2 (MLA latent pages, bf16, with the engine settings it is served with). Models of
    several KV cache groups run on a budget sized from one preempted-size request's measured use of it.
    Requests resumed from cached tokens are compared with vLLM resuming them at the same token; on AMX CPUs,
    where bf16 outputs move by 0.015 with where a prefill is split, they equal that reference bit for bit."""
    disk = family != "gemma2"
    code, out, records = _verify(tmp_path, family, dtype=dtype, disk=disk, extra=extra)
    _assert_proven(code, out, records, groups)
    resumed = re.search(r"\((\d+) resumed where the passes resumed\)", out)
    assert resumed and int(resumed.group(1)) > 0, out[-4000:]
    control = re.search(r"reader control \((\d+) tokens cached\) against the reference: (\S+)", out)
    assert (control is not None) == disk, "a fresh reader (disk tier) runs the control"
    if dtype == "bfloat16" and _amx():  # bf16 Qwen3-Next: 0 everywhere in 29 proofs of 30 (docs/verify.md)
        assert all(e == 0.0 for *_, e in _verdicts(out)), _verdicts(out)
        assert control is None or (control.group(1), float(control.group(2))) == ("0", 0.0), control.group(0)


def test_engine_args_the_proof_sets_are_refused_by_name(tmp_path):
    """``--engine-args`` may not override what the proof sizes itself (exit 2, naming the keys)."""
    proc = subprocess.run([sys.executable, "-m", "kvengine", "verify", "vllm", "--model", str(tmp_path),
                           "--engine-args", '{"max_num_seqs": 1, "enforce_eager": false}'], capture_output=True,
                          text=True, env=_env(), timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 2 and "['max_num_seqs'] are set by the proof itself" in proc.stderr


def test_a_proof_past_its_time_bound_fails_and_writes_no_record(tmp_path):
    """``--max-seconds`` is checked between steps: past it, exit 1 naming the bound and the step, no record."""
    from kvengine.integrations.vllm.tiny_models import build_model_dir

    model = build_model_dir(tmp_path / "model", "llama", dtype="float32")
    proc = subprocess.run([sys.executable, "-m", "kvengine", "verify", "vllm", "--model", str(model), "--records",
                           str(tmp_path / "records"), "--max-seconds", "0.001"], capture_output=True, text=True,
                          env=_env(), timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "FAILED: past --max-seconds 0.001" in proc.stderr
    assert not (tmp_path / "records").exists()


def test_the_record_unlocks_a_backend_that_needs_proof_and_nothing_else_does(llama):
    """A real engine whose backend needs proof: refused without a record (naming the command), started by the
    verify record, refused by that record re-sealed for another CPU, started under the named risk."""
    code, _, _, work = llama
    assert code == 0
    proc = subprocess.run([sys.executable, str(ROOT / "tests/integrations/vllm_scenarios.py"), "unlock",
                           "--workdir", str(work), "--out", str(work / "unlock.json")], capture_output=True,
                          text=True, env=_env(), timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((work / "unlock.json").read_text())
    assert "kvengine verify vllm --model" in report["no_record"]["refused"]
    assert "no record" in report["no_record"]["refused"]
    assert report["record"]["acceptance"] == "record" and len(report["record"]["out"][0]["tokens"]) == 16
    assert "recorded on another platform" in report["other_cpu"]["refused"]
    assert "accelerator_model: recorded 'Other CPU'" in report["other_cpu"]["refused"]
    assert report["risk"]["acceptance"] == "risk_accepted"


def test_a_proof_over_wrong_kv_fails_and_writes_no_record(tmp_path):
    """The proof can fail: pages loaded scaled by 1.5 (past the device self-check, which would refuse to start)
    make it DIFFERS with the first difference named, though tokens were loaded."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests/integrations/vllm_scenarios.py"), "verify_fault",
                           "--workdir", str(tmp_path), "--out", str(tmp_path / "fault.json")], capture_output=True,
                          text=True, env=_env(), timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "fault.json").read_text())
    assert report["tokens_loaded"] > 0 and set(report["outcomes"]) == {"DIFFERS"}
    assert re.search(r"(greedy token \d+ differs|log-probabilities differ by up to)", report["failure"])
