"""``kvengine host`` run in a process of its own, for tests (the host-service tests and the integrations')."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Host:
    """``kvengine host`` in a process of its own on ``path``."""

    def __init__(self, path: Path, *, capacity: int, slab_bytes: int) -> None:
        self.path = path
        self.capacity = capacity
        self.slab_bytes = slab_bytes
        self.proc: subprocess.Popen[str] | None = None

    def start(self, *extra: str) -> None:
        """Start it (``extra``: more ``kvengine host`` options) and wait until it serves."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvengine", "host", "--socket", str(self.path), "--capacity",
             str(self.capacity), "--slab-bytes", str(self.slab_bytes), *extra],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("kvengine host:") and str(self.path) in line, line

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        self.proc.send_signal(signal.SIGTERM)
        out = self.proc.stdout.read()
        self.proc.wait(timeout=10)
        return out
