"""Does stored KV come from the model that reads it? Two checks beyond the checksums.

Checksums prove that a record's bytes are the ones written, not that the
model now reading them computed them: an in-place weight update, a kernel or
library upgrade, or a writer with other weights under the same name all
leave bytes that verify and KV that is wrong. So:

* **Namespace canary** (:func:`check_namespace_canary`): the first writer of
  a namespace on a persistent or shared tier stores the KV of a fixed probe
  prompt next to its chunks; every later reader that can run the model
  computes the same probe and compares before it serves any chunk.
* **Shadow checks** (:class:`ShadowSampler`, :func:`compare_kv`): a sample of
  hits is recomputed by the inference engine instead of loaded, and what it
  computed is compared with the stored chunks.

A mismatch beyond the dtype's tolerance (:func:`kv_tolerance`) quarantines
the namespace (:mod:`.quarantine`): no hits, no stores, a loud log line, a
metric, and ``kvengine quarantine`` to inspect or purge it.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from kvengine.compression import LOSSLESS_FAMILY, codec_family, error_bound
from kvengine.config import ShadowConfig
from kvengine.facade import KVEngine, engine_of
from kvengine.keyed import GetOutcome, SyncKeyedStore, keyed_namespace
from kvengine.types import ModelBinding

logger = logging.getLogger("kvengine.trust.provenance")

#: Key scheme of a namespace's canary record (a keyed sub-namespace of the namespace).
CANARY_SCHEME = "provenance-canary"
_CANARY_KEY = xxhash.xxh3_128_digest(b"kvengine-namespace-canary-v1")


# -- comparing KV ---------------------------------------------------------------------------------
def kv_tolerance(dtype: torch.dtype) -> float | None:
    """Largest ``|got - want|`` accepted per element, relative to ``max|want|`` of the tensor, between
    two computations of the same KV by the same weights (None: bitwise only).

    The same weights give bitwise equal KV when the kernels and the batch shape are the same; a
    different prefill split, thread count or ISA (AVX2 vs AVX-512, where bf16 is emulated vs native)
    changes the accumulation order, which moves results by a few units in the last place. So: 4 ulp
    of the tensor's largest magnitude for 16-bit floats, 64 ulp for float32 (rounding accumulates
    over the hidden dimension before the final rounding), and bytes (integer or raw state) exactly.
    """
    if not dtype.is_floating_point:
        return None
    ulps = 64 if torch.finfo(dtype).bits >= 32 else 4
    return ulps * torch.finfo(dtype).eps


@dataclass(frozen=True, slots=True)
class KVComparison:
    """Stored KV against recomputed KV: bitwise equal, within tolerance, or neither."""

    exact: bool
    within_tolerance: bool
    #: largest |got - want| / max|want| over the tensors (inf for a shape or dtype mismatch, NaN)
    max_relative_error: float
    detail: str = ""

    @property
    def outcome(self) -> str:
        """Metric label: ``exact``, ``close`` or ``mismatch``."""
        return "exact" if self.exact else "close" if self.within_tolerance else "mismatch"


def compare_kv(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], *,
               lossy_bound: float | None = None) -> KVComparison:
    """Compare stored tensors ``got`` with the recomputed ``want`` (same order).

    ``lossy_bound``: the stored KV went through a lossy codec (a namespace of a lossy codec family), so
    floating tensors are accepted up to that relative error too (:func:`kvengine.compression.error_bound`)
    and such a comparison is at best ``close``.
    """
    if len(got) != len(want):
        return KVComparison(False, False, float("inf"), f"{len(got)} tensors stored, {len(want)} computed")
    exact, close, worst, detail = True, True, 0.0, ""
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return KVComparison(False, False, float("inf"),
                                f"tensor {i}: stored {tuple(g.shape)} {g.dtype}, computed {tuple(w.shape)} {w.dtype}")
        if torch.equal(g, w):
            continue
        exact = False
        tol = kv_tolerance(w.dtype)
        if tol is not None and lossy_bound is not None:
            tol = max(tol, lossy_bound)
        if tol is None:
            close, worst, detail = False, float("inf"), detail or f"tensor {i}: bytes differ"
            continue
        scale = float(w.abs().max().float()) or 1.0
        err = float((g.float() - w.float()).abs().max()) / scale
        if err != err:  # NaN
            err = float("inf")
        if err > worst:
            worst = err
        if err > tol:
            close = False
            detail = detail or f"tensor {i}: max relative error {err:.3g} > {tol:.3g} ({w.dtype})"
    return KVComparison(exact, close, worst, detail)


# -- namespace canary -------------------------------------------------------------------------------
class CanaryOutcome(enum.Enum):
    WRITTEN = "written"  # no canary yet: this reader is the first writer
    EXACT = "exact"
    CLOSE = "close"  # within the dtype's tolerance (other kernels or ISA, same weights)
    MISMATCH = "mismatch"  # the namespace is now quarantined
    QUARANTINED = "quarantined"  # it already was
    NOT_PERSISTENT = "not_persistent"  # memory only: nothing below memory to prove
    UNAVAILABLE = "unavailable"  # the canary could be neither read nor written (counted; served as before)


@dataclass(frozen=True, slots=True)
class CanaryResult:
    outcome: CanaryOutcome
    comparison: KVComparison | None = None

    @property
    def serving(self) -> bool:
        """Whether the namespace's chunks may be served."""
        return self.outcome not in (CanaryOutcome.MISMATCH, CanaryOutcome.QUARANTINED)


def check_namespace_canary(engine: KVEngine, binding: ModelBinding, probe: Sequence[torch.Tensor]) -> CanaryResult:
    """Compare ``probe`` (the KV this model computes for the integration's fixed probe prompt, one
    chunk in ``binding``'s layout) with the canary stored for ``binding``'s namespace, or store it
    there if there is none. A mismatch quarantines the namespace before anything of it is served.
    """
    core = engine_of(engine)
    if core.is_quarantined(binding):
        return CanaryResult(CanaryOutcome.QUARANTINED)
    if not core.transports:
        return CanaryResult(CanaryOutcome.NOT_PERSISTENT)
    store = SyncKeyedStore(engine, engine.bind(keyed_namespace(binding.namespace, CANARY_SCHEME), binding.layout))
    stored: list[tuple[torch.Tensor, ...]] = []
    got = store.get([_CANARY_KEY], lambda _i, tensors: stored.append(tuple(t.clone() for t in tensors)))[0]
    if got is GetOutcome.HIT:
        comparison = compare_kv(stored[0], probe, lossy_bound=namespace_lossy_bound(engine, binding))
        settle(engine, binding, "canary", comparison, "namespace canary differs from the KV this model computes")
        if not comparison.within_tolerance:
            return CanaryResult(CanaryOutcome.MISMATCH, comparison)
        if not comparison.exact:
            logger.info("kvengine: namespace canary of %r matches within tolerance (max relative error %.3g)",
                        binding.namespace.model, comparison.max_relative_error)
        return CanaryResult(CanaryOutcome.EXACT if comparison.exact else CanaryOutcome.CLOSE, comparison)
    if got is GetOutcome.MISS:
        if store.put([_CANARY_KEY], lambda _i: list(probe))[0].ok:
            core.metrics.provenance_checks.labels(check="canary", outcome="written").inc()
            return CanaryResult(CanaryOutcome.WRITTEN)
    # A corrupt canary was deleted by the tier (counted): the next reader writes a new one.
    logger.warning("kvengine: namespace canary of %r could not be read or written (%s)", binding.namespace.model,
                   got.value)
    return CanaryResult(CanaryOutcome.UNAVAILABLE)


def namespace_lossy_bound(engine: KVEngine, binding: ModelBinding) -> float | None:
    """The relative error stored KV of ``binding``'s namespace may carry: None for a lossless namespace,
    the lossy codec's :func:`~kvengine.compression.error_bound` otherwise (0.0, i.e. no slack beyond the
    dtype's, for a lossy codec whose bound is unknown: fail closed)."""
    family = binding.namespace.codec_family
    if family == LOSSLESS_FAMILY:
        return None
    codec = engine.lossy_codec
    if codec is None or codec_family(codec) != family:
        return 0.0
    return error_bound(codec) or 0.0


def worst(comparisons: Sequence[KVComparison]) -> KVComparison | None:
    """The comparison that says most against the stored KV: mismatch, then inexact, then largest error."""
    return max(comparisons, key=lambda c: (not c.within_tolerance, not c.exact, c.max_relative_error), default=None)


def settle(engine: KVEngine, binding: ModelBinding, check: str, comparison: KVComparison | None, reason: str,
           **details: str) -> None:
    """Count a provenance check (``check``: canary, shadow) and, if its comparison failed, quarantine
    ``binding``'s namespace for ``reason`` (from any thread). No comparison (nothing could be compared)
    counts as ``skipped``: no evidence either way, never as exact."""
    if comparison is None:
        engine.metrics.provenance_checks.labels(check=check, outcome="skipped").inc()
        return
    engine.metrics.provenance_checks.labels(check=check, outcome=comparison.outcome).inc()
    if not comparison.within_tolerance:
        engine.quarantine_namespace(binding, reason, max_relative_error=f"{comparison.max_relative_error:.3g}",
                                    detail=comparison.detail, **details)


# -- shadow sampling ---------------------------------------------------------------------------------
class ShadowSampler:
    """Which hits are shadowed: the first ``first_hits`` of each namespace root since start, then each
    with probability ``fraction`` (seeded). Thread-safe."""

    def __init__(self, config: ShadowConfig) -> None:
        self._config = config
        self._rng = random.Random(config.seed)
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._config.enabled

    def pick(self, binding: ModelBinding) -> bool:
        """Count one hit of ``binding``; True if it is to be recomputed and compared instead of loaded."""
        if not self._config.enabled:
            return False
        with self._lock:
            n = self._hits.get(binding.root, 0)
            self._hits[binding.root] = n + 1
            return n < self._config.first_hits or self._rng.random() < self._config.fraction
