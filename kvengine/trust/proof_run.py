"""What a ``kvengine verify`` proof reports, and the clock that bounds it (shared by every integration).

Each integration's proof (``integrations/hf/verify_run.py``,
``integrations/vllm/verify_run.py``) compares kvengine's cached continuation
with a plain run of the same engine on the user's machine, model and
configuration, and ends in one :class:`ProofResult`: a verdict per KV layer
group and, when it failed, the first reason. The CLI
(:mod:`kvengine.cli.verify`) prints it and writes the verification record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvengine.trust.verification import GroupVerdict, Platform

#: Largest accepted difference of a log-probability from the plain run's, per model dtype (KV computed in a
#: prefill measures 0; KV computed while decoding, or another batch split, rounds differently).
LOGPROB_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


class ProofTimedOut(Exception):
    """The proof ran past its time bound."""


class ProofClock:
    """Elapsed time since the proof began; every step is announced (progress) and checked against the bound."""

    def __init__(self, max_seconds: float, progress: Callable[[str], None]) -> None:
        self._t0 = time.monotonic()
        self._max = max_seconds
        self._progress = progress

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def check(self, during: str) -> None:
        """:raises ProofTimedOut: the bound is past (``during`` says where the proof was)."""
        elapsed = self.elapsed
        if elapsed > self._max:
            raise ProofTimedOut(f"past --max-seconds {self._max:g} after {elapsed:.1f}s, during: {during}")

    def step(self, message: str) -> None:
        """Announce the next step. :raises ProofTimedOut: the bound is already past."""
        self.check(message)
        self._progress(f"[{self.elapsed:6.1f}s] {message}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProofResult:
    """One proof: the platform it ran on, one verdict per KV layer group, and the first failure (None: proven)."""

    model: str
    model_fingerprint: str
    platform: Platform
    groups: tuple[GroupVerdict, ...]
    tokens_loaded: int
    failure: str | None

    @property
    def ok(self) -> bool:
        return self.failure is None
