"""Prompts assembled from segments whose KV was computed alone (issue 38, second part), with selective
recompute in a transformers forward pass, which kvengine owns here (a vLLM or SGLang connector does not).

A :class:`Segment` is a prompt part (a retrieved document, a tool output) with the KV the model computed for
its tokens alone, at positions ``0..n``. :meth:`Blender.blend` builds a prompt from token parts, computed
given everything before them, and segments reused where they stand: each segment's keys are moved to its
position (:class:`~kvengine.integrations.hf.rerotation.KeyShifter`, exact for the segment attending to
itself) and the tokens a :class:`RecomputeBudget` names are computed again given everything before them:
each segment's first tokens (EPIC), and those whose KV deviates most at a check layer (CacheBlend). The rest
of each segment is **approximate**: it never attended to what precedes it. :class:`Blend` says how many
tokens are, so no caller can mistake the result for exact reuse; a budget that recomputes a whole segment
makes that segment exact.

Only models whose every layer is full attention blend: a sliding window keeps a segment's last keys only
(and would need them moved across the window's edge), and recurrent state has no position-independent form.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvengine.chunks.layout import KVCategory
from kvengine.errors import UnsupportedModelError

from .layerwise import KVTable, LayerwiseForward
from .rerotation import KeyShifter, kv_at


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


@dataclass(frozen=True)
class RecomputeBudget:
    """Which tokens of reused segments are computed again, given everything before them, in every layer.

    ``first``: each segment's first tokens (EPIC's rule: attention to the missing context concentrates there).
    ``deviating``: the fraction of the other segment tokens whose KV deviates most from the reused KV at
    ``check_layer`` (CacheBlend's rule); every token is computed up to that layer to measure it, so this
    costs ``check_layer + 1`` layers of a full prefill besides the chosen tokens.
    """

    first: int = 0
    deviating: float = 0.0
    check_layer: int = 1

    def __post_init__(self) -> None:
        if self.first < 0:
            raise ValueError(f"RecomputeBudget.first must be >= 0 (got {self.first})")
        if not 0.0 <= self.deviating <= 1.0:
            raise ValueError(f"RecomputeBudget.deviating must be a fraction in [0, 1] (got {self.deviating})")
        if self.check_layer < 0:
            raise ValueError(f"RecomputeBudget.check_layer must be >= 0 (got {self.check_layer})")

    def covers(self, other: RecomputeBudget) -> bool:
        """Whether this budget recomputes at least what ``other`` does, by the same rules."""
        return self.first >= other.first and self.deviating >= other.deviating and (
            other.deviating == 0 or self.check_layer == other.check_layer)

    def __str__(self) -> str:
        parts = [f"first {self.first}"] if self.first or not self.deviating else []
        if self.deviating:
            parts.append(f"{self.deviating:.0%} deviating at layer {self.check_layer}")
        return " + ".join(parts)


def encode_segment(model: Any, ids: torch.Tensor) -> Segment:
    """``ids``' KV computed alone (positions ``0..n``), as a segment record holds it."""
    keys, values = kv_at(model, ids, 0)
    return Segment(ids, tuple(keys), tuple(values))


class Blender:
    """Blends prompts for one model: its key shifter and its layer-by-layer forward, both proved when built.

    :raises UnsupportedModelError: the model cannot blend, naming why (a layer kind that keeps a segment's last
        keys only, recurrent state, a RoPE variant not proved, a forward the layer loop does not reproduce).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.shifter = KeyShifter(model)  # refuses what cannot move at all
        spec = self.shifter.spec
        windowed = [g for g in spec.chunk_groups if g.category is not KVCategory.FULL_ATTENTION]
        if windowed:
            raise UnsupportedModelError(f"{spec.model_type}: {windowed[0].category.name} layers keep a segment's "
                                        "last keys only, so a segment reused behind other tokens cannot be "
                                        "blended there")
        self.forward = LayerwiseForward(model)

    def blend(self, parts: Sequence[torch.Tensor | Segment], budget: RecomputeBudget) -> Blend:
        """The cache of the prompt ``parts`` (in order: token ids ``[1, n]``, computed here, or :class:`Segment`\\ s
        reused where they stand, the tokens ``budget`` names computed again); the last part must be token ids
        (what the logits follow). All computed tokens run together, one layer at a time.

        :raises ValueError: malformed parts.
        """
        from transformers import DynamicCache

        if not parts or isinstance(parts[-1], Segment):
            raise ValueError("the last part must be token ids, computed given everything before it")
        if budget.deviating and budget.check_layer >= self.forward.num_layers:
            raise ValueError(f"check_layer {budget.check_layer} is not before the last of the model's "
                             f"{self.forward.num_layers} layers")
        ids = torch.cat([p.ids if isinstance(p, Segment) else p for p in parts], dim=1)
        n = int(ids.shape[1])
        computed = torch.ones(n, dtype=torch.bool)
        candidates = torch.zeros(n, dtype=torch.bool)  # segment tokens the budget's first tokens leave
        starts = list(itertools.accumulate((int(p.ids.shape[1] if isinstance(p, Segment) else p.shape[1])
                                            for p in parts), initial=0))
        placed = [(start, part) for start, part in zip(starts, parts) if isinstance(part, Segment)]
        for start, segment in placed:
            rest = slice(start + min(budget.first, segment.length), start + segment.length)
            computed[rest], candidates[rest] = False, True
        count = round(budget.deviating * int(candidates.sum()))
        choose = (budget.check_layer, count, candidates) if count else None
        result = self.forward.run(ids, self._table(placed, n), computed, choose=choose)
        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in enumerate(zip(result.table.keys, result.table.values)):
            cache.update(k, v, layer)
        approximate = int((candidates & ~result.computed).sum())
        return Blend(cache, result.logits, n, approximate, sum(s.length for _, s in placed) - approximate)

    def _table(self, placed: list[tuple[int, Segment]], n: int) -> KVTable | None:
        """Every layer's KV of an ``n``-token prompt with each segment's moved to where it stands (zeros
        elsewhere: those tokens are computed); None without segments."""
        if not placed:
            return None
        first = placed[0][1]
        keys = [k.new_zeros((*k.shape[:2], n, k.shape[3])) for k in first.keys]
        values = [v.new_zeros((*v.shape[:2], n, v.shape[3])) for v in first.values]
        for start, segment in placed:
            moved = self.shifter.shift(list(segment.keys), start)  # token j: j -> start + j
            for layer, (k, v) in enumerate(zip(moved, segment.values)):
                keys[layer][:, :, start: start + segment.length] = k
                values[layer][:, :, start: start + segment.length] = v
        return KVTable(keys, values)
