"""examples/vllm_offload.py runs as documented on vLLM's CPU build.

Here, not in tests/test_examples.py, because CI runs the vLLM tests as
``.venv-vllm/bin/python -m pytest tests/integrations/test_vllm_*.py``. Each
run starts two vLLM engines (~1.5 min on two cores).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (use .venv-vllm, see docs/vllm.md)"),
    pytest.mark.slow,
]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900


def run_offload(*args: str) -> str:
    """``python examples/vllm_offload.py ARGS`` from the repo root with VLLM_CPU_KVCACHE_SPACE unset, as a user
    who has not read the CPU notes runs it; fails the test unless it exits 0. Returns its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    proc = subprocess.run([sys.executable, "examples/vllm_offload.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"vllm_offload.py exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
                    f"stderr tail:\n{proc.stderr[-6000:]}")
    print(proc.stdout)  # the hit tokens, in the test log
    return proc.stdout


def loaded(out: str, pass_name: str) -> list[int]:
    """Tokens each request of one pass loaded from kvengine, in request order."""
    return [int(m[1]) for m in re.finditer(rf"^\s*{pass_name} request \d+: \d+ prompt tokens, (\d+) loaded",
                                           out, re.M)]


def test_vllm_offload_example_runs_as_written():
    """Without VLLM_CPU_KVCACHE_SPACE the example sets it and says so; with the connector the cold pass's
    later requests load the shared prefix, the warm pass loads more, and every greedy output equals vLLM's
    without the connector."""
    out = run_offload()
    assert "VLLM_CPU_KVCACHE_SPACE was not set: set it to 1" in out
    cold, warm = loaded(out, "cold"), loaded(out, "warm")
    assert len(cold) == len(warm) == 4, out
    assert cold[0] == 0 and all(n > 0 for n in cold[1:]), cold  # request 0 computes the shared prefix
    assert all(w >= c for w, c in zip(warm, cold)) and all(n > 0 for n in warm), (cold, warm)
    assert f"hit tokens: cold {sum(cold)} of " in out and f", warm {sum(warm)} of " in out
    assert "greedy outputs identical to vLLM without the connector: yes (8 of 8)" in out


def test_vllm_offload_example_second_run_hits_disk(tmp_path: Path):
    """Run twice with the same --disk: the second process's very first request already loads the prefix
    from the disk tier, and its outputs still equal vLLM's without the connector."""
    disk = str(tmp_path / "kv")
    run_offload("--disk", disk, "--requests", "2")
    out = run_offload("--disk", disk, "--requests", "2")
    cold = loaded(out, "cold")
    assert len(cold) == 2 and cold[0] > 0, out
    assert "greedy outputs identical to vLLM without the connector: yes (4 of 4)" in out
