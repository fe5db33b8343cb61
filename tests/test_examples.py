"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_async_quickstart_example():
    """Scenario: examples/async_quickstart.py runs and loads back its full chunks identically."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "async_quickstart.py")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "matched 256 of 303 tokens; loaded 256; identical=True" in out
