"""A model's KV spec: which state each layer keeps, grouped, sized and laid out.

The spec is pure data derived from a model configuration
(:mod:`kvengine.semantics.families`). It knows nothing about transformers
objects; integrations map cache objects onto it.

* :class:`AttentionPart` - per-token K/V of one layer (full, MLA, windowed, sink, cross).
* :class:`StatePart` - fixed-size recurrent / conv state of one layer.
* :class:`LayerSpec` - one decoder layer: an attention part, a state part, both
  (parallel hybrids such as Falcon-H1) or neither (MLP/MoE-only layers).
* :class:`LayerGroup` - layers whose parts share category and shapes.
* :class:`ModelKVSpec` - the whole model; :meth:`ModelKVSpec.layout` gives the
  engine's :class:`~kvengine.chunks.layout.ChunkLayout`, :attr:`ModelKVSpec.fingerprint`
  the namespace's ``kv_spec_fingerprint``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import xxhash

from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
from kvengine.errors import UnsupportedModelError

from .policies import ReusePolicy, Storage, policy_for

_ATTENTION_CATEGORIES = frozenset(
    {
        KVCategory.FULL_ATTENTION,
        KVCategory.MLA_LATENT,
        KVCategory.SLIDING_WINDOW,
        KVCategory.CHUNKED_LOCAL,
        KVCategory.ATTENTION_SINK,
        KVCategory.CROSS_ATTENTION,
    }
)
_WINDOWED = frozenset({KVCategory.SLIDING_WINDOW, KVCategory.CHUNKED_LOCAL})


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionPart:
    """Per-token keys ``(heads, dim)`` and values ``(heads, dim)`` of one layer."""

    category: KVCategory
    key_shape: tuple[int, int]
    value_shape: tuple[int, int]
    dtype: torch.dtype
    #: Tokens a windowed layer attends to; the cache holds ``window - 1``.
    window: int | None = None

    def __post_init__(self) -> None:
        if self.category not in _ATTENTION_CATEGORIES:
            raise ValueError(f"{self.category.name} is not an attention category")
        if (self.window is not None) != (self.category in _WINDOWED):
            raise ValueError(f"{self.category.name}: window must be set exactly for windowed categories")
        if self.window is not None and self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}")
        for shape in (self.key_shape, self.value_shape):
            if len(shape) != 2 or min(shape) <= 0:
                raise ValueError(f"attention shapes are (heads, dim), got {shape}")

    @property
    def bytes_per_token(self) -> int:
        return (_numel(self.key_shape) + _numel(self.value_shape)) * self.dtype.itemsize

    def signature(self) -> tuple[object, ...]:
        return ("attn", self.category.name, self.key_shape, self.value_shape, str(self.dtype), self.window)


@dataclass(frozen=True, slots=True, kw_only=True)
class StatePart:
    """Fixed-size state of one layer: per state index a conv window and/or a recurrent state."""

    kind: str
    conv_shapes: tuple[tuple[int, ...] | None, ...]
    recurrent_shapes: tuple[tuple[int, ...] | None, ...]
    dtype: torch.dtype
    recurrent_dtype: torch.dtype | None = None
    category: KVCategory = KVCategory.LINEAR_STATE

    def __post_init__(self) -> None:
        if self.category is not KVCategory.LINEAR_STATE:
            raise ValueError("state parts are LINEAR_STATE")
        if len(self.conv_shapes) != len(self.recurrent_shapes) or not self.conv_shapes:
            raise ValueError("conv_shapes and recurrent_shapes need one entry per state index")
        if all(c is None and r is None for c, r in zip(self.conv_shapes, self.recurrent_shapes)):
            raise ValueError("a state part must hold at least one tensor")

    @property
    def rec_dtype(self) -> torch.dtype:
        return self.recurrent_dtype or self.dtype

    @property
    def bytes_per_boundary(self) -> int:
        conv = sum(_numel(s) for s in self.conv_shapes if s is not None) * self.dtype.itemsize
        rec = sum(_numel(s) for s in self.recurrent_shapes if s is not None) * self.rec_dtype.itemsize
        return conv + rec

    def signature(self) -> tuple[object, ...]:
        return ("state", self.kind, self.conv_shapes, self.recurrent_shapes, str(self.dtype), str(self.rec_dtype))


Part = AttentionPart | StatePart


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerSpec:
    """One layer of the decoder (or the cross-attention of one decoder layer)."""

    index: int
    layer_type: str
    attention: AttentionPart | None = None
    state: StatePart | None = None

    @property
    def parts(self) -> tuple[Part, ...]:
        return tuple(p for p in (self.attention, self.state) if p is not None)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerGroup:
    """Layers whose part of one kind has the same category, shapes and dtype."""

    gid: int
    part: Part
    layers: tuple[int, ...]

    @property
    def category(self) -> KVCategory:
        return self.part.category

    @property
    def policy(self) -> ReusePolicy:
        return policy_for(self.category)

    @property
    def name(self) -> str:
        span = f"layer {self.layers[0]}" if len(self.layers) == 1 else f"layers {_ranges(self.layers)}"
        return f"group {self.gid} ({self.policy.short}, {span})"

    @property
    def bytes_per_token(self) -> int:
        if isinstance(self.part, AttentionPart):
            return self.part.bytes_per_token * len(self.layers)
        return 0

    @property
    def bytes_per_boundary(self) -> int:
        if isinstance(self.part, StatePart):
            return self.part.bytes_per_boundary * len(self.layers)
        return 0

    def storage_per_tokens(self, tokens: int, chunk_size: int) -> int:
        """Bytes stored per ``tokens`` cached tokens in this group (amortised over chunk boundaries)."""
        if self.policy.storage is Storage.PER_TOKEN:
            return tokens * self.bytes_per_token
        if self.policy.storage is Storage.PER_BOUNDARY:
            return round(tokens / chunk_size * self.bytes_per_boundary)
        return 0

    def reuse_plan(self, chunk_size: int) -> str:
        part = self.part
        if self.category is KVCategory.CROSS_ATTENTION:
            return "not stored; recomputed from the encoder input, which keys the decoder chunks"
        if isinstance(part, AttentionPart) and part.window is not None:
            need = part.window - 1
            chunks = -(-need // chunk_size) + 1
            return (f"store K/V of every chunk; restore the last {need} tokens (<= {chunks} chunks) and set "
                    f"cumulative_length = prefix length")
        if isinstance(part, AttentionPart):
            return "store K/V of every chunk; restore all matched chunks"
        return ("snapshot conv+recurrent state at every chunk end (chunk-sized prefill pieces); restore only the "
                "last matched chunk's snapshot; match only at snapshot boundaries")

    def tensor_specs(self, chunk_size: int) -> list[TensorSpec]:
        """The chunk tensors of this group, one set per layer, in layer order."""
        out: list[TensorSpec] = []
        part = self.part
        cat = self.category
        for layer in self.layers:
            prefix = f"g{self.gid}.l{layer}"
            if isinstance(part, AttentionPart):
                kh, kd = part.key_shape
                vh, vd = part.value_shape
                out.append(TensorSpec(name=f"{prefix}.k", group=self.gid, category=cat, dtype=part.dtype,
                                      shape=(kh, chunk_size, kd), token_dim=1))
                out.append(TensorSpec(name=f"{prefix}.v", group=self.gid, category=cat, dtype=part.dtype,
                                      shape=(vh, chunk_size, vd), token_dim=1))
            else:
                for j, (conv, rec) in enumerate(zip(part.conv_shapes, part.recurrent_shapes)):
                    if conv is not None:
                        out.append(TensorSpec(name=f"{prefix}.conv{j}", group=self.gid, category=cat,
                                              dtype=part.dtype, shape=conv, token_dim=None))
                    if rec is not None:
                        out.append(TensorSpec(name=f"{prefix}.rec{j}", group=self.gid, category=cat,
                                              dtype=part.rec_dtype, shape=rec, token_dim=None))
        return out


@dataclass(frozen=True, kw_only=True)
class ModelKVSpec:
    """Everything kvengine needs to know about a model's cache, derived from its config."""

    model_type: str
    architecture: str
    dtype: torch.dtype
    layers: tuple[LayerSpec, ...]
    #: Cross-attention of encoder-decoder models (one per decoder layer), never in chunks.
    cross_layers: tuple[LayerSpec, ...] = ()
    encoder_only: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.encoder_only and not any(layer.parts for layer in self.layers):
            raise UnsupportedModelError(f"{self.model_type}: no layer keeps any cache state")

    # -- derived structure ---------------------------------------------------------
    @cached_property
    def groups(self) -> tuple[LayerGroup, ...]:
        """Decoder groups (chunk contents) first, then cross-attention groups."""
        order: dict[tuple[object, ...], list[int]] = {}
        parts: dict[tuple[object, ...], Part] = {}
        for layer in (*self.layers, *self.cross_layers):
            for part in layer.parts:
                sig = part.signature()
                order.setdefault(sig, []).append(layer.index)
                parts[sig] = part
        return tuple(LayerGroup(gid=i, part=parts[sig], layers=tuple(ls)) for i, (sig, ls) in enumerate(order.items()))

    @property
    def chunk_groups(self) -> tuple[LayerGroup, ...]:
        """Groups whose state goes into chunks (everything but cross-attention)."""
        return tuple(g for g in self.groups if g.category is not KVCategory.CROSS_ATTENTION)

    @property
    def stateful(self) -> bool:
        """True when some layer keeps a recurrent state (snapshot boundaries only)."""
        return any(layer.state is not None for layer in self.layers)

    @property
    def encoder_decoder(self) -> bool:
        return bool(self.cross_layers)

    @property
    def max_window(self) -> int:
        return max((layer.attention.window or 0 for layer in self.layers if layer.attention is not None), default=0)

    def group_of(self, layer: int, kind: str) -> LayerGroup:
        """The group holding ``layer``'s ``kind`` part ("attention", "state" or "cross")."""
        for g in self.groups:
            is_cross = g.category is KVCategory.CROSS_ATTENTION
            if layer not in g.layers:
                continue
            if kind == "cross" and is_cross:
                return g
            if kind == "attention" and isinstance(g.part, AttentionPart) and not is_cross:
                return g
            if kind == "state" and isinstance(g.part, StatePart):
                return g
        raise KeyError(f"layer {layer} has no {kind} part")

    @property
    def bytes_per_token(self) -> int:
        return sum(g.bytes_per_token for g in self.chunk_groups)

    @property
    def bytes_per_boundary(self) -> int:
        return sum(g.bytes_per_boundary for g in self.chunk_groups)

    def chunk_bytes(self, chunk_size: int) -> int:
        return chunk_size * self.bytes_per_token + self.bytes_per_boundary

    def storage_per_tokens(self, tokens: int, chunk_size: int) -> int:
        return sum(g.storage_per_tokens(tokens, chunk_size) for g in self.chunk_groups)

    # -- engine-facing -------------------------------------------------------------
    def layout(self, chunk_size: int) -> ChunkLayout:
        """The chunk layout: per group, per layer, K/V (token dim 1) or state snapshots."""
        if self.encoder_only:
            raise UnsupportedModelError(
                f"{self.model_type} is encoder-only: it keeps no cache between forward passes, nothing to store"
            )
        tensors: list[TensorSpec] = []
        for group in self.chunk_groups:
            tensors.extend(group.tensor_specs(chunk_size))
        return ChunkLayout(chunk_size, tuple(tensors))

    def describe(self) -> dict[str, object]:
        """Canonical, JSON-able description (the fingerprint's input)."""
        return {
            "model_type": self.model_type,
            "architecture": self.architecture,
            "dtype": str(self.dtype),
            "encoder_only": self.encoder_only,
            "layers": [
                [layer.index, layer.layer_type, [list(map(str, p.signature())) for p in layer.parts]]
                for layer in self.layers
            ],
            "cross": [[layer.index, [list(map(str, p.signature())) for p in layer.parts]]
                      for layer in self.cross_layers],
        }

    @cached_property
    def fingerprint(self) -> str:
        """``Namespace.kv_spec_fingerprint``: changes whenever the cache's meaning changes."""
        raw = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
        return xxhash.xxh3_128_hexdigest(b"kvengine-kvspec-v1\0" + raw)


def _ranges(indices: tuple[int, ...]) -> str:
    """``(0,1,2,5,7,8)`` -> ``"0-2,5,7-8"``."""
    out: list[str] = []
    start = prev = indices[0]
    for i in indices[1:]:
        if i == prev + 1:
            prev = i
            continue
        out.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = i
    out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)
