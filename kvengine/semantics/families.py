"""Derive a :class:`ModelKVSpec` from a transformers configuration.

The derivation is an allowlist: a ``model_type`` kvengine has no rule for,
a layer type it does not know, or a configuration feature that breaks prefix
reuse raises :class:`UnsupportedModelError` naming it. Nothing is derived
"best effort".

* :func:`derive_spec` - config object -> spec.
* :func:`load_model_config` - model directory or ``config.json`` -> config object.
* :func:`refusal_reasons` - the refused families and features, for docs and ``inspect``.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvengine.chunks.layout import KVCategory
from kvengine.errors import UnsupportedModelError

from .spec import AttentionPart, LayerSpec, ModelKVSpec, StatePart

Shapes = tuple[tuple[int, int], tuple[int, int]]


# -- attention geometry ----------------------------------------------------------------
def _standard_heads(cfg: Any) -> Shapes:
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return (kv, head_dim), (kv, head_dim)


def _mla_latent(cfg: Any) -> Shapes:
    # transformers keeps the normed compressed latent as "keys" and the RoPE'd shared key as "values".
    return (1, int(cfg.kv_lora_rank)), (1, int(cfg.qk_rope_head_dim))


def _t5_heads(cfg: Any) -> Shapes:
    return (int(cfg.num_heads), int(cfg.d_kv)), (int(cfg.num_heads), int(cfg.d_kv))


def _bart_heads(cfg: Any) -> Shapes:
    heads = int(cfg.decoder_attention_heads)
    return (heads, int(cfg.d_model) // heads), (heads, int(cfg.d_model) // heads)


# -- recurrent / conv state geometry -------------------------------------------------------
StateShapes = tuple[str, tuple[int, ...] | None, tuple[int, ...] | None]


def _mamba2_state(cfg: Any) -> StateShapes:
    inner = int(cfg.expand * cfg.hidden_size)
    conv = inner + 2 * int(cfg.n_groups) * int(cfg.state_size)
    return "mamba2", (conv, int(cfg.conv_kernel)), (int(cfg.num_heads), int(cfg.head_dim), int(cfg.state_size))


def _granite_style_state(cfg: Any) -> StateShapes:
    inner = int(getattr(cfg, "mamba_d_ssm", None) or cfg.mamba_expand * cfg.hidden_size)
    heads = int(cfg.mamba_n_heads)
    head_dim = int(getattr(cfg, "mamba_d_head", None) or inner // heads)
    conv = inner + 2 * int(cfg.mamba_n_groups) * int(cfg.mamba_d_state)
    return "mamba2", (conv, int(cfg.mamba_d_conv)), (heads, head_dim, int(cfg.mamba_d_state))


def _nemotron_h_state(cfg: Any) -> StateShapes:
    heads, head_dim = int(cfg.mamba_num_heads), int(cfg.mamba_head_dim)
    conv = heads * head_dim + 2 * int(cfg.n_groups) * int(cfg.ssm_state_size)
    return "mamba2", (conv, int(cfg.conv_kernel)), (heads, head_dim, int(cfg.ssm_state_size))


def _mamba1_state(cfg: Any) -> StateShapes:
    inner = int(cfg.intermediate_size)
    return "mamba1", (inner, int(cfg.conv_kernel)), (inner, int(cfg.state_size))


def _jamba_state(cfg: Any) -> StateShapes:
    inner = int(cfg.mamba_expand * cfg.hidden_size)
    return "mamba1", (inner, int(cfg.mamba_d_conv)), (inner, int(cfg.mamba_d_state))


def _gated_delta_state(cfg: Any) -> StateShapes:
    key_dim = int(cfg.linear_num_key_heads) * int(cfg.linear_key_head_dim)
    value_dim = int(cfg.linear_num_value_heads) * int(cfg.linear_value_head_dim)
    conv = (2 * key_dim + value_dim, int(cfg.linear_conv_kernel_dim))
    rec = (int(cfg.linear_num_value_heads), int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim))
    return "gated_delta_net", conv, rec


def _short_conv_state(cfg: Any) -> StateShapes:
    return "short_conv", (int(cfg.hidden_size), int(cfg.conv_L_cache)), None


# -- families ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Family:
    """How one set of ``model_type``s keeps its cache."""

    name: str
    heads: Callable[[Any], Shapes] | None
    full_category: KVCategory = KVCategory.FULL_ATTENTION
    state: Callable[[Any], StateShapes] | None = None
    kind: str = "decoder"  # decoder | encoder_decoder | encoder_only
    #: Covered by kvengine's exactness tests (tiny random models, fp32).
    tested: bool = False


_FAMILIES: dict[str, Family] = {}


def _register(model_types: tuple[str, ...], family: Family) -> None:
    for mt in model_types:
        _FAMILIES[mt] = family


_register(("llama", "qwen2", "qwen3"), Family("llama-style GQA", _standard_heads, tested=True))
_register(("gpt2",), Family("GPT-2 MHA", _standard_heads, tested=True))
_register(("mistral",), Family("Mistral (sliding window)", _standard_heads, tested=True))
_register(("gemma2", "gemma3_text"), Family("Gemma (sliding + global)", _standard_heads, tested=True))
_register(
    ("mixtral", "qwen2_moe", "qwen3_moe", "gemma", "phi3", "starcoder2", "olmo2", "olmo3", "granite",
     "granitemoe", "smollm3", "ministral", "glm4"),
    Family("standard attention (untested)", _standard_heads),
)
_register(("llama4_text",), Family("Llama 4 text (chunked local + NoPE global)", _standard_heads))
_register(("gpt_oss",), Family("gpt-oss (learned attention sinks)", _standard_heads,
                                full_category=KVCategory.ATTENTION_SINK))
_register(("deepseek_v2", "deepseek_v3"), Family("DeepSeek MLA", _mla_latent, full_category=KVCategory.MLA_LATENT,
                                                 tested=True))
_register(("mamba2",), Family("Mamba2", None, state=_mamba2_state, tested=True))
_register(("mamba",), Family("Mamba", None, state=_mamba1_state))
_register(("granitemoehybrid",), Family("Granite hybrid (Mamba2 + attention)", _standard_heads,
                                        state=_granite_style_state, tested=True))
_register(("falcon_h1",), Family("Falcon-H1 (parallel Mamba2 + attention)", _standard_heads,
                                 state=_granite_style_state, tested=True))
_register(("qwen3_next",), Family("Qwen3-Next (gated delta net + attention)", _standard_heads,
                                  state=_gated_delta_state, tested=True))
_register(("nemotron_h",), Family("Nemotron-H (Mamba2 + attention)", _standard_heads, state=_nemotron_h_state))
_register(("jamba",), Family("Jamba (Mamba + attention)", _standard_heads, state=_jamba_state))
_register(("lfm2",), Family("LFM2 (short conv + attention)", _standard_heads, state=_short_conv_state))
_register(("t5",), Family("T5 encoder-decoder", _t5_heads, kind="encoder_decoder", tested=True))
_register(("bart",), Family("BART encoder-decoder", _bart_heads, kind="encoder_decoder", tested=True))
_register(
    ("bert", "roberta", "distilbert", "deberta-v2", "electra", "xlm-roberta", "modernbert", "albert"),
    Family("encoder-only", None, kind="encoder_only"),
)

#: Families kvengine refuses on purpose, with the reason (also in docs/kv_semantics.md).
REFUSED_FAMILIES: dict[str, str] = {
    "zamba2": "hybrid layers run a transformer block shared across layers; its cache indexing does not follow the "
    "per-layer cache contract (transformers' own forward fails on a plain DynamicCache), so a restore cannot be "
    "validated",
    "zamba": "same shared-block layout as zamba2",
    "bamba": "config cannot be built from a plain dict in transformers 5.19 (layers_block_type is read-only); "
    "its cache was never validated",
    "deepseek_v32": "'indexed_attention' keeps a sparse-attention indexer cache (DynamicIndexedLayer) that kvengine "
    "does not snapshot",
    "gemma3n": "layers share another layer's KV (num_kv_shared_layers); storing them per layer would be wrong",
    "gemma3n_text": "layers share another layer's KV (num_kv_shared_layers); storing them per layer would be wrong",
    "minimax": "lightning (linear) attention state is not exposed through LinearAttentionLayer",
    "rwkv": "recurrent state lives outside transformers' Cache classes",
    "xlstm": "recurrent state lives outside transformers' Cache classes",
    "recurrent_gemma": "recurrent state and local-attention ring buffer live outside transformers' Cache classes",
}

#: Layer types that have no cache at all.
_NO_CACHE_LAYERS = frozenset({"moe", "mlp"})
_REFUSED_LAYER_TYPES = {
    "hybrid_sliding": "a layer with both linear state and a sliding window shares one past-recording switch between "
    "them, so window K/V cannot be recorded without changing the conv state",
    "indexed_attention": "the sparse-attention indexer cache is not snapshotted",
    "heavily_compressed_attention": "compressed attention caches are not supported",
    "compressed_sparse_attention": "compressed attention caches are not supported",
}
_REFUSED_ROPE = {
    "dynamic": "dynamic NTK RoPE rescales frequencies from the current sequence length, so a cached key differs from "
    "the key a full prefill of a longer sequence computes",
    "longrope": "LongRoPE switches short/long factors by sequence length at runtime, so cached keys depend on the "
    "length of the request that computed them",
}


def known_model_types() -> dict[str, Family]:
    return dict(_FAMILIES)


def refusal_reasons() -> dict[str, str]:
    """Refused families, layer types and config features, each with its reason."""
    out = dict(REFUSED_FAMILIES)
    out.update({f"layer type '{k}'": v for k, v in _REFUSED_LAYER_TYPES.items()})
    out.update({f"rope_type '{k}'": v for k, v in _REFUSED_ROPE.items()})
    out["multimodal configs"] = ("placeholder token ids do not identify the image/audio they stand for, so a token "
                                 "prefix would share KV across different media")
    out["num_kv_shared_layers > 0"] = REFUSED_FAMILIES["gemma3n"]
    return out


# -- derivation --------------------------------------------------------------------------------
def _dtype_of(cfg: Any, override: torch.dtype | str | None) -> torch.dtype:
    value = override if override is not None else getattr(cfg, "dtype", None)
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedModelError(f"unknown dtype {value!r}")
    return dtype


def rope_types(cfg: Any) -> set[str]:
    """The ``rope_type`` of every rotary embedding a (text) config sets up; empty where it names none."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(params, dict):
        return set()
    if "rope_type" in params or "type" in params:
        return {str(params.get("rope_type", params.get("type")))}
    return {str(p.get("rope_type", p.get("type", "default"))) for p in params.values() if isinstance(p, dict)}


def _check_features(root: Any, cfg: Any, model_type: str) -> None:
    for media in ("vision_config", "audio_config", "speech_config"):
        if getattr(root, media, None) is not None:
            raise UnsupportedModelError(
                f"{model_type}: multimodal config ({media}); placeholder token ids do not identify the media they "
                f"stand for, so a token prefix would share KV across different inputs"
            )
    for rope in rope_types(cfg):
        if rope in _REFUSED_ROPE:
            raise UnsupportedModelError(f"{model_type}: rope_type '{rope}': {_REFUSED_ROPE[rope]}")
    if (getattr(cfg, "num_kv_shared_layers", None) or 0) > 0:
        raise UnsupportedModelError(f"{model_type}: num_kv_shared_layers > 0: {REFUSED_FAMILIES['gemma3n']}")


def _layer_types(cfg: Any) -> tuple[list[str], list[dict[str, Any]]]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(cfg)
    return list(types), list(kwargs)


def derive_spec(config: Any, *, dtype: torch.dtype | str | None = None) -> ModelKVSpec:
    """The KV spec of a transformers config; :class:`UnsupportedModelError` for anything not in the registry."""
    root_type = getattr(config, "model_type", None) or "<missing model_type>"
    if root_type in REFUSED_FAMILIES:
        raise UnsupportedModelError(f"model_type '{root_type}' is refused: {REFUSED_FAMILIES[root_type]}")
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(cfg, "model_type", None) or root_type
    if model_type in REFUSED_FAMILIES:
        raise UnsupportedModelError(f"model_type '{model_type}' is refused: {REFUSED_FAMILIES[model_type]}")
    _check_features(config, cfg, model_type)
    family = _FAMILIES.get(model_type)
    if family is None:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        raise UnsupportedModelError(
            f"model_type '{model_type}' ({archs}) is not in kvengine's KV semantics registry; its cache layout and "
            f"reuse rules are unknown, so nothing is stored for it"
        )
    dt = _dtype_of(config, dtype)
    arch = ", ".join(getattr(config, "architectures", None) or []) or family.name

    if family.kind == "encoder_only":
        return ModelKVSpec(model_type=model_type, architecture=arch, dtype=dt, layers=(), encoder_only=True,
                           notes=("encoder-only: no cache between forward passes, nothing to store",))
    if family.kind == "encoder_decoder":
        return _derive_encoder_decoder(config, model_type, arch, family, dt)

    for index, layer_type in enumerate(getattr(cfg, "layer_types", None) or ()):
        if layer_type in _REFUSED_LAYER_TYPES:
            raise UnsupportedModelError(f"{model_type} layer {index}: layer type '{layer_type}': "
                                        f"{_REFUSED_LAYER_TYPES[layer_type]}")
    types, kwargs = _layer_types(cfg)
    if len(types) != int(cfg.num_hidden_layers):
        raise UnsupportedModelError(
            f"{model_type}: {len(types)} cache layer types for {cfg.num_hidden_layers} layers (shared KV layers?)"
        )
    layers: list[LayerSpec] = []
    for index, (layer_type, kw) in enumerate(zip(types, kwargs)):
        layers.append(_derive_layer(cfg, model_type, family, index, layer_type, kw, dt))
    notes = () if family.tested else (f"{family.name}: derived from the registry but not covered by kvengine's "
                                      f"exactness tests; the attach canary still verifies it",)
    return ModelKVSpec(model_type=model_type, architecture=arch, dtype=dt, layers=tuple(layers), notes=notes)


def _derive_layer(cfg: Any, model_type: str, family: Family, index: int, layer_type: str, kw: dict[str, Any],
                  dt: torch.dtype) -> LayerSpec:
    if layer_type in _REFUSED_LAYER_TYPES:
        raise UnsupportedModelError(f"{model_type} layer {index}: layer type '{layer_type}': "
                                    f"{_REFUSED_LAYER_TYPES[layer_type]}")
    if layer_type in _NO_CACHE_LAYERS:
        return LayerSpec(index=index, layer_type=layer_type)
    attention = state = None
    if layer_type in ("full_attention", "sliding_attention", "chunked_attention", "hybrid"):
        if family.heads is None:
            raise UnsupportedModelError(f"{model_type} layer {index}: attention layer in a family without attention")
        key, value = family.heads(cfg)
        if layer_type == "sliding_attention":
            attention = AttentionPart(category=KVCategory.SLIDING_WINDOW, key_shape=key, value_shape=value, dtype=dt,
                                      window=int(kw["sliding_window"]))
        elif layer_type == "chunked_attention":
            attention = AttentionPart(category=KVCategory.CHUNKED_LOCAL, key_shape=key, value_shape=value, dtype=dt,
                                      window=int(kw["sliding_window"]))
        else:
            attention = AttentionPart(category=family.full_category, key_shape=key, value_shape=value, dtype=dt)
    if layer_type in ("linear_attention", "conv", "hybrid"):
        if family.state is None:
            raise UnsupportedModelError(f"{model_type} layer {index}: layer type '{layer_type}' has no state rule")
        kind, conv, rec = family.state(cfg)
        n = int(kw.get("number_of_states", 1))
        state = StatePart(kind=kind, conv_shapes=(conv,) * n, recurrent_shapes=(rec,) * n, dtype=dt)
    if attention is None and state is None:
        raise UnsupportedModelError(f"{model_type} layer {index}: unknown layer type '{layer_type}'")
    return LayerSpec(index=index, layer_type=layer_type, attention=attention, state=state)


def _derive_encoder_decoder(config: Any, model_type: str, arch: str, family: Family, dt: torch.dtype) -> ModelKVSpec:
    assert family.heads is not None
    n = int(getattr(config, "num_decoder_layers", None) or getattr(config, "decoder_layers", None)
            or config.num_hidden_layers)
    key, value = family.heads(config)
    layers = tuple(
        LayerSpec(index=i, layer_type="full_attention",
                  attention=AttentionPart(category=KVCategory.FULL_ATTENTION, key_shape=key, value_shape=value,
                                          dtype=dt))
        for i in range(n)
    )
    cross = tuple(
        LayerSpec(index=i, layer_type="cross_attention",
                  attention=AttentionPart(category=KVCategory.CROSS_ATTENTION, key_shape=key, value_shape=value,
                                          dtype=dt))
        for i in range(n)
    )
    return ModelKVSpec(model_type=model_type, architecture=arch, dtype=dt, layers=layers, cross_layers=cross,
                       notes=("decoder chunks are keyed by the encoder input's digest (namespace extra key)",))


class ModelConfigError(UnsupportedModelError):
    """The model config itself is missing, unreadable or malformed (a caller mistake, not a refusal of the model).

    A subclass of :class:`UnsupportedModelError` so that callers catching that keep working; commands
    tell the two apart (``kvengine inspect`` exits 2 for this one, 1 for a refusal)."""


def _unknown_model_type(model_type: str, known: list[str]) -> str:
    close = difflib.get_close_matches(model_type, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"model_type {model_type!r} is unknown to transformers{hint}"


def _decode_special_floats(obj: dict[str, Any]) -> Any:
    # transformers' save_pretrained writes inf / nan as {"__float__": "Infinity"} (e.g. Mamba2's time_step_limit).
    if len(obj) == 1 and isinstance(obj.get("__float__"), str):
        return float(obj["__float__"])
    return obj


def load_model_config(path: str | os.PathLike[str]) -> Any:
    """A transformers config from a model directory or a ``config.json`` (local files only).

    :raises ModelConfigError: no such file, not JSON, no ``model_type``, a ``model_type`` transformers does not
        know (naming close matches), or values transformers rejects.
    :raises UnsupportedModelError: a refused family.
    """
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ImportError:  # pragma: no cover - depends on the environment
        raise UnsupportedModelError("reading model configs needs transformers: pip install 'kvengine[hf]'") from None
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        data = json.loads(file.read_text(), object_hook=_decode_special_floats)
    except OSError as exc:
        raise ModelConfigError(f"cannot read model config {file}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"cannot read model config {file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelConfigError(f"{file} has no model_type; cannot tell which cache the model keeps")
    model_type = data.pop("model_type")
    if model_type in REFUSED_FAMILIES:
        raise UnsupportedModelError(f"model_type '{model_type}' is refused: {REFUSED_FAMILIES[model_type]}")
    known = list(CONFIG_MAPPING.keys())
    if model_type not in known:
        raise ModelConfigError(f"{file}: {_unknown_model_type(model_type, known)}")
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # any failure to build it from the file's values is the file's
        detail = " ".join(str(exc).split())[:300]
        raise ModelConfigError(f"{file}: transformers cannot build a {model_type!r} config from it: {detail}") from None
