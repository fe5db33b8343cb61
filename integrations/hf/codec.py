"""Map transformers cache objects onto a :class:`ModelKVSpec` and back.

* :meth:`HFCacheCodec.new_cache` - an empty cache of the classes the model builds itself.
* :meth:`HFCacheCodec.check_cache` - refuse a cache whose layer classes, shapes or
  dtypes differ from the spec (fail closed).
* :meth:`HFCacheCodec.record` - keep sliding-window layers' K/V of this request so
  every new chunk can be stored (transformers' past recording).
* :meth:`HFCacheCodec.snapshot` - conv/recurrent states at a chunk boundary.
* :meth:`HFCacheCodec.chunk_tensors` - one chunk in layout order.
* :class:`Restorer` - a load sink that rebuilds a cache from chunks, including
  sliding-window bookkeeping and the last boundary's state snapshot.
* :meth:`HFCacheCodec.comparable` - per-layer effective state, for the canary.

Batch size is 1 throughout: chunk tensors drop the batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    LinearAttentionCacheLayerMixin,
)

from kvengine.chunks.layout import ChunkLayout
from kvengine.errors import UnsupportedModelError
from kvengine.semantics.spec import AttentionPart, LayerGroup, ModelKVSpec, StatePart
from kvengine.types import ChunkView

#: Snapshot of one boundary: ``(layer, state_idx, "conv"|"rec") -> tensor`` (no batch dim).
Snapshot = dict[tuple[int, int, str], torch.Tensor]


class ChunkUnavailable(Exception):
    """A chunk's tensors are no longer in this request's cache (stops a store, counted)."""


def self_attention_cache(cache: Cache) -> Cache:
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def _held_range(layer: Any) -> tuple[int, int]:
    """Absolute token positions ``[start, end)`` whose K/V the layer holds."""
    held = 0 if layer.keys is None or layer.keys.numel() == 0 else int(layer.keys.shape[-2])
    end = int(layer.cumulative_length) if isinstance(layer, DynamicSlidingWindowLayer) else held
    return end - held, end


class HFCacheCodec:
    """Moves one request's cache state between transformers objects and chunks."""

    def __init__(self, spec: ModelKVSpec, model_config: Any, layout: ChunkLayout) -> None:
        self.spec = spec
        self.config = model_config
        self.layout = layout
        self.chunk_size = layout.chunk_size
        self.groups: tuple[LayerGroup, ...] = spec.chunk_groups

    # -- cache objects ---------------------------------------------------------------
    def new_cache(self) -> Cache:
        """An empty cache of exactly the layer classes the model would build."""
        if self.spec.encoder_decoder:
            return EncoderDecoderCache(DynamicCache(), DynamicCache())
        return DynamicCache(config=self.config)

    def _layers(self, cache: Cache) -> list[Any]:
        inner = self_attention_cache(cache)
        if self.spec.encoder_decoder and len(inner.layers) < len(self.spec.layers):
            inner.layers.extend(DynamicLayer() for _ in range(len(self.spec.layers) - len(inner.layers)))
        return inner.layers

    def check_cache(self, cache: Cache) -> None:
        """Raise :class:`UnsupportedModelError` unless ``cache`` (after a prefill) matches the spec."""
        layers = self._layers(cache)
        if len(layers) != len(self.spec.layers):
            raise UnsupportedModelError(f"cache has {len(layers)} layers, KV spec {len(self.spec.layers)}")
        for ls, layer in zip(self.spec.layers, layers):
            where = f"{self.spec.model_type} layer {ls.index} ({ls.layer_type})"
            att, st = ls.attention, ls.state
            if att is not None:
                if not isinstance(layer, DynamicLayer):
                    raise UnsupportedModelError(f"{where}: expected attention K/V, cache holds {type(layer).__name__}")
                windowed = isinstance(layer, DynamicSlidingWindowLayer)
                if windowed != (att.window is not None) or (windowed and getattr(layer, "sliding_window", None)
                                                            != att.window):
                    raise UnsupportedModelError(
                        f"{where}: cache layer {type(layer).__name__} window "
                        f"{getattr(layer, 'sliding_window', None)} disagrees with spec window {att.window}")
                for name, t, shape in (("keys", layer.keys, att.key_shape), ("values", layer.values, att.value_shape)):
                    if t is None or t.dim() != 4 or t.shape[0] != 1 or (t.shape[1], t.shape[3]) != shape:
                        got = None if t is None else tuple(t.shape)
                        raise UnsupportedModelError(
                            f"{where}: {name} {got}, spec expects [1, {shape[0]}, S, {shape[1]}]")
                    if t.dtype != att.dtype:
                        raise UnsupportedModelError(f"{where}: {name} dtype {t.dtype}, spec {att.dtype}")
            elif isinstance(layer, DynamicLayer) and layer.keys is not None and layer.keys.numel():
                raise UnsupportedModelError(f"{where}: cache holds K/V the spec does not know about")
            if st is not None:
                if not isinstance(layer, LinearAttentionCacheLayerMixin):
                    raise UnsupportedModelError(f"{where}: expected linear state, cache holds {type(layer).__name__}")
                for j, (conv, rec) in enumerate(zip(st.conv_shapes, st.recurrent_shapes)):
                    for kind, t, want, dtype in (("conv", layer.conv_states.get(j), conv, st.dtype),
                                                  ("recurrent", layer.recurrent_states.get(j), rec, st.rec_dtype)):
                        state_shape = None if t is None else tuple(t.shape[1:])
                        if state_shape != want or (t is not None and t.shape[0] != 1):
                            raise UnsupportedModelError(f"{where}: {kind} state {j} {state_shape}, spec expects {want}")
                        if t is not None and t.dtype != dtype:
                            raise UnsupportedModelError(f"{where}: {kind} state {j} dtype {t.dtype}, spec {dtype}")
            elif isinstance(layer, LinearAttentionCacheLayerMixin) and (
                any(v is not None for v in layer.conv_states.values())
                or any(v is not None for v in layer.recurrent_states.values())
            ):
                raise UnsupportedModelError(f"{where}: cache holds linear state the spec does not know about")

    def record(self, cache: Cache) -> None:
        """Keep every new token's K/V in pure sliding-window layers until the request ends."""
        for layer in self._layers(cache):
            if isinstance(layer, DynamicSlidingWindowLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.activate_past_recording()

    def snapshot(self, cache: Cache) -> Snapshot:
        """Copies of every state tensor now (call exactly at a chunk boundary)."""
        snap: Snapshot = {}
        layers = self._layers(cache)
        for ls in self.spec.layers:
            if ls.state is None:
                continue
            layer = layers[ls.index]
            for j in range(len(ls.state.conv_shapes)):
                conv, rec = layer.conv_states.get(j), layer.recurrent_states.get(j)
                if conv is not None:
                    snap[(ls.index, j, "conv")] = conv[0].detach().clone()
                if rec is not None:
                    snap[(ls.index, j, "rec")] = rec[0].detach().clone()
        return snap

    # -- store --------------------------------------------------------------------------
    def chunk_tensors(self, cache: Cache, index: int, snapshots: dict[int, Snapshot]) -> list[torch.Tensor]:
        """Chunk ``index`` in layout order; :class:`ChunkUnavailable` if this request no longer has it."""
        start, end = index * self.chunk_size, (index + 1) * self.chunk_size
        layers = self._layers(cache)
        out: list[torch.Tensor] = []
        for group in self.groups:
            part = group.part
            for li in group.layers:
                layer = layers[li]
                if isinstance(part, AttentionPart):
                    lo, hi = _held_range(layer)
                    if start < lo or end > hi:
                        raise ChunkUnavailable(f"layer {li} holds tokens [{lo}, {hi}), chunk needs [{start}, {end})")
                    out.append(layer.keys[0, :, start - lo : end - lo, :])
                    out.append(layer.values[0, :, start - lo : end - lo, :])
                else:
                    snap = snapshots.get(index)
                    if snap is None:
                        raise ChunkUnavailable(f"no state snapshot at the end of chunk {index}")
                    for j, (conv, rec) in enumerate(zip(part.conv_shapes, part.recurrent_shapes)):
                        if conv is not None:
                            out.append(snap[(li, j, "conv")])
                        if rec is not None:
                            out.append(snap[(li, j, "rec")])
        return out

    # -- load ---------------------------------------------------------------------------
    def restorer(self, matched_tokens: int, device: torch.device | str = "cpu") -> Restorer:
        return Restorer(self, matched_tokens, torch.device(device))

    # -- canary -------------------------------------------------------------------------
    def comparable(self, cache: Cache) -> dict[tuple[int, str], list[torch.Tensor]]:
        """Each layer's effective state: K/V the next token can see, length bookkeeping, states."""
        out: dict[tuple[int, str], list[torch.Tensor]] = {}
        layers = self._layers(cache)
        for ls in self.spec.layers:
            layer = layers[ls.index]
            if ls.attention is not None:
                lo, hi = _held_range(layer)
                keep = hi - lo
                if ls.attention.window is not None:
                    keep = min(keep, ls.attention.window - 1)
                k = layer.keys[..., layer.keys.shape[-2] - keep :, :] if keep else layer.keys[..., :0, :]
                v = layer.values[..., layer.values.shape[-2] - keep :, :] if keep else layer.values[..., :0, :]
                out[(ls.index, "attention")] = [k.clone(), v.clone(), torch.tensor([hi], dtype=torch.int64)]
            if ls.state is not None:
                tensors: list[torch.Tensor] = []
                for j in range(len(ls.state.conv_shapes)):
                    conv, rec = layer.conv_states.get(j), layer.recurrent_states.get(j)
                    if conv is not None:  # a recording layer may hold more than the kernel needs
                        tensors.append(conv[..., -layer.conv_kernel_size[j] :].clone())
                    if rec is not None:
                        tensors.append(rec.clone())
                    tensors.append(torch.tensor([bool(layer.has_previous_state[j])]))
                out[(ls.index, "state")] = tensors
        return out


@dataclass
class _AttnBuffer:
    keys: torch.Tensor
    values: torch.Tensor
    first: int  # absolute position of buffer index 0


@dataclass
class Restorer:
    """A load sink: copies chunks into per-layer buffers, then builds the cache.

    Attention layers get every matched token (windowed layers only the last
    ``window - 1``); state layers get the snapshot of the last chunk loaded.
    """

    codec: HFCacheCodec
    matched_tokens: int
    device: torch.device
    _attn: dict[int, _AttnBuffer] = field(default_factory=dict)
    _state: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    _chunks: int = 0

    def __post_init__(self) -> None:
        n = self.matched_tokens
        for ls in self.codec.spec.layers:
            att = ls.attention
            if att is None:
                continue
            keep = n if att.window is None else min(n, att.window - 1)
            kh, kd = att.key_shape
            vh, vd = att.value_shape
            self._attn[ls.index] = _AttnBuffer(
                torch.empty((1, kh, keep, kd), dtype=att.dtype, device=self.device),
                torch.empty((1, vh, keep, vd), dtype=att.dtype, device=self.device),
                n - keep,
            )

    def __call__(self, view: ChunkView) -> None:
        if view.index != self._chunks:
            raise RuntimeError(f"chunks out of order: got {view.index}, expected {self._chunks}")
        start, end = view.token_range
        last = end >= self.matched_tokens
        tensors = iter(view.tensors)
        for group in self.codec.groups:
            part = group.part
            for li in group.layers:
                if isinstance(part, AttentionPart):
                    k, v = next(tensors), next(tensors)
                    buf = self._attn[li]
                    lo = max(start, buf.first)
                    if lo < end:
                        self.copy_attention(buf, li, k[:, lo - start :, :], v[:, lo - start :, :], lo - buf.first)
                else:
                    for j, (conv, rec) in enumerate(zip(part.conv_shapes, part.recurrent_shapes)):
                        for kind, shape in (("conv", conv), ("rec", rec)):
                            if shape is None:
                                continue
                            t = next(tensors)
                            if last:
                                self._state[(li, j, kind)] = t.to(self.device, copy=True)
        self._chunks += 1

    def copy_attention(self, buf: _AttnBuffer, layer: int, k: torch.Tensor, v: torch.Tensor, at: int) -> None:
        n = k.shape[1]
        buf.keys[0, :, at : at + n, :].copy_(k)
        buf.values[0, :, at : at + n, :].copy_(v)

    def build(self, loaded_tokens: int, cache: Cache | None = None) -> tuple[Cache, int]:
        """Fill ``cache`` (new if None) with the first ``loaded_tokens`` tokens; returns (cache, tokens used).

        A stateful model can only resume at the last chunk's snapshot, and a
        windowed layer's buffer only holds the window before the reserved end;
        if the load stopped early such models start from scratch (0 tokens used).
        """
        codec = self.codec
        cache = codec.new_cache() if cache is None else cache
        n = loaded_tokens
        if n != self.matched_tokens and (codec.spec.stateful or codec.spec.max_window):
            n = 0
        if n == 0:
            return cache, 0
        layers = codec._layers(cache)
        for ls in codec.spec.layers:
            layer = layers[ls.index]
            att, st = ls.attention, ls.state
            if att is not None:
                buf = self._attn[ls.index]
                keep = n if att.window is None else min(n, att.window - 1)
                lo = n - keep - buf.first
                k = buf.keys[:, :, lo : lo + keep, :]
                v = buf.values[:, :, lo : lo + keep, :]
                self.install_attention(layer, k, v, n)
            if st is not None:
                self.install_state(layer, ls.index, st)
        return cache, n

    def install_attention(self, layer: Any, k: torch.Tensor, v: torch.Tensor, total: int) -> None:
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k.contiguous(), v.contiguous()
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = total

    def install_state(self, layer: Any, index: int, st: StatePart) -> None:
        for j, (conv, rec) in enumerate(zip(st.conv_shapes, st.recurrent_shapes)):
            if conv is not None:
                self.install_conv(layer, index, j)
            if rec is not None:
                r = self._state[(index, j, "rec")][None]
                layer.lazy_initialization(recurrent_states=r, state_idx=j)
                layer.recurrent_states[j].copy_(r)
            layer.has_previous_state[j] = True

    def install_conv(self, layer: Any, index: int, j: int) -> None:
        """The conv window of state part ``j`` of cache layer ``index``."""
        c = self._state[(index, j, "conv")][None]
        layer.lazy_initialization(conv_states=c, state_idx=j, conv_kernel_size=c.shape[-1])
        layer.conv_states[j].copy_(c)

