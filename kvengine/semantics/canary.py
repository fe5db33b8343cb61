"""The attach-time canary: is a cached continuation the same as a plain prefill?

An integration runs a short probe prompt twice: once as a plain prefill, once
as store -> fresh load -> continue. This module holds the framework-free
parts: tolerances per dtype, the per-layer state comparison that names the
first layer group whose state differs, and the report. It never decides to
"serve anyway": :meth:`CanaryReport.raise_if_failed` raises
:class:`~kvengine.errors.AttachError`.

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
    """``|got - want| <= atol + rtol * max|want|`` element-wise maximum."""

    atol: float
    rtol: float

    def bound(self, want: torch.Tensor) -> float:
        if not want.numel() or not want.is_floating_point():
            return self.atol
        scale = float(want.abs().max())
        return self.atol + self.rtol * scale


EXACT = CanaryTolerance(0.0, 0.0)

# A cached continuation differs from a plain prefill only by rounding: the restored cache is bitwise
# equal to the one stored (checked separately), and the suffix runs as a separate, shorter forward
# (stateful families also prefill in chunk-sized pieces), which changes accumulation order. Measured
# worst logit errors over the 14 families of the exactness matrix (AVX-512 bf16 CPU): fp32 1.4e-6
# (GraniteMoeHybrid; 0 for most attention-only families); bf16 0.0156 = 1 ulp at logit magnitude 4
# (Mistral). On AVX2 machines Qwen3-Next's split prefill was seen at 1.4e-5 in fp32. The bounds below
# leave about 2x that in fp32 (2e-5 + 2e-6 * max|logit|) and about 2 ulp in 16-bit floats.
_TOLERANCES = {
    torch.float32: CanaryTolerance(2e-5, 2e-6),
    torch.float64: CanaryTolerance(1e-10, 1e-10),
    torch.float16: CanaryTolerance(4e-3, 2e-3),
    torch.bfloat16: CanaryTolerance(3.2e-2, 1.6e-2),
}


def tolerance_for(dtype: torch.dtype) -> CanaryTolerance:
    """Tolerance for outputs computed in ``dtype`` (different accumulation order only)."""
    try:
        return _TOLERANCES[dtype]
    except KeyError:
        raise AttachError(f"no canary tolerance for dtype {dtype}") from None


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

    @property
    def passed(self) -> bool:
        return self.failure is None

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise AttachError(f"attach canary failed for {self.model!r}: {self.failure}; nothing will be served")


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
) -> CanaryReport:
    """Turn the canary's measurements into a report (first failing check wins).

    1. the lookup matched the stored prefix;
    2. the restored cache equals, bit for bit, the in-memory cache it was stored from;
    3. after continuing, every layer's state is within tolerance of a plain prefill's;
    4. the continuation's logits are within tolerance of the plain prefill's.
    """
    tol = tolerance_for(spec.dtype)
    logit_err = _max_error(cached_logits, reference_logits)
    bound = tol.bound(reference_logits)
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
    drift = compare_states(spec, reference_states, continued_states, tol)
    if drift is not None:
        return CanaryReport(**common, restored_exact=True, mismatch=drift,
                            failure=f"{drift.group}: cached continuation differs from a plain prefill at layer "
                                    f"{drift.layer} ({drift.kind}): {drift.detail} (logit error {logit_err:.3g})")
    if logit_err > bound:
        return CanaryReport(**common, restored_exact=True,
                            failure=f"output logits differ by {logit_err:.3g} (> {bound:.3g}) although every layer "
                                    f"group's state matched")
    return CanaryReport(**common, restored_exact=True)
