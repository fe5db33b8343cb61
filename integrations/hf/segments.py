"""Segments cached once and reused at any position (issue 38, third part): :class:`SegmentCache`.

A segment (a retrieved document, a tool output) is cached under an identity that does not depend on what
precedes it: its own tokens, chained from its first, in the model's namespace marked as the segment kind
(:func:`segment_namespace`). An exact reader binds the model's own namespace, whose digest differs, so no
exact lookup can ever be served segment KV, and no segment lookup exact KV.

:meth:`SegmentCache.blend` assembles a prompt from token parts and :class:`SegmentRef`\\ s: each segment's KV
is restored from the cache where kvengine holds it (whole chunks; the rest is computed, alone, and stored for
next time), moved to its place and blended (:func:`~kvengine.integrations.hf.blending.blend`). The result
says how many of its tokens are approximate; the answer of a blend is never exact reuse unless that count
is 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvengine import Namespace

from .blending import Blend, Segment, blend, check_blendable
from .generator import AttachedModel, as_tokens

#: The namespace mark of segment KV (computed alone, from the segment's first token).
SEGMENT_KIND = "kvengine-segment:v1"


def segment_namespace(namespace: Namespace) -> Namespace:
    """``namespace`` marked as holding segments: a different digest, so exact readers never meet its chunks."""
    if SEGMENT_KIND in namespace.extra_keys:
        return namespace
    return namespace.with_updates(extra_keys=(*namespace.extra_keys, SEGMENT_KIND))


@dataclass(frozen=True)
class SegmentRef:
    """A reusable part of a prompt, by its token ids: its KV comes from the segment cache."""

    ids: torch.Tensor


@dataclass(frozen=True)
class SegmentBlend:
    """A blended prompt (:class:`~kvengine.integrations.hf.blending.Blend`) and how much the cache supplied."""

    blend: Blend
    #: Segment tokens whose KV was restored from kvengine (the rest of each segment was computed alone).
    cached_tokens: int

    @property
    def reused_tokens_approximate(self) -> int:
        """Segment tokens reused without attending to what precedes them (0: the blend is exact)."""
        return self.blend.approximate_tokens


class SegmentCache:
    """The segments of one attached model, cached in its engine under the segment kind of its namespace.

    :raises UnsupportedModelError: the model cannot blend (see :func:`check_blendable`).
    """

    def __init__(self, attached: AttachedModel) -> None:
        self.attached = attached
        self.shifter = check_blendable(attached.model)
        self.binding = attached.engine.bind(segment_namespace(attached.namespace), attached.layout)
        self._requests = itertools.count()

    def segment(self, ids: torch.Tensor) -> tuple[Segment, int]:
        """The KV of ``ids`` computed alone, and how many of its tokens the cache supplied. What the cache
        lacked is computed over what it supplied and its whole chunks stored for next time."""
        attached, tokens = self.attached, as_tokens(ids, "segment ids")
        ctx = attached.context(binding=self.binding)
        cache, cached, _ = attached.restore(ctx, tokens, f"segment-{next(self._requests)}")
        attached.prefill(ctx, tokens, cache, cached, None)
        attached.store(ctx, tokens, cache, {})
        keys = tuple(layer.keys for layer in cache.layers)
        values = tuple(layer.values for layer in cache.layers)
        return Segment(tokens[None], keys, values), cached

    def blend(self, parts: Sequence[torch.Tensor | SegmentRef], *, recompute_first: int) -> SegmentBlend:
        """The prompt ``parts`` (token ids, or segments by their ids) blended, the last part token ids."""
        built: list[torch.Tensor | Segment] = []
        cached = 0
        for part in parts:
            if isinstance(part, SegmentRef):
                segment, supplied = self.segment(part.ids)
                built.append(segment)
                cached += supplied
            else:
                built.append(as_tokens(part)[None])
        result = blend(self.attached.model, built, recompute_first=recompute_first, shifter=self.shifter)
        return SegmentBlend(result, cached)
