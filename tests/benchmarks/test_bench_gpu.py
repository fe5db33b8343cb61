"""The GPU run stays runnable where no GPU is: its CPU smoke run moves real KV both ways exactly, proves
three tiny families through the HF integration, and passes the device self-check on every hand-built GPU
backend layout while catching a planted layout error in each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


def test_smoke_run_on_cpu_round_trips_both_layouts_exactly(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "512", "--layers", "3",
                           "--heads", "2", "--dim", "16", "--repeats", "1", "--skip-vllm", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["layout"] for r in data["runs"]] == ["stacked [L,2,T,H,D]", "per-layer tensors"]
    for run in data["runs"]:
        assert run["exact"] is True
        assert run["arena_pinned"] is False  # no CUDA here: plain host memory
        assert run["store_over_d2h"] > 0 and run["retrieve_over_h2d"] > 0
    assert data["vllm"] == {"status": "skipped", "why": "--skip-vllm"}
    assert [c["family"] for c in data["hf"]] == ["llama", "gemma2", "qwen3_next"]
    assert all(c["ok"] and c["tokens_loaded"] > 0 for c in data["hf"]), data["hf"]
    for group in (g for c in data["hf"] for g in c["groups"]):
        assert group["outcome"] == "EXACT" and group["max_state_error"] <= 1e-4, group  # fp32 tolerance
    assert {c["backend"] for c in data["self_check"]} >= {"FLASH_ATTN", "FLASHINFER", "FLASHMLA"}
    for case in data["self_check"]:
        assert case["outcome"] == "passed" and case["planted_error_caught"] is True, case
        assert case["unproven"] == [case["backend"]]  # a GPU backend: it serves only with a record


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_refuses_cuda_without_a_device_naming_what_to_do() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--skip-vllm"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no CUDA device here" in proc.stderr and "--device cpu" in proc.stderr
