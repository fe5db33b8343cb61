"""The MLA tensor-parallel benchmark runs two real processes over gloo and both ranks end with the same pages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_mla_tp.py"


def test_smoke_run_shares_every_chunk_exactly(tmp_path: Path) -> None:
    out = tmp_path / "mla_tp.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--chunks", "2", "--layers", "2", "--rounds", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["exact"] is True and data["bytes"] == 2 * 2 * 256 * 576 * 2
    assert len(data["local_s"]) == 2 and all(t > 0 for t in data["shared_s"]["1"])
