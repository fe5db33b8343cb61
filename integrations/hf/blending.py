"""Prompts assembled from segments whose KV was computed alone (issue 38, second part): EPIC's selective
recompute in a transformers forward pass, which kvengine owns here (a vLLM or SGLang connector does not).

A :class:`Segment` is a prompt part (a retrieved document, a tool output) with the KV the model computed for
its tokens alone, at positions ``0..n``. :func:`blend` builds a prompt from token parts, computed here given
everything before them, and segments reused where they stand: each segment's keys are moved to its position
(:class:`~kvengine.integrations.hf.rerotation.KeyShifter`, exact for the segment attending to itself) and its
first ``recompute_first`` tokens are computed again given everything before them (EPIC's rule: those tokens
are where attention to the missing context concentrates). The rest of each segment is **approximate**: it
never attended to what precedes it. :class:`Blend` says how many tokens are, so no caller can mistake the
result for exact reuse; with ``recompute_first`` at least a segment's length, that segment is exact.

Only models whose every layer is full attention blend: a sliding window keeps a segment's last keys only
(and would need them moved across the window's edge), and recurrent state has no position-independent form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvengine.chunks.layout import KVCategory
from kvengine.errors import UnsupportedModelError

from .rerotation import KeyShifter


@dataclass(frozen=True)
class Segment:
    """A prompt part and the KV ``model`` computed for its tokens alone, at positions ``0..n``."""

    ids: torch.Tensor  # [1, n]
    keys: tuple[torch.Tensor, ...]  # per layer, [1, kv_heads, n, head_dim]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])


@dataclass(frozen=True)
class Blend:
    """A prompt's cache built from parts, and the logits after its last token."""

    cache: Any  # transformers DynamicCache, ready for generation from position ``tokens``
    logits: torch.Tensor  # [vocab], after the last token
    tokens: int
    #: Segment tokens reused without attending to what precedes them: the result is approximate iff > 0.
    approximate_tokens: int
    #: Segment tokens computed again given everything before them.
    recomputed_tokens: int


def check_blendable(model: Any) -> KeyShifter:
    """The model's key shifter, where its cache can be blended.

    :raises UnsupportedModelError: it cannot, naming why.
    """
    shifter = KeyShifter(model)  # refuses what cannot move at all
    spec = shifter.spec
    windowed = [g for g in spec.chunk_groups if g.category is not KVCategory.FULL_ATTENTION]
    if windowed:
        raise UnsupportedModelError(f"{spec.model_type}: {windowed[0].category.name} layers keep a segment's last "
                                    "keys only, so a segment reused behind other tokens cannot be blended there")
    return shifter


def encode_segment(model: Any, ids: torch.Tensor) -> Segment:
    """``ids``' KV computed alone (positions ``0..n``), as a segment record holds it."""
    with torch.no_grad():
        cache = model(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=True).past_key_values
    return Segment(ids, tuple(layer.keys for layer in cache.layers), tuple(layer.values for layer in cache.layers))


def blend(model: Any, parts: Sequence[torch.Tensor | Segment], *, recompute_first: int,
          shifter: KeyShifter | None = None) -> Blend:
    """The cache of the prompt ``parts`` (in order: token ids ``[1, n]`` computed here, or :class:`Segment`\\ s
    reused where they stand, their first ``recompute_first`` tokens computed again); the last part must be
    token ids (what the logits follow).

    :raises UnsupportedModelError: the model cannot blend. :raises ValueError: malformed parts.
    """
    from transformers import DynamicCache

    if not parts or isinstance(parts[-1], Segment):
        raise ValueError("the last part must be token ids, computed given everything before it")
    if recompute_first < 0:
        raise ValueError(f"recompute_first must be >= 0 (got {recompute_first})")
    shifter = shifter or check_blendable(model)
    cache = DynamicCache(config=model.config)
    position = approximate = recomputed = 0
    logits = torch.empty(0)
    with torch.no_grad():
        for part in parts:
            if isinstance(part, Segment):
                fresh = min(recompute_first, part.length)
                if fresh:
                    _forward(model, part.ids[:, :fresh], position, cache)
                moved = shifter.shift([k[:, :, fresh:] for k in part.keys], position)  # token j: j -> position + j
                for layer, (k, v) in enumerate(zip(moved, part.values)):
                    cache.update(k, v[:, :, fresh:], layer)
                position += part.length
                approximate += part.length - fresh
                recomputed += fresh
            else:
                logits = _forward(model, part, position, cache)
                position += int(part.shape[1])
    return Blend(cache, logits, position, approximate, recomputed)


def _forward(model: Any, ids: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
    """Run ``ids`` at positions ``start..`` over ``cache`` (extended in place): the last position's logits."""
    positions = torch.arange(start, start + ids.shape[1])[None]
    out = model(ids, position_ids=positions, past_key_values=cache, use_cache=True)
    return out.logits[0, -1]
