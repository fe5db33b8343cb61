"""Measuring what a lossy codec does to a model, and KV-like test data.

:func:`cache_quality` prefills a prompt, pushes the prompt's KV cache through
a codec chunk by chunk (as the engine would store and load it), then
continues from the perturbed cache and compares with the exact cache:

* ``max_abs_logit_diff`` and ``greedy_agreement``: teacher-forced over the
  model's own greedy continuation (same inputs, so steps are comparable);
* ``free_run_prefix``: the perturbed cache generates greedily on its own;
  how many tokens match the exact run before the first difference;
* ``ppl_exact`` / ``ppl_codec``: perplexity of that continuation.

:func:`tiny_model` builds small random-weight HF models from configs (no hub)
with weights rescaled to std ``1/sqrt(fan_in)``, so logits are not
near-uniform. transformers is imported lazily; only this module needs it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvengine.chunks.codecs import Codec
from kvengine.chunks.layout import KVCategory, dtype_code
from kvengine.chunks.record import TensorDescriptor

FAMILIES = ("llama", "qwen2", "gpt2", "mistral")


def synthetic_kv(tokens: int = 4096, heads: int = 8, head_dim: int = 128, *, dtype: torch.dtype = torch.bfloat16,
                 outliers: int = 4, seed: int = 0) -> torch.Tensor:
    """``[tokens, heads, head_dim]`` KV-like data: normal values, a log-normal
    scale per channel and ``outliers`` channels multiplied by 20."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(heads * head_dim, generator=gen))
    scale[torch.randperm(heads * head_dim, generator=gen)[:outliers]] *= 20
    x = torch.randn(tokens, heads * head_dim, generator=gen) * scale
    return x.reshape(tokens, heads, head_dim).to(dtype)


def tiny_model(family: str, *, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
               vocab: int = 256, seed: int = 0) -> Any:
    """A small random-weight fp32 causal LM of ``family`` (one of :data:`FAMILIES`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    import transformers
    from transformers.pytorch_utils import Conv1D

    common: dict[str, Any] = dict(vocab_size=vocab, num_hidden_layers=layers, num_attention_heads=heads)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=hidden, n_positions=1024, bos_token_id=0, eos_token_id=0, **common)
    else:
        cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[family]
        # Mistral: every layer is a sliding-window layer, narrower than the default prompt.
        extra = {"sliding_window": 64} if family == "mistral" else {}
        config = cls(hidden_size=hidden, intermediate_size=2 * hidden, num_key_value_heads=kv_heads,
                     max_position_embeddings=1024, **common, **extra)
    torch.manual_seed(seed + FAMILIES.index(family))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if weight is None or weight.dim() != 2:
                continue
            fan_in = weight.shape[0] if isinstance(module, Conv1D) else weight.shape[1]
            weight.normal_(0.0, 1.0 / math.sqrt(fan_in))
    return model


def _descriptor(group: int, t: torch.Tensor) -> TensorDescriptor:
    return TensorDescriptor(group, KVCategory.FULL_ATTENTION, dtype_code(t.dtype), tuple(t.shape),
                            t.numel() * t.element_size())


def roundtrip(codec: Codec, tensors: Sequence[torch.Tensor],
              descriptors: Sequence[TensorDescriptor] | None = None) -> tuple[list[torch.Tensor], int]:
    """``tensors`` (CPU) after encode and decode by ``codec``, and the stored size.

    ``descriptors``: the record descriptors a tier would write for them (a layout's, with its token
    dimensions); default: one token-first descriptor per tensor.
    """
    tensors = [t.contiguous() for t in tensors]
    descs = list(descriptors) if descriptors is not None else [_descriptor(i, t) for i, t in enumerate(tensors)]
    raw = b"".join(t.view(torch.uint8).reshape(-1).numpy().tobytes() for t in tensors)
    stored = codec.encode(memoryview(raw), descs)
    decoded = memoryview(bytearray(codec.decode(memoryview(stored), descs)))
    out, pos = [], 0
    for t, d in zip(tensors, descs):
        if d.nbytes:
            out.append(torch.frombuffer(decoded[pos : pos + d.nbytes], dtype=t.dtype).reshape(t.shape).clone())
        else:  # frombuffer refuses an empty buffer
            out.append(torch.empty(t.shape, dtype=t.dtype))
        pos += d.nbytes
    return out, len(stored)


def perturb_cache(cache: Any, codec: Codec, chunk_tokens: int = 32) -> Any:
    """Copy of an HF cache (batch 1) whose K/V went through ``codec``, one
    chunk of ``chunk_tokens`` tokens (all layers, token-first) at a time."""
    cache = copy.deepcopy(cache)
    layers = cache.layers
    length = layers[0].keys.shape[-2]
    for start in range(0, length, chunk_tokens):
        span = slice(start, min(start + chunk_tokens, length))
        parts = [getattr(layer, name)[0, :, span].transpose(0, 1) for layer in layers for name in ("keys", "values")]
        decoded, _ = roundtrip(codec, parts)
        for i, layer in enumerate(layers):
            for j, name in enumerate(("keys", "values")):
                getattr(layer, name)[0, :, span] = decoded[2 * i + j].transpose(0, 1)
    return cache


@dataclass(frozen=True, slots=True)
class QualityReport:
    codec: str
    max_abs_logit_diff: float
    greedy_agreement: float
    #: Free-running greedy tokens identical to the exact run before the first difference.
    free_run_prefix: int
    ppl_exact: float
    ppl_codec: float
    kv_rel_rms_error: float


@torch.inference_mode()
def cache_quality(model: Any, codec: Codec, *, prompt_tokens: int = 96, steps: int = 50, chunk_tokens: int = 32,
                  seed: int = 0, prompt: torch.Tensor | None = None) -> QualityReport:
    """Compare continuing from an exact and a ``codec``-perturbed prompt cache (see module doc).

    ``prompt``: the prompt's token ids (a real model on real text); random ids of ``prompt_tokens`` if None.
    """
    if prompt is None:
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=gen)
    prompt = prompt.reshape(1, -1)
    out = model(prompt, use_cache=True)
    exact = out.past_key_values
    first = out.logits[0, -1].argmax()
    continuation = _greedy(model, copy.deepcopy(exact), first, steps)  # [steps + 1]
    perturbed = perturb_cache(exact, codec, chunk_tokens)
    errs = [(getattr(p, n) - getattr(e, n)).pow(2).mean() / getattr(e, n).pow(2).mean()
            for p, e in zip(perturbed.layers, exact.layers) for n in ("keys", "values")]
    inputs, targets = continuation[None, :-1], continuation[1:]
    ref = model(inputs, past_key_values=copy.deepcopy(exact)).logits[0]
    got = model(inputs, past_key_values=copy.deepcopy(perturbed)).logits[0]
    free = _greedy(model, perturbed, first, steps)
    return QualityReport(
        codec=codec.name,
        max_abs_logit_diff=float((got - ref).abs().max()),
        greedy_agreement=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        free_run_prefix=int((free[1:] != continuation[1:]).int().argmax()) if (free != continuation).any() else steps,
        ppl_exact=_ppl(ref, targets),
        ppl_codec=_ppl(got, targets),
        kv_rel_rms_error=float(torch.stack(errs).mean().sqrt()),
    )


def _greedy(model: Any, cache: Any, first: torch.Tensor, steps: int) -> torch.Tensor:
    tokens = [first]
    for _ in range(steps):
        logits = model(tokens[-1].view(1, 1), past_key_values=cache).logits
        tokens.append(logits[0, -1].argmax())
    return torch.stack(tokens)


def _ppl(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits.float(), targets).exp())
