"""Segments cached once and reused at any position (issue 38, third part), through a real engine: the cache
supplies a segment's whole chunks wherever it stands, blends are exact where fully recomputed and counted
approximate where not, and segment KV and exact KV never meet."""

from __future__ import annotations

import pytest
import torch

from kvengine.errors import AttachError, UnsupportedModelError
from kvengine.integrations.hf import Sampling, attach
from kvengine.integrations.hf.blending import RecomputeBudget
from kvengine.integrations.hf.segments import SegmentCache, SegmentRef, segment_namespace

from .conftest import CHUNK, build_tiny, make_engine, reference_generate

ATOL = 2e-4


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(seed))


def full_prefill(model, parts) -> torch.Tensor:
    prompt = torch.cat([p.ids if isinstance(p, SegmentRef) else p for p in parts])
    with torch.no_grad():
        return model(prompt[None]).logits[0, -1]


@pytest.fixture
def segments(tiny_llama):
    engine = make_engine()
    try:
        yield SegmentCache(attach(tiny_llama, engine), budget=RecomputeBudget(first=2), quality_bound=0.05)
    finally:
        engine.close()


def test_a_segment_is_computed_once_and_its_chunks_reused_wherever_it_stands(segments, tiny_llama):
    doc = SegmentRef(ids(2 * CHUNK + 5, 1))
    first = [ids(9, 2), doc, ids(6, 3)]
    result = segments.blend(first, budget=RecomputeBudget(first=doc.ids.shape[0]))
    assert result.cached_tokens == 0 and result.reused_tokens_approximate == 0
    torch.testing.assert_close(result.blend.logits, full_prefill(tiny_llama, first), atol=ATOL, rtol=0)
    elsewhere = [ids(23, 4), ids(6, 5), doc, ids(7, 6)]  # another position, another context
    again = segments.blend(elsewhere, budget=RecomputeBudget(first=doc.ids.shape[0]))
    assert again.cached_tokens == 2 * CHUNK  # its whole chunks, from the cache
    torch.testing.assert_close(again.blend.logits, full_prefill(tiny_llama, elsewhere), atol=ATOL, rtol=0)
    cheap = segments.blend(elsewhere)  # the cache's budget: its first 2 tokens recomputed
    assert cheap.cached_tokens == 2 * CHUNK and cheap.reused_tokens_approximate == doc.ids.shape[0] - 2
    assert (cheap.blend.logits - full_prefill(tiny_llama, elsewhere)).abs().max() > 100 * ATOL  # approximate
    metrics = segments.attached.engine.metrics
    assert metrics.value("kvengine_reused_tokens_approximate_total", model=segments.attached.namespace.model) \
        == cheap.reused_tokens_approximate  # the exact blends above counted none
    with pytest.raises(ValueError, match=r"recompute budget \(first 1\) is below the budget the blend canary measured \(first 2\)"):
        segments.blend(elsewhere, budget=RecomputeBudget(first=1))


def test_the_blend_canary_measures_the_budget_and_refuses_a_model_over_the_users_bound(tiny_llama):
    engine = make_engine()
    try:
        attached = attach(tiny_llama, engine)
        whole = SegmentCache(attached, budget=RecomputeBudget(first=64), quality_bound=1e-6)  # recomputed whole
        assert whole.canary.kl < 1e-6 and whole.canary.same_top1
        budget = SegmentCache(attached, budget=RecomputeBudget(first=0), quality_bound=1.0)
        assert budget.canary.kl > 1e-4  # reused behind other tokens without recompute: measurably off
        with pytest.raises(AttachError, match=r"blend canary: with recompute budget \(first 0\), the next-token.*over the bound"):
            SegmentCache(attached, budget=RecomputeBudget(first=0), quality_bound=budget.canary.kl / 2)
    finally:
        engine.close()


def test_segment_kv_and_exact_kv_never_meet(segments):
    """An exact lookup of a cached segment's tokens finds nothing, and a segment whose tokens were stored as
    an exact prefix is computed, not served that prefix's KV."""
    attached, engine = segments.attached, segments.attached.engine
    doc = ids(3 * CHUNK, 7)
    segments.segment(doc)
    exact = engine.lookup(attached.binding, "exact-reader", doc)
    assert exact.tokens == 0
    engine.release(exact)
    prefix = ids(3 * CHUNK + 1, 8)
    attached.generate(prefix, max_new_tokens=1)  # stores the prompt's whole chunks as exact KV
    exact = engine.lookup(attached.binding, "exact-again", prefix)
    assert exact.tokens == 3 * CHUNK
    engine.release(exact)
    _, cached = segments.segment(prefix)
    assert cached == 0
    assert segments.binding.digest != attached.binding.digest
    assert segment_namespace(attached.namespace) == segments.binding.namespace


def test_a_model_that_cannot_blend_is_refused_by_name():
    engine = make_engine()
    try:
        with pytest.raises(UnsupportedModelError, match="SLIDING_WINDOW"):
            SegmentCache(attach(build_tiny("mistral"), engine))
    finally:
        engine.close()


def test_generation_after_an_exact_blend_equals_plain_greedy_generation(segments, tiny_llama):
    doc = SegmentRef(ids(2 * CHUNK + 5, 1))
    parts = [ids(9, 2), doc, ids(6, 3)]
    segments.segment(doc.ids)  # cached: the blend restores its chunks
    run = segments.generate(parts, max_new_tokens=8, budget=RecomputeBudget(first=doc.ids.shape[0]))
    assert run.reused_tokens_approximate == 0 and run.prompt.cached_tokens == 2 * CHUNK
    prompt = torch.cat([p.ids if isinstance(p, SegmentRef) else p for p in parts])
    assert run.tokens == reference_generate(tiny_llama, prompt, None, 8)


def test_sampled_generation_after_an_exact_blend_equals_the_attached_models_and_stops_at_eos(segments):
    """Sampling and stopping follow ``AttachedModel.generate``: the same seed draws the same tokens after an
    exact blend, and an end-of-sequence token ends the answer."""
    doc = SegmentRef(ids(CHUNK + 3, 9))
    parts = [ids(5, 2), doc, ids(4, 3)]
    exact = RecomputeBudget(first=doc.ids.shape[0])
    sampling = Sampling(temperature=0.9, top_k=40, seed=11)
    run = segments.generate(parts, max_new_tokens=10, sampling=sampling, eos_token_id=None, budget=exact)
    prompt = torch.cat([p.ids if isinstance(p, SegmentRef) else p for p in parts])
    plain = segments.attached.generate(prompt, max_new_tokens=10, sampling=sampling, eos_token_id=None,
                                       use_cache=False, store=False)
    assert run.tokens == list(plain.new_tokens) and len(run.tokens) == 10
    greedy = segments.generate(parts, max_new_tokens=10, eos_token_id=None, budget=exact).tokens
    assert run.tokens != greedy  # it did sample
    stop = segments.generate(parts, max_new_tokens=10, eos_token_id=greedy[2], budget=exact).tokens
    assert stop == greedy[: greedy.index(greedy[2]) + 1]
