"""Provenance checks (kvengine.trust.provenance): KV comparison, shadow sampling, the namespace canary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvengine import KVEngine, Namespace
from kvengine.config import ShadowConfig
from kvengine.trust.provenance import CanaryOutcome, ShadowSampler, check_namespace_canary, compare_kv, kv_tolerance

from ..conftest import CHUNK, make_layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_comparison_tells_exact_from_rounding_from_wrong(dtype):
    """Bitwise equal is exact; a few ulp (another accumulation order) is close; 1% off is a mismatch."""
    want = torch.randn(2, 4, 16, 8).to(dtype)
    assert compare_kv([want.clone()], [want]).outcome == "exact"
    ulp = torch.finfo(dtype).eps * float(want.abs().max())
    nudged = (want.float() + ulp).to(dtype)
    assert compare_kv([nudged], [want]).outcome == "close"
    assert compare_kv([want * 1.05], [want]).outcome == "mismatch"
    tol = kv_tolerance(dtype)
    assert tol is not None and compare_kv([nudged], [want]).max_relative_error <= tol


def test_bytes_compare_bitwise_and_shapes_must_agree():
    """Bytes have no tolerance: a flipped bit, another shape, another tensor count or NaN vs zero is a mismatch."""
    raw = torch.randint(0, 255, (64,), dtype=torch.uint8)
    other = raw.clone()
    other[3] ^= 1
    assert kv_tolerance(torch.uint8) is None
    assert compare_kv([other], [raw]).outcome == "mismatch"
    assert compare_kv([raw.view(8, 8)], [raw]).outcome == "mismatch"
    assert compare_kv([raw], [raw, raw]).outcome == "mismatch"
    assert compare_kv([torch.full((4,), float("nan"))], [torch.zeros(4)]).outcome == "mismatch"


def test_shadow_sampling_takes_the_first_hits_per_namespace_then_a_fraction():
    """Shadow checks take the first hits of each root namespace (salts share one), none by default, then a
    seeded, reproducible fraction."""
    layout = make_layout()
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 1 << 20}}) as eng:
        a = eng.bind(Namespace(model="a"), layout)
        a_salted = eng.bind(Namespace(model="a", cache_salt="t"), layout)
        b = eng.bind(Namespace(model="b"), layout)
    sampler = ShadowSampler(ShadowConfig(first_hits=2))
    assert [sampler.pick(a), sampler.pick(a_salted), sampler.pick(a)] == [True, True, False]  # one root
    assert sampler.pick(b)
    assert not ShadowSampler(ShadowConfig()).pick(a)
    picks = [ShadowSampler(ShadowConfig(fraction=0.25, seed=7)) for _ in range(2)]
    runs = [[s.pick(a) for _ in range(400)] for s in picks]
    assert runs[0] == runs[1] and 60 <= sum(runs[0]) <= 140  # seeded, about a quarter


def probe(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, CHUNK, 4, generator=g) for _ in range(2)]


def test_the_first_writer_leaves_a_canary_that_later_readers_check(tmp_path: Path):
    """Written once on the disk tier; the same KV is exact, KV within rounding is close, other KV is a
    mismatch that quarantines the namespace (and a memory-only engine has nothing to prove)."""
    layout = make_layout()
    ns = Namespace(model="m", model_fingerprint="w")
    config = {"chunk_size": CHUNK, "memory": {"capacity_bytes": 1 << 20}, "write_mode": "write_through",
              "disk": {"path": str(tmp_path), "fsync": "never"}}
    with KVEngine(config) as eng:
        assert check_namespace_canary(eng, eng.bind(ns, layout), probe()).outcome is CanaryOutcome.WRITTEN
    with KVEngine(config) as eng:
        binding = eng.bind(ns, layout)
        assert check_namespace_canary(eng, binding, probe()).outcome is CanaryOutcome.EXACT
        nudged = [t + 1e-7 * t.abs().max() for t in probe()]
        assert check_namespace_canary(eng, binding, nudged).outcome is CanaryOutcome.CLOSE
        result = check_namespace_canary(eng, binding, probe(seed=1))
        assert result.outcome is CanaryOutcome.MISMATCH and not result.serving
        assert eng.is_quarantined(binding)
        assert check_namespace_canary(eng, binding, probe()).outcome is CanaryOutcome.QUARANTINED
        assert eng.metrics.value("kvengine_provenance_checks_total", check="canary", outcome="mismatch") == 1
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 1 << 20}}) as eng:
        assert check_namespace_canary(eng, eng.bind(ns, layout), probe()).outcome is CanaryOutcome.NOT_PERSISTENT


def test_a_check_that_compared_nothing_counts_as_skipped_never_as_exact():
    """Regression: the HF shadow check counted a hit with no chunk left to compare as ``exact`` (vLLM
    counted it as skipped). ``settle`` now takes no comparison as no evidence: counted ``skipped``, no
    quarantine; a mismatch still quarantines."""
    from kvengine.trust.provenance import settle, worst

    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"}}) as engine:
        binding = engine.bind(Namespace(model="m"), make_layout())
        settle(engine, binding, "shadow", worst([]), "unused")
        assert engine.metrics.value("kvengine_provenance_checks_total", check="shadow", outcome="skipped") == 1
        assert engine.metrics.value("kvengine_provenance_checks_total", check="shadow", outcome="exact") == 0
        assert not engine._core.is_quarantined(binding)
        a = torch.zeros(4)
        settle(engine, binding, "shadow", compare_kv([a], [a + 1]), "differs")
        assert engine._core.is_quarantined(binding)
