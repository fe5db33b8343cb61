"""Spec derivation from transformers configs: groups, shapes, bytes, layouts, fingerprints."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvengine import KVCategory, UnsupportedModelError
from kvengine.integrations.hf.tiny_models import TINY_CONFIGS
from kvengine.semantics import derive_spec, known_model_types


def cfg(family: str):
    from transformers import AutoConfig

    model_type, kwargs, _ = TINY_CONFIGS[family]
    return AutoConfig.for_model(model_type, **kwargs)


def test_gqa_llama_bytes_and_layout():
    """Llama GQA: 2 layers x (K+V) x 2 kv heads x 16 dims x fp32 per token; K/V per layer, token dim 1."""
    spec = derive_spec(cfg("llama"))
    assert [g.category for g in spec.groups] == [KVCategory.FULL_ATTENTION]
    assert spec.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert spec.bytes_per_boundary == 0
    layout = spec.layout(16)
    assert [t.name for t in layout.tensors] == ["g0.l0.k", "g0.l0.v", "g0.l1.k", "g0.l1.v"]
    assert all(t.shape == (2, 16, 16) and t.token_dim == 1 for t in layout.tensors)
    assert layout.nbytes() == 16 * spec.bytes_per_token


def test_gpt2_is_mha():
    """GPT-2 is multi-head attention: its key shape is every head (4) x head dim (16)."""
    spec = derive_spec(cfg("gpt2"))
    assert spec.groups[0].part.key_shape == (4, 16)


def test_sliding_and_global_layers_form_separate_groups():
    """Gemma3: windowed layers (window 12) and the global layer are different groups with different plans."""
    spec = derive_spec(cfg("gemma3"))
    sliding, full = spec.groups
    assert sliding.category is KVCategory.SLIDING_WINDOW and sliding.layers == (0, 1)
    assert sliding.part.window == 12 and "last 11 tokens" in sliding.reuse_plan(16)
    assert full.category is KVCategory.FULL_ATTENTION and full.layers == (2,)
    assert spec.max_window == 12


def test_mistral_all_layers_sliding():
    """Mistral: every layer is sliding-window, so the spec has one sliding-window group."""
    spec = derive_spec(cfg("mistral"))
    assert [g.category for g in spec.groups] == [KVCategory.SLIDING_WINDOW]


def test_mla_latent_keys_and_values_have_different_widths():
    """DeepSeek MLA stores the compressed latent (32) and the RoPE key (8), one 'head' each."""
    spec = derive_spec(cfg("deepseek_v3"))
    (g,) = spec.groups
    assert g.category is KVCategory.MLA_LATENT
    assert g.part.key_shape == (1, 32) and g.part.value_shape == (1, 8)
    assert spec.bytes_per_token == 2 * (32 + 8) * 4


def test_interleaved_hybrid_groups_state_and_attention_layers():
    """Qwen3-Next: gated-delta-net state on layers 0,2, full attention on 1,3; state bytes per boundary."""
    spec = derive_spec(cfg("qwen3_next"))
    state, attn = spec.groups
    assert state.category is KVCategory.LINEAR_STATE and state.layers == (0, 2)
    assert state.part.conv_shapes == ((2 * 32 + 64, 4),) and state.part.recurrent_shapes == ((4, 16, 16),)
    assert attn.layers == (1, 3)
    assert spec.stateful and spec.bytes_per_boundary == 2 * (128 * 4 + 4 * 16 * 16) * 4
    layout = spec.layout(16)
    assert {t.token_dim for t in layout.tensors if t.category is KVCategory.LINEAR_STATE} == {None}


def test_parallel_hybrid_layer_is_in_two_groups():
    """Falcon-H1: every layer has attention K/V and a Mamba2 state side by side."""
    spec = derive_spec(cfg("falcon_h1"))
    attn, state = spec.groups
    assert attn.layers == state.layers == (0, 1)
    assert spec.group_of(0, "attention") is attn and spec.group_of(0, "state") is state


def test_mamba2_has_only_boundary_state():
    """Mamba2: no bytes per token; one group of conv and recurrent state of the derived shapes."""
    spec = derive_spec(cfg("mamba2"))
    (g,) = spec.groups
    assert spec.bytes_per_token == 0
    assert g.part.conv_shapes == ((128 + 2 * 16, 4),) and g.part.recurrent_shapes == ((8, 16, 16),)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_cross_attention_is_not_in_chunks(family):
    """Cross-attention groups exist in the spec but not in the chunk layout (keyed by encoder input)."""
    spec = derive_spec(cfg(family))
    assert spec.encoder_decoder
    assert [g.category for g in spec.groups] == [KVCategory.FULL_ATTENTION, KVCategory.CROSS_ATTENTION]
    assert all(t.category is KVCategory.FULL_ATTENTION for t in spec.layout(16).tensors)


def test_fingerprint_is_stable_and_tracks_meaning():
    """Same config -> same fingerprint; dtype or window change -> different fingerprint."""
    a, b = derive_spec(cfg("mistral")), derive_spec(cfg("mistral"))
    assert a.fingerprint == b.fingerprint
    assert derive_spec(cfg("mistral"), dtype=torch.bfloat16).fingerprint != a.fingerprint
    other = cfg("mistral")
    other.sliding_window = 13
    assert derive_spec(other).fingerprint != a.fingerprint


def test_encoder_only_layout_is_refused():
    """An encoder-only model (BERT) derives a spec marked encoder-only, but asking it for a layout is refused."""
    from transformers import AutoConfig

    spec = derive_spec(AutoConfig.for_model("bert"))
    assert spec.encoder_only
    with pytest.raises(UnsupportedModelError, match="encoder-only"):
        spec.layout(16)


def test_tested_families_are_registered():
    """Every family of the exactness matrix is marked as tested in the registry."""
    fams = known_model_types()
    for family, (model_type, _, _) in TINY_CONFIGS.items():
        assert fams[model_type].tested, family
