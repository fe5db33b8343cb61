"""Tiny random-weight model directories vLLM can load, built locally (no hub).

Used by the tests, the example and the benchmark. Each builder writes a
``save_pretrained`` model plus a word-level tokenizer (one token per id,
``t0 t1 ...``) into a directory and returns it.

Constraints of the vLLM CPU build respected here: attention head dims in
{32, 64, 80, 96, 112, 128, ...}; Qwen3-Next linear-attention head dims 128
(the CPU gated-delta-rule kernel refuses 32); an MLA latent of 512 + 64.

Weights are rescaled to std ``1/sqrt(fan_in)`` so that logits are far from
uniform: near-ties would make greedy comparisons flaky for reasons that have
nothing to do with the cache.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: family -> (model_type, config kwargs). Sizes are the smallest that run on vLLM CPU.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32)),
    "gemma2": ("gemma2", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
                              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                              layer_types=["sliding_attention", "full_attention"])),
    "qwen3_next": ("qwen3_next", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      layer_types=["linear_attention", "full_attention"],
                                      linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=128,
                                      linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=64,
                                      shared_expert_intermediate_size=64, mlp_only_layers=[])),
    # Llama 4: layer 0 chunked local attention (RoPE), layer 1 full attention (NoPE); the attention chunk
    # must be a multiple of vLLM's block size, and longer than kvengine's chunk to matter for a hit.
    "llama4": ("llama4_text", dict(hidden_size=128, intermediate_size=128, intermediate_size_mlp=256,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                   moe_layers=[1], no_rope_layers=[1, 0], attention_chunk_size=512,
                                   layer_types=["chunked_attention", "full_attention"], use_qk_norm=True)),
    # gpt-oss: learned per-head attention sinks in every layer; layer 0 a sliding window.
    "gpt_oss": ("gpt_oss", dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, sliding_window=64, num_local_experts=4,
                                num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])),
    # MLA (DeepSeek-V2): vLLM's CPU MLA kernels take only a 576-wide latent (kv_lora_rank 512 + rope 64). Dense
    # layers only (first_k_dense_replace = layers): MoE routing would turn bf16 rounding into different experts.
    "deepseek_v2": ("deepseek_v2", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                                        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                        first_k_dense_replace=2, moe_intermediate_size=64, topk_method="greedy",
                                        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
}


#: Gemma2 ties its output head to the embedding and scales inputs by
#: sqrt(hidden): with unit embeddings its residual stream is the input token
#: and greedy decoding echoes it. A small embedding and a larger final norm
#: give varied tokens with clear margins (median top-2 gap ~0.7).
_GEMMA_EMBED_STD = 0.3
_GEMMA_FINAL_NORM = 9.0  # Gemma's RMSNorm multiplies by (1 + weight)


def _rescale(model: Any, seed: int, family: str) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                w = module.weight
                std = _GEMMA_EMBED_STD / math.sqrt(w.shape[1]) if family == "gemma2" else 1.0
                w.copy_(torch.randn(w.shape, generator=g) * std)
            elif isinstance(module, torch.nn.Linear) and id(module.weight) not in embeddings:  # tied heads stay
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(w.shape[1]))
        if family == "gemma2":
            model.model.norm.weight.fill_(_GEMMA_FINAL_NORM)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose token ``i`` is the word ``t<i>`` (no specials beyond ids 0/1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", unk_token="t2",
                                   pad_token="t0")
    fast.save_pretrained(str(path))


def build_model_dir(path: str | Path, family: str = "llama", *, vocab_size: int = 512, seed: int = 0,
                    dtype: str = "float32", **overrides: Any) -> Path:
    """Write a random ``family`` model and its tokenizer to ``path``; return ``path``.

    ``overrides`` replace config keys (e.g. ``hidden_size=768, num_hidden_layers=12``).
    Reuses ``path`` if it already holds a model built with the same arguments.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    model_type, kwargs = FAMILIES[family]
    kwargs = {**kwargs, **overrides}
    stamp = json.dumps([family, vocab_size, seed, dtype, sorted(kwargs.items())], default=str)
    stamp_file = path / "kvengine_tiny.json"
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return path
    path.mkdir(parents=True, exist_ok=True)
    kwargs.setdefault("tie_word_embeddings", False)  # vLLM's Gemma2 always ties
    config = AutoConfig.for_model(model_type, **{"vocab_size": vocab_size, "max_position_embeddings": 8192,
                                                 "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, **kwargs})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _rescale(model, seed, family)
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(path))
    write_tokenizer(path, vocab_size)
    stamp_file.write_text(stamp)
    return path
