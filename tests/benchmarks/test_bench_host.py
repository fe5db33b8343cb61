"""The host-service benchmark stays runnable: a small run moves real KV through both memory tiers
exactly (it asserts so itself) and reports every ratio it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host.py"


def test_a_small_run_reports_both_modes_and_their_ratios(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--chunks", "2", "--layers", "1", "--repeats", "1",
                           "--rounds", "20", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"in-process", "service"}
    assert all(r["store_gbps"] > 0 and r["load_gbps"] > 0 and r["lookup_us"] > 0 and r["release_us"] > 0 for r in data["results"].values())
    assert data["held_bytes"]["service"] * 2 == data["held_bytes"]["in-process"] > 0  # one copy, not two
    assert "service / in-process: store" in proc.stdout
