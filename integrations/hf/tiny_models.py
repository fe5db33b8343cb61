"""Tiny random-weight models built from configs (no hub access), for tests, the demo and benchmarks.

Weights are rescaled to std ``1/sqrt(fan_in)`` so logits are far from
uniform: near-ties hide errors and make greedy decoding diverge spuriously.

* :data:`TINY_CONFIGS` - ``family -> (model_type, config kwargs, kind)``.
* :func:`build_tiny` - a model of one family, eval mode, chosen dtype.
* :func:`build_llama` - a Llama of any size (the TTFT benchmark's ~80M model).
"""

from __future__ import annotations

import math
from typing import Any

import torch

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)

#: family -> (model_type, config kwargs, "causal" | "seq2seq")
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", dict(_BASE), "causal"),
    "qwen3": ("qwen3", dict(_BASE), "causal"),
    "gpt2": ("gpt2", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=1024, bos_token_id=0,
                          eos_token_id=1), "causal"),
    "mistral": ("mistral", dict(_BASE, sliding_window=12), "causal"),
    "gemma2": ("gemma2", dict(_BASE, num_hidden_layers=2, sliding_window=12, hidden_activation="gelu_pytorch_tanh"),
               "causal"),
    "gemma3": ("gemma3_text", dict(_BASE, num_hidden_layers=3, sliding_window=12,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"]), "causal"),
    "deepseek_v3": ("deepseek_v3", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                                        max_position_embeddings=1024, tie_word_embeddings=False), "causal"),
    "deepseek_v2": ("deepseek_v2", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                        num_experts_per_tok=2, first_k_dense_replace=1,
                                        max_position_embeddings=1024, tie_word_embeddings=False), "causal"),
    "qwen3_next": ("qwen3_next", dict(_BASE, num_hidden_layers=4,
                                      layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "full_attention"],
                                      linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                      linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32), "causal"),
    "granitemoehybrid": ("granitemoehybrid", dict(_BASE, num_hidden_layers=3,
                                                  layer_types=["mamba", "attention", "mamba"],
                                                  mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                                                  mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
                                                  num_local_experts=4, num_experts_per_tok=2,
                                                  shared_intermediate_size=64), "causal"),
    "falcon_h1": ("falcon_h1", dict(_BASE, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
                                    mamba_d_conv=4, mamba_expand=2, mamba_d_ssm=128), "causal"),
    "mamba2": ("mamba2", dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                              state_size=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=16,
                              tie_word_embeddings=False), "causal"),
    "t5": ("t5", dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False),
           "seq2seq"),
    "bart": ("bart", dict(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                          max_position_embeddings=1024, decoder_start_token_id=2, pad_token_id=1, bos_token_id=0,
                          eos_token_id=2, forced_eos_token_id=None, tie_word_embeddings=False), "seq2seq"),
}

#: Families that refuse ``attn_implementation="sdpa"`` or need eager for exactness.
_EAGER = {"mamba2", "deepseek_v3", "deepseek_v2", "gemma2", "gemma3"}


def rescale_(model: torch.nn.Module, *, seed: int = 0) -> None:
    """Matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1); norms, biases and SSM parameters untouched."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g))
            elif isinstance(module, torch.nn.Linear):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(w.shape[1]))


def build_tiny(family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0,
               attn_implementation: str | None = None, **overrides: Any) -> Any:
    """A tiny random model of ``family`` (a key of :data:`TINY_CONFIGS`), eval mode; ``overrides`` replace
    config fields (``rope_parameters``, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    model_type, kwargs, kind = TINY_CONFIGS[family]
    config = AutoConfig.for_model(model_type, **{**kwargs, **overrides})
    impl = attn_implementation or ("eager" if family in _EAGER else "sdpa")
    torch.manual_seed(seed)
    cls = AutoModelForSeq2SeqLM if kind == "seq2seq" else AutoModelForCausalLM
    model = cls.from_config(config, dtype=torch.float32, attn_implementation=impl)
    rescale_(model, seed=seed)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = kwargs.get("pad_token_id", 0)
    return model


def build_llama(*, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                intermediate: int | None = None, vocab: int = 256, dtype: torch.dtype = torch.float32,
                seed: int = 0, max_positions: int = 8192) -> Any:
    """A random Llama of the given size (sdpa attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    rescale_(model, seed=seed)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model
