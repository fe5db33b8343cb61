"""Blending (issue 38, second part): prompts assembled from segments whose KV was computed alone, with
selective recompute (EPIC's first tokens, CacheBlend's most deviating tokens). Exact where the budget says
it must be, approximate (and labelled so) where it is not."""

from __future__ import annotations

import pytest
import torch

from kvengine.errors import UnsupportedModelError
from kvengine.integrations.hf.blending import Blender, RecomputeBudget, Segment, encode_segment
from kvengine.integrations.hf.layerwise import LayerwiseForward
from kvengine.integrations.hf.tiny_models import build_tiny

ATOL = 2e-4


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def full_prefill(model, parts) -> torch.Tensor:
    """The logits after the whole prompt, computed in one pass (the reference)."""
    prompt = torch.cat([p.ids if isinstance(p, Segment) else p for p in parts], dim=1)
    with torch.no_grad():
        return model(prompt).logits[0, -1]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return build_tiny(request.param)


@pytest.fixture(scope="module")
def blender(model):
    return Blender(model)


def blend(model, parts, **budget):
    return Blender(model).blend(parts, RecomputeBudget(**budget))


def test_a_segment_recomputed_whole_is_exact_and_labelled_so(model):
    doc = encode_segment(model, ids(20, 1))
    parts = [ids(9, 2), doc, ids(6, 3)]
    result = blend(model, parts, first=doc.length)
    assert (result.approximate_tokens, result.recomputed_tokens, result.tokens) == (0, 20, 35)
    torch.testing.assert_close(result.logits, full_prefill(model, parts), atol=ATOL, rtol=0)


def test_a_segment_at_the_start_is_a_prefix_and_exact_without_recompute(model):
    doc = encode_segment(model, ids(20, 1))
    parts = [doc, ids(6, 3)]
    result = blend(model, parts, first=0)
    assert result.approximate_tokens == 20  # labelled by the rule, though the start is where it is exact
    torch.testing.assert_close(result.logits, full_prefill(model, parts), atol=ATOL, rtol=0)


def test_segments_behind_other_tokens_are_approximate_and_recompute_narrows_the_gap(model):
    """Two documents behind an instruction, in either order: without recompute the logits differ from a full
    prefill; recomputing each document's first tokens (EPIC) brings them closer; recomputing all is exact."""
    a, b = encode_segment(model, ids(20, 1)), encode_segment(model, ids(16, 4))
    for order in ([a, b], [b, a]):
        parts = [ids(9, 2), *order, ids(6, 3)]
        reference = full_prefill(model, parts)
        gaps = {}
        for k in (0, 4, 20):
            result = blend(model, parts, first=k)
            assert result.approximate_tokens == sum(max(0, s.length - k) for s in order)
            gaps[k] = (result.logits - reference).abs().max().item()
        assert gaps[0] > 100 * ATOL, gaps  # reused behind other tokens: not exact
        assert gaps[4] < gaps[0], gaps
        assert gaps[20] < ATOL, gaps


def test_the_cache_continues_generation_from_the_blended_prompt(model):
    """The blended cache is an ordinary cache: the next token's logits after it, computed on top, equal a full
    prefill's where the blend is exact."""
    doc = encode_segment(model, ids(20, 1))
    parts = [ids(9, 2), doc, ids(6, 3)]
    result = blend(model, parts, first=doc.length)
    nxt = result.logits.argmax().view(1, 1)
    with torch.no_grad():
        after = model(nxt, position_ids=torch.tensor([[result.tokens]]), past_key_values=result.cache).logits[0, -1]
    torch.testing.assert_close(after, full_prefill(model, [*parts, nxt]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family, reason", [("mistral", "SLIDING_WINDOW"), ("gemma2", "SLIDING_WINDOW"),
                                            ("falcon_h1", "recurrent state")])
def test_models_that_cannot_blend_are_refused_by_name(family, reason):
    tiny = build_tiny(family)
    with pytest.raises(UnsupportedModelError, match=reason):
        blend(tiny, [ids(4, 1)], first=0)


def test_malformed_parts_are_refused():
    tiny = build_tiny("llama")
    doc = encode_segment(tiny, ids(8, 1))
    with pytest.raises(ValueError, match="last part"):
        blend(tiny, [ids(4, 2), doc], first=0)
    with pytest.raises(ValueError, match="first must be >= 0"):
        RecomputeBudget(first=-1)
    with pytest.raises(ValueError, match=r"deviating must be a fraction in \[0, 1\]"):
        RecomputeBudget(deviating=1.5)
    with pytest.raises(ValueError, match="check_layer 2 is not before the last"):
        blend(tiny, [doc, ids(4, 2)], deviating=0.5, check_layer=tiny.config.num_hidden_layers)


def test_cacheblend_recomputes_the_most_deviating_tokens_and_labels_the_rest(model):
    """CacheBlend's rule: every token computed up to the check layer, then the fraction of segment tokens
    whose KV deviates most. All of them is exact; a half is closer than none; the count is what was asked."""
    a, b = encode_segment(model, ids(20, 1)), encode_segment(model, ids(16, 4))
    parts = [ids(9, 2), a, b, ids(6, 3)]
    reference = full_prefill(model, parts)
    gaps = {}
    for fraction in (0.0, 0.5, 1.0):
        result = blend(model, parts, deviating=fraction)
        assert result.recomputed_tokens == round(fraction * 36) and result.approximate_tokens == 36 - round(fraction * 36)
        gaps[fraction] = (result.logits - reference).abs().max().item()
    assert gaps[1.0] < ATOL and gaps[0.5] < gaps[0.0], gaps
    both = blend(model, parts, first=4, deviating=0.25)  # EPIC's first tokens, then a quarter of the rest
    assert both.recomputed_tokens == 8 + round(0.25 * 28)


def test_every_token_recomputed_in_one_pass_equals_a_full_prefill_cache(model, blender):
    """The blended cache is the full prefill's, layer by layer, when the budget recomputes everything."""
    doc = encode_segment(model, ids(20, 1))
    parts = [ids(9, 2), doc, ids(6, 3)]
    result = blender.blend(parts, RecomputeBudget(deviating=1.0, check_layer=0))
    with torch.no_grad():
        full = model(torch.cat([ids(9, 2), doc.ids, ids(6, 3)], dim=1), use_cache=True).past_key_values
    for got, want in zip(result.cache.layers, full.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=ATOL, rtol=0)


def test_a_budget_covers_another_only_by_the_same_rules():
    assert RecomputeBudget(first=8, deviating=0.2).covers(RecomputeBudget(first=8))
    assert not RecomputeBudget(first=4).covers(RecomputeBudget(first=8))
    assert not RecomputeBudget(deviating=0.1).covers(RecomputeBudget(deviating=0.2))
    assert not RecomputeBudget(deviating=0.2, check_layer=2).covers(RecomputeBudget(deviating=0.2))


def test_a_model_whose_forward_the_layer_loop_does_not_reproduce_is_refused():
    """A step the loop does not know (here a hook scaling the decoder's output, as an embedding or output
    scale would) makes the proof fail: the model is refused, not blended wrong."""
    tiny = build_tiny("llama")
    LayerwiseForward(tiny)  # proved as built
    tiny.model.register_forward_hook(lambda module, args, out: out.__class__(last_hidden_state=out[0] * 1.5,
                                                                             past_key_values=out[1]))
    with pytest.raises(UnsupportedModelError, match="llama: running its layers one at a time differs from its "
                                                    "forward by"):
        LayerwiseForward(tiny)
