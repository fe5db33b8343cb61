"""The framework-free canary judge: tolerances, first differing layer, group naming, report."""

from __future__ import annotations

import pytest
import torch

from kvengine import AttachError, KVCategory
from kvengine.semantics import EXACT, AttentionPart, LayerSpec, ModelKVSpec, StatePart, compare_states
from kvengine.semantics.canary import judge


def hybrid_spec() -> ModelKVSpec:
    att = AttentionPart(category=KVCategory.FULL_ATTENTION, key_shape=(2, 4), value_shape=(2, 4), dtype=torch.float32)
    st = StatePart(kind="mamba2", conv_shapes=((8, 4),), recurrent_shapes=((2, 4, 4),), dtype=torch.float32)
    return ModelKVSpec(model_type="toy", architecture="toy", dtype=torch.float32, layers=(
        LayerSpec(index=0, layer_type="linear_attention", state=st),
        LayerSpec(index=1, layer_type="full_attention", attention=att),
        LayerSpec(index=2, layer_type="linear_attention", state=st),
    ))


def states(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        (0, "state"): [torch.randn(1, 8, 4, generator=g), torch.randn(1, 2, 4, 4, generator=g)],
        (1, "attention"): [torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g),
                           torch.tensor([5])],
        (2, "state"): [torch.randn(1, 8, 4, generator=g), torch.randn(1, 2, 4, 4, generator=g)],
    }


def test_identical_states_pass_exact():
    """Identical states compare exact: no mismatch."""
    assert compare_states(hybrid_spec(), states(), states(), EXACT) is None


def test_earliest_differing_layer_names_its_group():
    """Errors propagate forward: layer 1 (attention) differs first, so its group is named, not layer 2's."""
    got = states()
    got[(1, "attention")][0] = got[(1, "attention")][0] + 1.0
    got[(2, "state")][1] = got[(2, "state")][1] * 2
    miss = compare_states(hybrid_spec(), states(), got, EXACT)
    assert miss is not None and miss.layer == 1 and miss.group == "group 1 (full, layer 1)"


def test_length_bookkeeping_is_compared():
    """A differing length tensor is a mismatch, naming the tensor."""
    got = states()
    got[(1, "attention")][2] = torch.tensor([4])
    miss = compare_states(hybrid_spec(), states(), got, EXACT)
    assert miss is not None and "tensor 2" in miss.detail


def test_missing_tensor_is_a_mismatch():
    """A group with a tensor missing is a mismatch naming the group and how many tensors it has."""
    got = states()
    got[(0, "state")] = got[(0, "state")][:1]
    miss = compare_states(hybrid_spec(), states(), got, EXACT)
    assert miss is not None and miss.group == "group 0 (state, layers 0,2)" and "1 tensors" in miss.detail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_lossless_judge_is_bitwise(dtype):
    """The judge's reference is a plain run split at the same boundaries as the cached continuation, so an
    exact path is bitwise equal to it in every dtype: one ulp of difference in a continued state or in a
    logit is refused (no dtype tolerance), identical values pass."""
    spec = hybrid_spec()
    logits = torch.randn(3, 16).to(dtype)
    one_ulp = torch.nextafter(logits, torch.full_like(logits, float("inf")))
    common = dict(spec=spec, model="toy", probe_tokens=40, expected_match=32, matched_tokens=32,
                  in_memory=states(), restored=states(), reference_states=states(), reference_logits=logits)
    assert judge(continued_states=states(), cached_logits=logits.clone(), **common).passed
    off_logit = judge(continued_states=states(), cached_logits=one_ulp, **common)
    assert not off_logit.passed and "output logits differ" in (off_logit.failure or "")
    drifted = states()
    drifted[(2, "state")][1] = torch.nextafter(drifted[(2, "state")][1], torch.tensor(float("inf")))
    off_state = judge(continued_states=drifted, cached_logits=logits.clone(), **common)
    assert off_state.mismatch is not None and off_state.mismatch.layer == 2
    assert "cached continuation differs from a plain prefill at layer 2" in (off_state.failure or "")


def test_judge_reports_and_raises():
    """The judge passes an exact restore; a short match or differing output logits fail, raising with the reason."""
    spec = hybrid_spec()
    logits = torch.randn(3, 16)
    common = dict(spec=spec, model="toy", probe_tokens=40, expected_match=32, in_memory=states(), restored=states(),
                  reference_states=states(), continued_states=states(), reference_logits=logits)
    ok = judge(matched_tokens=32, cached_logits=logits.clone(), **common)
    assert ok.passed and ok.restored_exact
    ok.raise_if_failed()
    short = judge(matched_tokens=16, cached_logits=logits.clone(), **common)
    with pytest.raises(AttachError, match="matched 16 of 32"):
        short.raise_if_failed()
    off = judge(matched_tokens=32, cached_logits=logits + 1, **common)
    with pytest.raises(AttachError, match="output logits differ"):
        off.raise_if_failed()
