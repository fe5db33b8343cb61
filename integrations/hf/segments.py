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

from kvengine.chunks.keys import Namespace
from kvengine.errors import AttachError

from .blending import Blend, Blender, RecomputeBudget, Segment, encode_segment
from .decoding import GREEDY, DecodingRules, Sampling, sample
from .generator import AttachedModel, as_tokens

#: EPIC's rule with a small budget: each segment's first 8 tokens computed again.
DEFAULT_BUDGET = RecomputeBudget(first=8)

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
class BlendCanary:
    """What blending costs this model, measured at :class:`SegmentCache` construction: a probe prompt (an
    instruction, two documents, a question) blended with the cache's recompute budget against its full
    prefill."""

    budget: RecomputeBudget
    #: KL divergence of the next-token distribution after the probe from the full prefill's.
    kl: float
    #: Whether the blend's most likely next token is the full prefill's.
    same_top1: bool
    bound: float


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


@dataclass(frozen=True)
class SegmentGeneration:
    """Tokens generated after a blended prompt, and the blend (its approximate tokens)."""

    tokens: list[int]
    prompt: SegmentBlend

    @property
    def reused_tokens_approximate(self) -> int:
        return self.prompt.reused_tokens_approximate


class SegmentCache:
    """The segments of one attached model, cached in its engine under the segment kind of its namespace.

    ``budget``: the tokens of each segment computed again given everything before them (the default budget of
    :meth:`blend`, and the least it accepts). ``quality_bound``: the largest KL divergence of the next-token
    distribution from a full prefill's that the blend canary accepts (:class:`BlendCanary`); over it,
    blending is refused for this model.

    :raises UnsupportedModelError: the model cannot blend (see :class:`Blender`).
    :raises AttachError: the blend canary measured the model over ``quality_bound``.
    """

    def __init__(self, attached: AttachedModel, *, budget: RecomputeBudget = DEFAULT_BUDGET,
                 quality_bound: float = 0.01) -> None:
        if quality_bound < 0:
            raise ValueError(f"quality_bound must be >= 0 (got {quality_bound})")
        self.attached = attached
        self.budget = budget
        self.blender = Blender(attached.model)
        self.canary = self._probe(quality_bound)
        if self.canary.kl > quality_bound:
            raise AttachError(f"blend canary: with recompute budget ({budget}), the next-token "
                              f"distribution is {self.canary.kl:.4g} (KL) from a full prefill's, over the bound "
                              f"{quality_bound}: blending is refused for this model (recompute more, or raise the "
                              "bound)")
        self.binding = attached.engine.bind(segment_namespace(attached.namespace), attached.layout)
        self._requests = itertools.count()

    def _probe(self, bound: float) -> BlendCanary:
        """Blend a fixed probe (nothing cached) and compare it with its full prefill."""
        model = self.attached.model
        g = torch.Generator().manual_seed(38)
        vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        instruction, question = (torch.randint(4, vocab, (1, n), generator=g) for n in (12, 6))
        docs = [encode_segment(model, torch.randint(4, vocab, (1, n), generator=g)) for n in (40, 27)]
        result = self.blender.blend([instruction, *docs, question], self.budget)
        with torch.no_grad():
            full = model(torch.cat([instruction, *(d.ids for d in docs), question], dim=1)).logits[0, -1]
        want, got = torch.log_softmax(full.float(), -1), torch.log_softmax(result.logits.float(), -1)
        kl = float(torch.sum(want.exp() * (want - got)))
        return BlendCanary(self.budget, max(kl, 0.0), bool(got.argmax() == want.argmax()), bound)

    def segment(self, ids: torch.Tensor) -> tuple[Segment, int]:
        """The KV of ``ids`` computed alone, and how many of its tokens the cache supplied. What the cache
        lacked is computed over what it supplied and its whole chunks stored for next time."""
        attached, tokens = self.attached, as_tokens(ids, "segment ids")
        ctx = attached.context(binding=self.binding)
        cache, cached, _ = attached.restore(ctx, tokens, f"segment-{next(self._requests)}")
        attached.prefill(ctx, tokens, cache, cached, None)
        if len(tokens) // attached.chunk_size * attached.chunk_size > cached:  # whole chunks the cache lacks
            attached.store(ctx, tokens, cache, {})
        keys = tuple(layer.keys for layer in cache.layers)
        values = tuple(layer.values for layer in cache.layers)
        return Segment(tokens[None], keys, values), cached

    def blend(self, parts: Sequence[torch.Tensor | SegmentRef], *,
              budget: RecomputeBudget | None = None) -> SegmentBlend:
        """The prompt ``parts`` (token ids, or segments by their ids) blended, the last part token ids;
        ``budget`` at least the canary's (a smaller one was not measured)."""
        budget = budget or self.budget
        if not budget.covers(self.budget):
            raise ValueError(f"recompute budget ({budget}) is below the budget the blend canary measured "
                             f"({self.budget})")
        built: list[torch.Tensor | Segment] = []
        cached = 0
        for part in parts:
            if isinstance(part, SegmentRef):
                segment, supplied = self.segment(part.ids)
                built.append(segment)
                cached += supplied
            else:
                built.append(as_tokens(part)[None])
        result = self.blender.blend(built, budget)
        self.attached.engine.metrics.approximate_tokens.labels(model=self.attached.namespace.model).inc(
            result.approximate_tokens)
        return SegmentBlend(result, cached)

    def generate(self, parts: Sequence[torch.Tensor | SegmentRef], *, max_new_tokens: int,
                 sampling: Sampling = GREEDY, eos_token_id: int | Sequence[int] | None = -1,
                 budget: RecomputeBudget | None = None) -> SegmentGeneration:
        """Up to ``max_new_tokens`` tokens after the blended prompt ``parts`` (see :meth:`blend`), decoded over its
        cache; sampling and stopping as :meth:`AttachedModel.generate <.generator.AttachedModel.generate>`'s."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
        rules = DecodingRules.of(self.attached.model, eos_token_id)
        prompt = self.blend(parts, budget=budget)
        model, cache = self.attached.model, prompt.blend.cache
        logits, start = prompt.blend.logits, prompt.blend.tokens
        tokens: list[int] = []
        rng = torch.Generator().manual_seed(sampling.seed)
        with torch.no_grad():
            for i in range(max_new_tokens):
                if i:
                    if tokens[-1] in rules.stops:
                        break
                    logits = model(torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[start + i - 1]]),
                                   past_key_values=cache, use_cache=True).logits[0, -1]
                tokens.append(sample(logits, sampling, rng, rules, length=start + i, last=i + 1 == max_new_tokens))
        return SegmentGeneration(tokens, prompt)
