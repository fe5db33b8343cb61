"""Refused families, features and requests: each raises with its reason, never warns and continues.

Refused on purpose (also listed in docs/kv_semantics.md):

* zamba2 / zamba - shared transformer blocks break the per-layer cache contract;
* bamba - config cannot be built from a dict in transformers 5.19, cache never validated;
* deepseek_v32 - sparse-attention indexer cache not snapshotted;
* gemma3n (num_kv_shared_layers > 0) - layers share another layer's KV;
* minimax, rwkv, xlstm, recurrent_gemma - state outside transformers' Cache classes;
* encoder-only models (BERT, ...) - nothing to store;
* dynamic / LongRoPE scaling - cached keys depend on the computing request's length;
* multimodal configs - placeholder ids do not identify the media;
* any model_type not in the registry;
* batch size > 1 in the HF integration.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvengine import InvalidRequestError, UnsupportedModelError
from kvengine.integrations.hf import attach
from kvengine.semantics import REFUSED_FAMILIES, derive_spec

from .conftest import build_tiny, make_engine


def _config(model_type: str, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kw)


@pytest.mark.parametrize("model_type", ["zamba2", "deepseek_v32", "minimax", "recurrent_gemma"])
def test_refused_family_names_itself_and_the_reason(model_type):
    """Scenario: a family refused on purpose raises with its registry reason."""
    with pytest.raises(UnsupportedModelError, match=f"'{model_type}' is refused") as info:
        derive_spec(_config(model_type))
    assert REFUSED_FAMILIES[model_type] in str(info.value)


@pytest.mark.parametrize("model_type", ["gpt_neox", "opt", "bloom"])
def test_unknown_family_is_refused_by_name(model_type):
    """Scenario: a model_type the registry has no rule for is never stored 'best effort'."""
    with pytest.raises(UnsupportedModelError, match=f"model_type '{model_type}'.*not in kvengine's KV semantics"):
        derive_spec(_config(model_type))


def test_encoder_only_model_is_refused_at_attach():
    """Scenario: BERT keeps no cache between passes; attach refuses, inspect says why."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64))
    spec = derive_spec(model.config)
    assert spec.encoder_only
    with make_engine() as engine, pytest.raises(UnsupportedModelError, match="encoder-only"):
        attach(model, engine)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                  {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                   "long_factor": [2.0] * 8, "original_max_position_embeddings": 256}])
def test_length_dependent_rope_is_refused(rope):
    """Scenario: RoPE scaling that depends on the request length makes cached keys wrong for longer requests."""
    model_type = "llama" if rope["rope_type"] == "dynamic" else "phi3"
    cfg = _config(model_type, hidden_size=64, num_attention_heads=4, num_hidden_layers=1, rope_parameters=rope,
                  max_position_embeddings=1024)
    with pytest.raises(UnsupportedModelError, match=f"rope_type '{rope['rope_type']}'"):
        derive_spec(cfg)


def test_multimodal_config_is_refused():
    """Scenario: image placeholder tokens do not identify the image; a Gemma3 VLM config is refused."""
    with pytest.raises(UnsupportedModelError, match="multimodal config"):
        derive_spec(_config("gemma3"))


def test_kv_shared_layers_are_refused():
    """Scenario: gemma3n-style KV sharing between layers is refused (storing per layer would be wrong)."""
    with pytest.raises(UnsupportedModelError, match="refused|num_kv_shared_layers"):
        derive_spec(_config("gemma3n_text"))


def test_unknown_layer_type_is_refused_naming_it():
    """Scenario: a layer type outside the registry (here forced into a known family) is refused by name."""
    cfg = _config("qwen3_next", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    cfg.layer_types = ["linear_attention", "hybrid_sliding"]
    with pytest.raises(UnsupportedModelError, match="layer 1: layer type 'hybrid_sliding'"):
        derive_spec(cfg)


def test_batch_larger_than_one_is_refused(tiny_llama):
    """Scenario: a padded batch would need per-row positions and masks; the integration says so."""
    with make_engine() as engine:
        am = attach(tiny_llama, engine)
        with pytest.raises(InvalidRequestError, match="batch size 2"):
            am.generate(torch.randint(4, 256, (2, 20)), max_new_tokens=2)
        # batch size 1 as a 2-D tensor is fine
        assert len(am.generate(torch.randint(4, 256, (1, 20)), max_new_tokens=2).new_tokens) == 2


def test_encoder_decoder_needs_the_encoder_input():
    """Scenario: decoder chunks are keyed by the encoder input; without it nothing could be looked up."""
    with make_engine() as engine:
        am = attach(build_tiny("t5"), engine)
        with pytest.raises(InvalidRequestError, match="pass encoder_input_ids"):
            am.generate(torch.tensor([0, 5, 6]), max_new_tokens=2)


def test_different_encoder_input_never_shares_decoder_chunks():
    """Scenario: same decoder prefix, different encoder input -> a miss (cross-attention changes every layer)."""
    with make_engine() as engine:
        am = attach(build_tiny("bart"), engine)
        dec = torch.cat([torch.tensor([2]), torch.randint(4, 256, (40,))])
        a = torch.randint(4, 256, (20,))
        b = a.clone()
        b[-1] = (b[-1] + 1) % 250 + 4  # shares a 19-token encoder prefix
        am.generate(dec, encoder_input_ids=a, max_new_tokens=1)
        assert am.generate(dec, encoder_input_ids=a, max_new_tokens=1).reused_tokens == 32
        assert am.generate(dec, encoder_input_ids=b, max_new_tokens=1).reused_tokens == 0
