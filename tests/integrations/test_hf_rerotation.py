"""Position fix-up (issue 38): a segment's keys cached at its own positions, moved ``delta`` later, equal the
keys the model computes for the segment placed there, for every RoPE variant and family kvengine calls
shiftable; everything else is refused by name."""

from __future__ import annotations

import pytest
import torch

from kvengine.errors import UnsupportedModelError
from kvengine.integrations.hf.rerotation import KeyShifter
from kvengine.integrations.hf.tiny_models import build_tiny, rescale_
from kvengine.semantics.rerotation import SHIFTABLE_ROPE, rope_verdict, rotate

SEGMENT = 24
#: fp32 keys of unit scale: float error of angles up to ~1000 positions, far below any real difference
ATOL = 2e-4

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
}


def cached(model, ids: torch.Tensor, offset: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values the model caches for ``ids`` alone at positions ``offset..``."""
    positions = torch.arange(offset, offset + ids.shape[1])[None]
    with torch.no_grad():
        cache = model(ids, position_ids=positions, use_cache=True).past_key_values
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def check_moves(model, deltas=(5, 333, 900)) -> None:
    shifter = KeyShifter(model)
    ids = torch.randint(0, 256, (1, SEGMENT), generator=torch.Generator().manual_seed(1))
    keys, values = cached(model, ids, 0)
    for delta in deltas:
        want_keys, want_values = cached(model, ids, delta)
        for a, b in zip(values, want_values):  # the premise: nothing but the keys' rotation depends on position
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        moved = shifter.shift(keys, delta)
        for layer, (got, want, before) in enumerate(zip(moved, want_keys, keys)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, d=delta, i=layer: f"delta {d}, layer {i}: {m}")
            assert (before - want).abs().max() > 100 * ATOL  # unmoved keys are far off: the check can fail


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_llama_keys_move_exactly_under_every_shiftable_rope_variant(rope):
    assert rope in SHIFTABLE_ROPE
    check_moves(build_tiny("llama", rope_parameters=ROPES[rope]))


def build_partial_rotary(model_type: str):
    """A tiny random model of a family outside the exactness matrix, rotating half of each head's dims."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    rescale_(model, seed=0)
    return model.eval()


def test_partial_rotary_keys_move_exactly():
    """Phi-3 with a partial rotary factor rotates the first half of each head's dims (rotate-half layout)."""
    model = build_partial_rotary("phi3")
    assert model.model.rotary_emb.inv_freq.numel() * 2 < model.config.head_dim  # partial, as intended
    check_moves(model)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma2", "gemma3"])
def test_keys_move_exactly_in_families_with_key_norms_windows_local_global_bases_and_partial_rotary(family):
    """Qwen3 normalizes keys before rotating them; Mistral and Gemma2 have sliding windows (the cache keeps the
    window's last keys, moved alike); Gemma3's local and global layers rotate with different bases; this Phi-3
    rotates half of each head's dimensions (partial rotary)."""
    check_moves(build_tiny(family))


@pytest.mark.parametrize("family, reason", [
    ("gpt2", "absolute"),
    ("deepseek_v2", "MLA_LATENT caches are not proved"),
    ("falcon_h1", "recurrent state"),
])
def test_models_whose_cache_cannot_move_are_refused_by_name(family, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        KeyShifter(build_tiny(family))


def test_rope_variants_not_proved_are_refused_by_name():
    assert "sequence length" in (rope_verdict("dynamic") or "")
    assert "not proved" in (rope_verdict("su") or "")
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        KeyShifter(build_tiny("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                        "factor": 2.0}))


def test_partial_rotary_turns_only_the_rotary_dims_and_a_full_turn_is_the_identity():
    keys = torch.randn(1, 2, 3, 8)
    angle = torch.tensor([0.3, 1.1])
    turned = rotate(keys, torch.cos(angle).repeat(2), torch.sin(angle).repeat(2))
    torch.testing.assert_close(turned[..., 4:], keys[..., 4:], atol=0, rtol=0)
    assert (turned[..., :4] - keys[..., :4]).abs().max() > 0.01
    back = rotate(turned, torch.cos(-angle).repeat(2), torch.sin(-angle).repeat(2))
    torch.testing.assert_close(back, keys, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="rotary dims"):
        rotate(keys, torch.ones(10), torch.zeros(10))


def test_a_rotary_layout_other_than_rotate_half_fails_the_proof_and_is_refused():
    """GLM-4 rotates interleaved pairs of dimensions: its RoPE type is "default", its family is registered,
    and moving its keys as rotate-half would silently give wrong keys. The shifter's own proof on the model
    catches it."""
    with pytest.raises(UnsupportedModelError, match=r"glm4: a probe's keys moved 37 positions differ from the keys "
                                                    r"the model computes there by \d"):
        KeyShifter(build_partial_rotary("glm4"))
