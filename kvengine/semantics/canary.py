"""The attach-time canary: is a cached continuation the same as a plain prefill?

An integration runs a short probe prompt twice: once through the framework
alone (a plain prefill split at the same boundaries as the cached path: the
stored prefix, then the suffix over the framework's own cache), once as
store -> fresh load -> continue. The two run the same kernels on the same
shapes, so an exact reuse path is bitwise equal to the plain run: no
tolerance is needed, and none hides a fault smaller than a rounding bound.
This module holds the framework-free parts: the per-layer state comparison
that names the first layer group whose state differs, and the report. It
never decides to "serve anyway": :meth:`CanaryReport.raise_if_failed`
raises :class:`~kvengine.errors.AttachError`.

States are compared as ``{(layer, kind): [tensors]}`` with ``kind`` one of
``"attention"`` or ``"state"``; a layer's cache bookkeeping (e.g. a sliding
window's cumulative length) is one of its tensors. The earliest differing
layer names the group: errors propagate forward, never backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvengine.errors import AttachError

from .spec import ModelKVSpec

StateKey = tuple[int, str]
LayerStates = Mapping[StateKey, Sequence[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class CanaryTolerance:
    """``|got - want| <= atol + rtol * max|want|`` element-wise maximum (:data:`EXACT`, or a lossy codec's
    relative bound)."""

    atol: float
    rtol: float

    def bound(self, want: torch.Tensor) -> float:
        if not want.numel() or not want.is_floating_point():
            return self.atol
        scale = float(want.abs().max())
        return self.atol + self.rtol * scale


#: The lossless canary's tolerance: none. Its reference is a plain run split at the same boundaries as
#: the cached continuation (same kernels, shapes and accumulation order), so an exact reuse path is
#: bitwise equal to it in every dtype; the only tolerance left is a lossy codec's bound (:func:`judge`).
EXACT = CanaryTolerance(0.0, 0.0)


@dataclass(frozen=True, slots=True)
class GroupMismatch:
    """The first layer whose state differs, and the group it belongs to."""

    group: str
    layer: int
    kind: str
    detail: str
    max_error: float


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if not got.numel():
        return 0.0
    diff = (got.double() - want.double()).abs()
    if torch.isnan(diff).any():
        return float("inf")
    return float(diff.max())


def compare_states(
    spec: ModelKVSpec, want: LayerStates, got: LayerStates, tolerance: CanaryTolerance
) -> GroupMismatch | None:
    """The earliest layer (by index) whose state in ``got`` differs from ``want``, or None."""
    for key in sorted(set(want) | set(got)):
        layer, kind = key
        try:
            group = spec.group_of(layer, kind).name
        except KeyError:
            group = f"layer {layer} ({kind}, outside every group)"
        if key not in want or key not in got:
            return GroupMismatch(group, layer, kind, "state present on one side only", float("inf"))
        w_list, g_list = list(want[key]), list(got[key])
        if len(w_list) != len(g_list):
            return GroupMismatch(group, layer, kind, f"{len(g_list)} tensors, expected {len(w_list)}", float("inf"))
        for i, (w, g) in enumerate(zip(w_list, g_list)):
            if g.shape != w.shape or g.dtype != w.dtype:
                return GroupMismatch(group, layer, kind,
                                     f"tensor {i}: {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}",
                                     float("inf"))
            err = _max_error(g, w)
            if err > tolerance.bound(w):
                return GroupMismatch(group, layer, kind, f"tensor {i}: max abs error {err:.3g}", err)
    return None


@dataclass(frozen=True, kw_only=True)
class CanaryReport:
    """What the canary measured. ``failure`` is None when the model may be served."""

    model: str
    probe_tokens: int
    matched_tokens: int
    restored_exact: bool
    max_logit_error: float
    logit_bound: float
    failure: str | None = None
    mismatch: GroupMismatch | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: Lossy attach only (``attach(..., lossy_kv=True)``): the lower tiers' codec, the largest error of
    #: the cache restored through it (``|restored - stored| / max|stored|`` over the tensors) and its bound;
    #: then the continuation over that cache against a plain prefill: its largest logit error and the
    #: fraction of probe positions whose greedy next token agrees. None/0 on the lossless path.
    codec: str | None = None
    restored_error: float = 0.0
    restored_bound: float = 0.0
    lossy_logit_error: float | None = None
    lossy_greedy_agreement: float | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None

    @property
    def lossy(self) -> bool:
        return self.codec is not None

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise AttachError(f"attach canary failed for {self.model!r}: {self.failure}; nothing will be served")


@dataclass(frozen=True, kw_only=True)
class LossyProbe:
    """The canary's second restore, through the lower tiers' lossy codec (what a hit from disk or a peer
    holds), and the continuation's logits over it."""

    codec: str
    #: relative bound of the codec's round trip (:func:`kvengine.compression.error_bound`)
    bound: float
    matched_tokens: int
    restored: LayerStates
    cached_logits: torch.Tensor


def max_relative_error(want: LayerStates, got: LayerStates) -> float:
    """Largest ``|got - want| / max|want|`` over the floating tensors present on both sides (inf for a
    shape mismatch or NaN); other tensors count only when they differ (inf)."""
    worst = 0.0
    for key in set(want) & set(got):
        for w, g in zip(want[key], got[key]):
            err = _max_error(g, w)
            if not w.is_floating_point():
                worst = max(worst, 0.0 if err == 0 else float("inf"))
            elif err:
                worst = max(worst, err / (float(w.abs().max()) or 1.0))
    return worst


def _greedy_agreement(cached: torch.Tensor, reference: torch.Tensor) -> float:
    if cached.shape != reference.shape or not cached.numel():
        return 0.0
    return float((cached.argmax(-1) == reference.argmax(-1)).double().mean())


def judge(
    *,
    spec: ModelKVSpec,
    model: str,
    probe_tokens: int,
    expected_match: int,
    matched_tokens: int,
    in_memory: LayerStates,
    restored: LayerStates,
    reference_logits: torch.Tensor,
    cached_logits: torch.Tensor,
    reference_states: LayerStates,
    continued_states: LayerStates,
    lossy: LossyProbe | None = None,
) -> CanaryReport:
    """Turn the canary's measurements into a report (first failing check wins).

    1. the lookup matched the stored prefix;
    2. the restored cache equals, bit for bit, the in-memory cache it was stored from;
    3. after continuing, every layer's state equals, bit for bit, the plain run's (``reference_states``:
       a plain prefill split at the same boundaries, so an exact path has no rounding to allow for);
    4. the continuation's logits equal the plain run's, bit for bit.

    With ``lossy`` (a lossy attach, whose hits are exact from memory or lossy from the lower tiers),
    checks 1-4 run as above on the exact restore, then:

    5. the cache restored through the codec matched the same tokens and is within the codec's bound
       of the in-memory cache, tensor by tensor (``|got - want| <= bound * max|want|``; integer tensors
       exactly). A wrong layout, layer order or window breaks it by the magnitude of the KV itself,
       far beyond a quantization step; positions are caught by checks 3-4 on the same restore path.
    6. the continuation over that cache is measured, not judged: its largest logit error and how
       often its greedy next token agrees with a plain prefill's are reported.
    """
    logit_err = _max_error(cached_logits, reference_logits)
    bound = EXACT.bound(reference_logits)
    common: dict[str, Any] = dict(model=model, probe_tokens=probe_tokens, matched_tokens=matched_tokens,
                  max_logit_error=logit_err, logit_bound=bound)
    if matched_tokens != expected_match:
        return CanaryReport(**common, restored_exact=False,
                            failure=f"store -> lookup matched {matched_tokens} of {expected_match} stored tokens")
    exact = compare_states(spec, in_memory, restored, EXACT)
    if exact is not None:
        return CanaryReport(**common, restored_exact=False, mismatch=exact,
                            failure=f"{exact.group}: restored cache differs from the in-memory cache it was stored "
                                    f"from at layer {exact.layer} ({exact.kind}): {exact.detail}")
    drift = compare_states(spec, reference_states, continued_states, EXACT)
    if drift is not None:
        return CanaryReport(**common, restored_exact=True, mismatch=drift,
                            failure=f"{drift.group}: cached continuation differs from a plain prefill at layer "
                                    f"{drift.layer} ({drift.kind}): {drift.detail} (logit error {logit_err:.3g})")
    if logit_err > bound:
        return CanaryReport(**common, restored_exact=True,
                            failure=f"output logits differ by {logit_err:.3g} (> {bound:.3g}) although every layer "
                                    f"group's state matched")
    if lossy is None:
        return CanaryReport(**common, restored_exact=True)
    common.update(codec=lossy.codec, restored_bound=lossy.bound,
                  restored_error=max_relative_error(in_memory, lossy.restored))
    if lossy.matched_tokens != matched_tokens:
        return CanaryReport(**common, restored_exact=True,
                            failure=f"restore through codec {lossy.codec} matched {lossy.matched_tokens} of "
                                    f"{matched_tokens} stored tokens")
    common.update(lossy_logit_error=_max_error(lossy.cached_logits, reference_logits),
                  lossy_greedy_agreement=_greedy_agreement(lossy.cached_logits, reference_logits))
    off = compare_states(spec, in_memory, lossy.restored, CanaryTolerance(0.0, lossy.bound))
    if off is not None:
        return CanaryReport(**common, restored_exact=True, mismatch=off,
                            failure=f"{off.group}: cache restored through codec {lossy.codec} differs from the "
                                    f"in-memory cache it was stored from by more than the codec's error bound "
                                    f"({lossy.bound:.3g} x max|KV|) at layer {off.layer} ({off.kind}): {off.detail}")
    return CanaryReport(**common, restored_exact=True)
