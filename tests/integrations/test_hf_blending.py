"""Blending (issue 38, second part): prompts assembled from segments whose KV was computed alone, with EPIC's
selective recompute. Exact where the rule says it must be, approximate (and labelled so) where it is not."""

from __future__ import annotations

import pytest
import torch

from kvengine.errors import UnsupportedModelError
from kvengine.integrations.hf.blending import Segment, blend, encode_segment
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


def test_a_segment_recomputed_whole_is_exact_and_labelled_so(model):
    doc = encode_segment(model, ids(20, 1))
    parts = [ids(9, 2), doc, ids(6, 3)]
    result = blend(model, parts, recompute_first=doc.length)
    assert (result.approximate_tokens, result.recomputed_tokens, result.tokens) == (0, 20, 35)
    torch.testing.assert_close(result.logits, full_prefill(model, parts), atol=ATOL, rtol=0)


def test_a_segment_at_the_start_is_a_prefix_and_exact_without_recompute(model):
    doc = encode_segment(model, ids(20, 1))
    parts = [doc, ids(6, 3)]
    result = blend(model, parts, recompute_first=0)
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
            result = blend(model, parts, recompute_first=k)
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
    result = blend(model, parts, recompute_first=doc.length)
    nxt = result.logits.argmax().view(1, 1)
    with torch.no_grad():
        after = model(nxt, position_ids=torch.tensor([[result.tokens]]), past_key_values=result.cache).logits[0, -1]
    torch.testing.assert_close(after, full_prefill(model, [*parts, nxt]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family, reason", [("mistral", "SLIDING_WINDOW"), ("gemma2", "SLIDING_WINDOW"),
                                            ("falcon_h1", "recurrent state")])
def test_models_that_cannot_blend_are_refused_by_name(family, reason):
    tiny = build_tiny(family)
    with pytest.raises(UnsupportedModelError, match=reason):
        blend(tiny, [ids(4, 1)], recompute_first=0)


def test_malformed_parts_are_refused():
    tiny = build_tiny("llama")
    doc = encode_segment(tiny, ids(8, 1))
    with pytest.raises(ValueError, match="last part"):
        blend(tiny, [ids(4, 2), doc], recompute_first=0)
    with pytest.raises(ValueError, match="recompute_first"):
        blend(tiny, [doc, ids(4, 2)], recompute_first=-1)
