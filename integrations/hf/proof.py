"""Provenance checks of the HF integration: the namespace canary and shadow checks of hits.

* :func:`prove_namespace` -- at attach (and whenever the weights change and
  the model moves to a new namespace): the KV this model computes for a fixed
  probe prompt is compared with the canary its namespace's first writer left
  on the persistent or shared tiers (or becomes that canary), before any
  chunk of the namespace is served (:func:`kvengine.trust.provenance.check_namespace_canary`).
* :class:`ShadowCheck` -- a sampled hit is not loaded: the request is
  prefilled in full and the stored chunks are compared with the KV just
  computed (:func:`kvengine.trust.provenance.compare_kv`).

Either mismatch quarantines the namespace: the model keeps answering, from
its own prefill, and nothing of that namespace is served again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvengine.lookups import LookupResult
from kvengine.trust.provenance import (
    CanaryResult,
    KVComparison,
    check_namespace_canary,
    compare_kv,
    namespace_lossy_bound,
    settle,
    worst,
)
from kvengine.types import ChunkView

from .codec import ChunkUnavailable, Snapshot

if TYPE_CHECKING:
    from .generator import AttachedModel, RequestContext

logger = logging.getLogger("kvengine.hf")


def vocab_size(model: Any) -> int:
    cfg = model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(text, "vocab_size", None) or cfg.vocab_size)


def probe_tokens(model: Any, n: int, *, seed: int = 0) -> torch.Tensor:
    """A fixed pseudo-random prompt (the same in every process), clear of the usual special ids."""
    g = torch.Generator().manual_seed(1234 + seed)
    vocab = vocab_size(model)
    return torch.randint(min(4, vocab - 1), vocab, (n,), generator=g)


def probe_chunk(attached: AttachedModel) -> list[torch.Tensor]:
    """The KV of the probe's first chunk, in the model's chunk layout."""
    c = attached.chunk_size
    ids = probe_tokens(attached.model, c + 1)
    encoder_ids = probe_tokens(attached.model, c + 3, seed=1) if attached.spec.encoder_decoder else None
    ctx = attached.context(encoder_ids)
    cache = attached.codec.new_cache()
    attached.codec.record(cache)
    snapshots: dict[int, Snapshot] = {}
    attached.prefill(ctx, ids[:c], cache, 0, snapshots)
    return [t.clone() for t in attached.codec.chunk_tensors(cache, 0, snapshots)]


def prove_namespace(attached: AttachedModel) -> CanaryResult:
    """Run the namespace canary for ``attached``'s current binding (see the module docstring)."""
    assert attached.binding is not None
    result = check_namespace_canary(attached.engine, attached.binding, probe_chunk(attached))
    if not result.serving:
        logger.error("kvengine: namespace of %r is quarantined (%s): this model answers from its own prefill, "
                     "no cached KV is served", attached.namespace.model, result.outcome.value)
    return result


class ShadowCheck:
    """One sampled hit, compared chunk by chunk with the KV the request computes."""

    def __init__(self, attached: AttachedModel, ctx: RequestContext, hit: LookupResult) -> None:
        self._attached = attached
        self._ctx = ctx
        self._hit = hit

    @property
    def tokens(self) -> int:
        return self._hit.tokens

    def run(self, cache: Any, snapshots: dict[int, Snapshot]) -> KVComparison | None:
        """Compare the stored chunks with ``cache`` (the request prefilled from token 0); quarantine on
        mismatch. None when nothing could be compared (counted as ``skipped``, never as exact)."""
        attached, codec = self._attached, self._attached.codec
        results: list[KVComparison] = []
        held = True
        lossy_bound = namespace_lossy_bound(attached.engine, self._ctx.binding)  # a hit from a lossy tier

        def compare(view: ChunkView) -> None:
            nonlocal held
            if held:
                try:
                    computed = codec.chunk_tensors(cache, view.index, snapshots)
                except ChunkUnavailable:  # the request no longer holds this chunk (a sliding window moved on)
                    held = False
                    return
                results.append(compare_kv(view.tensors, computed, lossy_bound=lossy_bound))

        attached.engine.load(self._hit, compare)
        verdict = worst(results)  # None: e.g. a sliding window moved past every chunk
        settle(attached.engine, self._ctx.binding, "shadow", verdict,
               "a shadow-checked hit differs from the KV this model computed for it", tokens=str(self.tokens))
        return verdict
