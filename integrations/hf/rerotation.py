"""Position fix-up of cached segments for transformers models (issue 38): the rotation of
:mod:`kvengine.semantics.rerotation`, taken from the model's own rotary embedding module, so every variant is
rotated exactly as the model rotates it.

:class:`KeyShifter` checks a model once, refusing by name what is not proved to move (recurrent state, MLA
latents, absolute position embeddings, RoPE variants whose frequencies depend on the sequence length), then
proves the move on the model itself (a probe's keys computed at one position, moved, against the keys the
model computes at the other: a rotary layout other than the one :func:`rotate` turns, such as GLM's
interleaved pairs, fails there and is refused), and moves a segment's cached keys, layer by layer,
``delta`` positions later.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from kvengine.chunks.layout import KVCategory
from kvengine.errors import UnsupportedModelError
from kvengine.semantics.families import derive_spec, rope_types
from kvengine.semantics.rerotation import rope_verdict, rotate

#: Largest difference of moved keys from recomputed ones the proof accepts, relative to the keys' scale.
PROOF_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.float16: 2e-2}

#: Cache parts whose keys are rotated as a model's attention rotates them (full and windowed attention).
_MOVABLE = frozenset({KVCategory.FULL_ATTENTION, KVCategory.SLIDING_WINDOW})


class KeyShifter:
    """Moves cached keys of ``model`` to later positions.

    :raises UnsupportedModelError: the model's cache cannot move between positions exactly, naming why.
    """

    def __init__(self, model: Any) -> None:
        config = model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        name = getattr(text, "model_type", None) or getattr(config, "model_type", "<unknown>")
        self.spec = spec = derive_spec(config)  # refuses what kvengine cannot cache at all, by name
        if spec.stateful:
            raise UnsupportedModelError(f"{name}: recurrent state summarizes everything before it, so it has no "
                                        "position-independent form to move")
        for group in spec.chunk_groups:
            if group.category not in _MOVABLE:
                raise UnsupportedModelError(f"{name}: {group.category.name} caches are not proved to move between "
                                            "positions")
        for rope in sorted(rope_types(text)):
            reason = rope_verdict(rope)
            if reason is not None:
                raise UnsupportedModelError(f"{name}: {reason}")
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        self._embedding: Any = getattr(decoder, "rotary_emb", None)
        if self._embedding is None:
            raise UnsupportedModelError(f"{name}: no rotary embedding; positions enter the hidden states as absolute "
                                        "embeddings, so every layer's keys and values depend on them")
        self._by_type = "layer_type" in inspect.signature(self._embedding.forward).parameters
        self._layer_types: list[str] = list(getattr(text, "layer_types", None) or [])
        self.layers = int(text.num_hidden_layers)
        self._prove(model, str(name), int(text.vocab_size))

    def _prove(self, model: Any, name: str, vocab: int, delta: int = 37) -> None:
        """A probe's keys cached at positions ``0..``, moved ``delta`` later, must equal the keys the model
        caches for it at ``delta..`` (and its values must not depend on the position at all)."""
        ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(38))
        here, there = (kv_at(model, ids, start) for start in (0, delta))
        moved = self.shift(here[0], delta)
        scale = max(float(k.abs().max()) for k in there[0])
        tolerance = PROOF_RTOL.get(there[0][0].dtype, PROOF_RTOL[torch.float16]) * max(1.0, scale)
        key_gap = max(float((a.float() - b.float()).abs().max()) for a, b in zip(moved, there[0]))
        value_gap = max(float((a.float() - b.float()).abs().max()) for a, b in zip(here[1], there[1]))
        if max(key_gap, value_gap) > tolerance:
            raise UnsupportedModelError(f"{name}: a probe's keys moved {delta} positions differ from the keys the "
                                        f"model computes there by {key_gap:.3g} (values by {value_gap:.3g}; "
                                        f"tolerance {tolerance:.3g}): its rotary layout is not the one kvengine "
                                        "moves, so its segments cannot be moved")

    def angles(self, layer: int, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosines and sines (float32, ``[rotary_dim]``) of ``layer``'s rotation for ``delta`` positions, without
        the attention factor some variants multiply them by (the cached keys carry it already)."""
        frequencies = next(iter(self._embedding.buffers()), None)  # where the embedding computes
        device = frequencies.device if frequencies is not None else None
        like = torch.empty(0, dtype=torch.float32, device=device)
        position = torch.tensor([[delta]], device=device)
        with torch.no_grad():
            if self._by_type:
                kind = self._layer_types[layer]
                cos, sin = self._embedding(like, position, kind)
                factor = getattr(self._embedding, f"{kind}_attention_scaling", 1.0)
            else:
                cos, sin = self._embedding(like, position)
                factor = getattr(self._embedding, "attention_scaling", 1.0)
        return cos[0, 0] / factor, sin[0, 0] / factor

    def shift(self, keys: Sequence[torch.Tensor], delta: int) -> list[torch.Tensor]:
        """Each layer's cached keys (``[batch, heads, tokens, head_dim]``, in layer order) moved ``delta``
        positions later."""
        if len(keys) != self.layers:
            raise ValueError(f"keys of {len(keys)} layers for a model of {self.layers}")
        if delta < 0:
            raise ValueError(f"delta must be >= 0 (got {delta}): segments move behind what precedes them")
        cached: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        out = []
        for i, k in enumerate(keys):
            kind = self._layer_types[i] if self._by_type else ""
            if kind not in cached:
                cached[kind] = self.angles(i, delta)
            cos, sin = cached[kind]
            out.append(rotate(k, cos.to(k.device), sin.to(k.device)))
        return out


def kv_at(model: Any, ids: torch.Tensor, start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The keys and values ``model`` caches for ``ids`` alone at positions ``start..`` (per layer)."""
    with torch.no_grad():
        cache = model(ids, position_ids=torch.arange(start, start + ids.shape[1])[None], use_cache=True).past_key_values
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
