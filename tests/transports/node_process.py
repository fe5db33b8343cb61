"""A test node in a subprocess, driven by one JSON command per stdin line and answering one JSON line each.

The node program prints ``ready <words...>`` once it is up; :meth:`NodeProcess.ready` returns those words.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class NodeProcess:
    def __init__(self, script: str | Path, args: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen([sys.executable, str(script), *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)

    def ready(self, words: int = 1) -> list[str]:
        """The ``words`` words the node printed after ``ready`` (the last one takes the rest of the line)."""
        assert self.p.stdout is not None
        line = self.p.stdout.readline().split(maxsplit=words)
        assert len(line) == words + 1 and line[0] == "ready", f"process did not start (exit {self.p.poll()})"
        return line[1:]

    def send(self, **cmd: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        assert line, f"process died (exit {self.p.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.receive()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
