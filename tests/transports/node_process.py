"""A test node in a subprocess, driven by one JSON command per stdin line and answering one JSON line each.

The node program prints ``ready <words...>`` once it is up; :meth:`NodeProcess.ready` returns those words.
Also what node programs do with an engine: make a prompt and its KV from a seed, look it up and load it,
and digest what was loaded (compared with :func:`expected_digest` in the test process).
"""
from __future__ import annotations

import hashlib
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


def tokens_and_kv(seed: int, n: int) -> tuple[Any, Any]:
    """A prompt of ``n`` tokens and its (fake) KV, both from ``seed``."""
    import torch

    from tests.conftest import FakeKV

    tokens = torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed))
    return tokens, FakeKV(n, seed=seed)


def digest(tensors: list[Any], upto: int) -> str:
    """A digest of the first ``upto`` tokens of per-layer KV."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t[:, :, :upto].contiguous().numpy().tobytes())
    return h.hexdigest()


def expected_digest(seed: int, n: int, upto: int) -> str:
    return digest(tokens_and_kv(seed, n)[1].layers, upto)


def lookup_and_load(engine: Any, binding: Any, request: str, tokens: Any, kv: Any) -> dict[str, Any]:
    """Look ``tokens`` up, load every hit into zeroed tensors shaped like ``kv``'s; what matched, what was
    loaded and its digest."""
    import torch

    res = engine.lookup(binding, request, tokens)
    out = [torch.zeros_like(t) for t in kv.layers]

    def sink(view: Any) -> None:
        s, e = view.token_range
        for dst, src in zip(out, view.tensors):
            dst[:, :, s:e].copy_(src)

    loaded = engine.load(res, sink)
    return {"matched": res.tokens, "loaded": loaded.loaded_tokens, "digest": digest(out, loaded.loaded_tokens)}
