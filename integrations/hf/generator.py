"""A plain transformers generate loop that reuses cached prefixes through kvengine.

Per request (batch size 1):

1. ``lookup`` the longest cached chunk prefix, leaving at least one token to compute;
2. ``load`` it into a fresh transformers cache (:class:`~.codec.Restorer`);
3. prefill only the suffix with explicit positions - in chunk-sized pieces
   for stateful families, snapshotting their state at every chunk boundary;
4. sample the first token (TTFT), then ``store`` the prompt's new full chunks;
5. decode; at the end store the chunks completed by generated tokens.

Sliding-window layers keep this request's K/V until it ends (transformers'
past recording) so every new chunk can be stored. An :class:`AttachedModel`
runs one request at a time (the model and its caches are not thread-safe).

Build instances with :func:`kvengine.integrations.hf.attach`, which verifies
the model with the attach canary first.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvengine import KVEngine, Namespace, Reservation
from kvengine.chunks.hashing import token_bytes
from kvengine.chunks.layout import ChunkLayout
from kvengine.errors import InvalidRequestError, ModelChangedError, UnsupportedModelError
from kvengine.semantics.canary import CanaryReport
from kvengine.semantics.spec import ModelKVSpec
from kvengine.trust.provenance import CanaryResult, ShadowSampler
from kvengine.types import ChunkView, ModelBinding

from .codec import ChunkUnavailable, HFCacheCodec, Snapshot
from .proof import ShadowCheck, prove_namespace
from .runner import ModelRunner
from .weights_watch import WeightsWatch, model_fingerprint

logger = logging.getLogger("kvengine.hf")

_ENCODER_BINDINGS = 256
_request_ids = itertools.count()


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """Greedy when ``temperature == 0``; otherwise temperature / top-k sampling with ``seed``."""

    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0")
        if self.top_k is not None and self.top_k <= 0:
            raise InvalidRequestError("top_k must be positive")


GREEDY = Sampling()


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationResult:
    """One request: what was reused, computed, generated and stored, and how long it took."""

    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    new_tokens: tuple[int, ...]
    stored_chunks: int
    #: lookup + load + cache rebuild (0 when the cache was not asked).
    restore_s: float
    ttft_s: float
    total_s: float
    load_ok: bool
    #: a shadow check ran instead of the load: ``exact``, ``close``, ``mismatch``, or ``skipped`` when no
    #: chunk could be compared (None: none ran)
    shadow: str | None = None


@dataclass(slots=True)
class RequestContext:
    """Where a request's chunks live (and the encoder outputs of encoder-decoder models)."""

    binding: ModelBinding
    encoder_outputs: Any = None


def as_tokens(ids: Any, what: str = "input_ids") -> torch.Tensor:
    """A 1-D int64 CPU tensor; batches other than 1 are refused."""
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise InvalidRequestError(
                f"{what}: batch size {t.shape[0]}; the HF integration runs batch size 1 (padded batches would need "
                f"per-row positions and masks that a shared prefix cache cannot express); run rows one by one")
        t = t[0]
    if t.dim() != 1 or t.numel() == 0:
        raise InvalidRequestError(f"{what}: expected a non-empty 1-D token sequence, got shape {tuple(t.shape)}")
    return t.to(dtype=torch.long, device="cpu")


class AttachedModel:
    """A verified (or explicitly unverified) model bound to an engine."""

    def __init__(self, model: Any, engine: KVEngine, spec: ModelKVSpec, layout: ChunkLayout,
                 namespace: Namespace, *, content_fingerprint: str = "", explicit_fingerprint: bool = False) -> None:
        self.model = model
        self.engine = engine
        self.spec = spec
        self.layout = layout
        self.namespace = namespace
        self.chunk_size = layout.chunk_size
        self.codec = HFCacheCodec(spec, model.config, layout)
        self.runner = ModelRunner(model, spec)
        self.binding: ModelBinding | None = None
        #: the attach canary's report (None: ``debug_unverified``); for a lossy attach it carries the
        #: measured error of a hit read through the lower tiers' codec (``codec``, ``restored_error``,
        #: ``lossy_logit_error``, ``lossy_greedy_agreement``)
        self.canary: CanaryReport | None = None
        #: the namespace canary's verdict at attach (or after the last weights change)
        self.proof: CanaryResult | None = None
        self._encoder_bindings: OrderedDict[tuple[bytes, str], ModelBinding] = OrderedDict()
        self._content = content_fingerprint
        self._explicit = explicit_fingerprint
        self._stale = False  # weights changed under an explicit fingerprint: every request is refused
        self._watch = WeightsWatch(model)
        self._shadow = ShadowSampler(engine.config.shadow)

    # -- identity -------------------------------------------------------------------
    def check_weights(self) -> bool:
        """Before a request: if the weights changed since attach (or the last check), move to the new
        weights' namespace (proved by the namespace canary), so no chunk of the old ones is served.
        Returns whether the namespace changed.

        :raises ModelChangedError: the weights changed but the namespace was given an explicit
            fingerprint at attach, which kvengine cannot update for you.
        """
        if not self._stale and not self._watch.changed():
            return False
        content = model_fingerprint(self.model)
        if content == self._content:  # moved or touched, same bytes (or changed back)
            self._stale = False
            return False
        if self._explicit:  # refused until the weights are back or the model is attached again
            self._stale = True
            raise ModelChangedError(
                f"the weights of {self.namespace.model!r} changed since attach, but it was attached with an explicit "
                "fingerprint; attach it again with the new weights' fingerprint (or none, to derive it)")
        self._content = content
        logger.warning("kvengine: weights of %r changed since attach; moving to the new weights' namespace (no KV "
                       "of the old weights is served)", self.namespace.model)
        self.namespace = self.namespace.with_updates(model_fingerprint=content)
        self.binding = self.engine.bind(self.namespace, self.layout)
        self._encoder_bindings.clear()
        self.engine.metrics.namespace_changes.inc()
        if self.namespace.verified:
            self.proof = prove_namespace(self)
        return True

    # -- context ------------------------------------------------------------------
    def context(self, encoder_input_ids: Any = None, *, binding: ModelBinding | None = None) -> RequestContext:
        """The binding a request uses: the model's, or for encoder-decoder models one per encoder input."""
        base = binding or self.binding
        if not self.spec.encoder_decoder:
            if encoder_input_ids is not None:
                raise InvalidRequestError(f"{self.spec.model_type} is decoder-only; encoder_input_ids is not accepted")
            if base is None:
                raise InvalidRequestError("model is not bound (attach() did not finish)")
            return RequestContext(base)
        if encoder_input_ids is None:
            raise InvalidRequestError(f"{self.spec.model_type} is an encoder-decoder model: pass encoder_input_ids")
        enc = as_tokens(encoder_input_ids, "encoder_input_ids")
        ns = base.namespace if base is not None else self.namespace
        digest = xxhash.xxh3_128_hexdigest(token_bytes(enc))
        key = (ns.digest(), digest)
        bound = self._encoder_bindings.get(key)
        if bound is None:
            bound = self.engine.bind(ns.with_updates(extra_keys=(*ns.extra_keys, f"encoder-input:{digest}")),
                                     self.layout)
            self._encoder_bindings[key] = bound
            while len(self._encoder_bindings) > _ENCODER_BINDINGS:
                self._encoder_bindings.popitem(last=False)
        else:
            self._encoder_bindings.move_to_end(key)
        return RequestContext(bound, self.runner.encode(enc))

    # -- building blocks (also used by the canary) ------------------------------------
    def restore(self, ctx: RequestContext, ids: torch.Tensor, request_id: str, *,
                through: Callable[[ChunkView], ChunkView] | None = None) -> tuple[Any, int, bool]:
        """Look up and load the longest cached prefix (<= len-1 tokens); returns (cache, tokens, load ok).

        ``through`` rewrites every loaded chunk before it reaches the cache (the attach canary passes
        its chunks through the lower tiers' lossy codec with it)."""
        return self._load(self.engine.lookup(ctx.binding, request_id, ids, max_tokens=len(ids) - 1), through)

    def _load(self, res: Reservation,
              through: Callable[[ChunkView], ChunkView] | None = None) -> tuple[Any, int, bool]:
        if res.matched_tokens == 0:
            self.engine.release(res)
            return self.codec.new_cache(), 0, True
        restorer = self.codec.restorer(res.matched_tokens, self.runner.device)
        sink: Callable[[ChunkView], None] = restorer if through is None else lambda view: restorer(through(view))
        result = self.engine.load(res, sink)
        cache, used = restorer.build(result.loaded_tokens)
        if not result.ok:
            logger.warning("kvengine: load delivered %d of %d tokens; recomputing the rest",
                           result.loaded_tokens, result.promised_tokens)
        return cache, used, result.ok

    def prefill(self, ctx: RequestContext, ids: torch.Tensor, cache: Any, start: int,
                snapshots: dict[int, Snapshot] | None, *, all_logits: bool = False) -> torch.Tensor:
        """Compute tokens ``ids[start:]`` over ``cache``; snapshot state at chunk ends when asked.

        Stateful families run in chunk-sized pieces so every boundary has a
        snapshot; others run one piece.
        """
        n, c = len(ids), self.chunk_size
        bounds = [n]
        if snapshots is not None and self.spec.stateful:
            first = (start // c + 1) * c
            bounds = [*range(first, n, c), n]
        logits: list[torch.Tensor] = []
        a = start
        for b in bounds:
            if b <= a:
                continue
            logits.append(self.runner.forward(ids[a:b], cache, a, encoder_outputs=ctx.encoder_outputs,
                                              all_logits=all_logits))
            if snapshots is not None and self.spec.stateful and b % c == 0:
                snapshots[b // c - 1] = self.codec.snapshot(cache)
            a = b
        return torch.cat(logits) if all_logits else logits[-1]

    def store(self, ctx: RequestContext, tokens: torch.Tensor, cache: Any, snapshots: dict[int, Snapshot]) -> int:
        """Store the full chunks of ``tokens`` not cached yet; returns chunks stored."""
        full = len(tokens) // self.chunk_size * self.chunk_size
        if full == 0:
            return 0

        def source(index: int, start: int, end: int) -> list[torch.Tensor] | None:
            try:
                return self.codec.chunk_tensors(cache, index, snapshots)
            except ChunkUnavailable as exc:  # e.g. a sliding window moved past it: the store ends here
                logger.info("kvengine: store stopped at chunk %d: %s", index, exc)
                return None

        return self.engine.store(ctx.binding, tokens[:full], source).stored_chunks

    # -- the generate loop ---------------------------------------------------------------
    def generate(
        self,
        input_ids: Any,
        *,
        max_new_tokens: int = 32,
        encoder_input_ids: Any = None,
        sampling: Sampling = GREEDY,
        eos_token_id: int | Sequence[int] | None = -1,
        use_cache: bool = True,
        store: bool = True,
        request_id: str | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``input_ids`` (batch size 1).

        ``eos_token_id=-1`` means the model's generation config; None never stops early.
        ``use_cache=False`` skips the lookup (plain prefill); ``store=False`` stores nothing.
        """
        if max_new_tokens <= 0:
            raise InvalidRequestError("max_new_tokens must be positive")
        t0 = time.perf_counter()
        ids = as_tokens(input_ids)
        self.check_weights()
        ctx = self.context(encoder_input_ids)
        rid = request_id or f"hf-{next(_request_ids)}"
        restored = self._restore(ctx, ids, rid, use_cache)
        cache, reused, load_ok, shadow = restored.cache, restored.reused, restored.load_ok, restored.shadow
        restore_s = restored.seconds
        snapshots: dict[int, Snapshot] = {}
        keep = store or shadow is not None  # the computed chunks are wanted after the prefill
        if keep:
            self.codec.record(cache)
        logits = self.prefill(ctx, ids, cache, reused, snapshots if keep else None)
        stops = _eos_set(self.model, eos_token_id)
        rng = torch.Generator().manual_seed(sampling.seed)
        token = _sample(logits[-1], sampling, rng)
        ttft = time.perf_counter() - t0
        verdict = shadow.run(cache, snapshots) if shadow is not None else None
        shadow_outcome = None if shadow is None else "skipped" if verdict is None else verdict.outcome
        stored = self.store(ctx, ids, cache, snapshots) if store else 0
        generated = [token]
        if on_token is not None:
            on_token(token)
        pos = len(ids)
        while len(generated) < max_new_tokens and token not in stops:
            logits = self.runner.forward(torch.tensor([token]), cache, pos, encoder_outputs=ctx.encoder_outputs)
            pos += 1
            if store and self.spec.stateful and pos % self.chunk_size == 0:
                snapshots[pos // self.chunk_size - 1] = self.codec.snapshot(cache)
            token = _sample(logits[-1], sampling, rng)
            generated.append(token)
            if on_token is not None:
                on_token(token)
        if store and len(generated) > 1:
            seen = torch.cat([ids, torch.tensor(generated[:-1], dtype=torch.long)])
            stored += self.store(ctx, seen, cache, snapshots)
        return GenerationResult(
            prompt_tokens=len(ids), reused_tokens=reused, computed_tokens=len(ids) - reused,
            new_tokens=tuple(generated), stored_chunks=stored, restore_s=restore_s, ttft_s=ttft,
            total_s=time.perf_counter() - t0,
            load_ok=load_ok, shadow=shadow_outcome,
        )

    def _restore(self, ctx: RequestContext, ids: torch.Tensor, request_id: str, use_cache: bool) -> _Restored:
        """A fresh cache holding the longest cached prefix of ``ids`` (nothing when ``use_cache`` is False,
        or when the hit is sampled for a shadow check: then the request computes it all, and the check
        compares)."""
        t0 = time.perf_counter()
        if not use_cache:
            return _Restored(self.codec.new_cache(), 0, True, None, 0.0)
        res = self.engine.lookup(ctx.binding, request_id, ids, max_tokens=len(ids) - 1)
        if res.matched_tokens and self._shadow.pick(ctx.binding):
            return _Restored(self.codec.new_cache(), 0, True, ShadowCheck(self, ctx, res), time.perf_counter() - t0)
        cache, reused, load_ok = self._load(res)
        return _Restored(cache, reused, load_ok, None, time.perf_counter() - t0)

    # -- the model's own generate ------------------------------------------------------
    def model_generate(self, input_ids: Any, *, store: bool = True, use_cache: bool = True,
                       request_id: str | None = None, **generate_kwargs: Any) -> ModelGeneration:
        """The model's own ``generate`` (batch size 1) over a cache kvengine prefilled: everything
        ``generate`` supports applies (generation config, logits processors, stopping criteria,
        streamers, sampling); kvengine loads the longest cached prefix first and stores the full
        chunks after. ``generate`` computes only the tokens the cache does not hold.

        Stateful families (recurrent state) are prefilled here up to the last chunk boundary before
        the prompt's end, in chunk-sized pieces, so that every boundary's state can be stored; the model's
        ``generate`` computes the rest. Families where that is not exact are refused
        (``_MODEL_GENERATE_REFUSED``, with the measured reason; :meth:`generate` serves them).

        :raises UnsupportedModelError: a refused family.
        :raises InvalidRequestError: a batch of more than one sequence, or ``past_key_values`` passed.
        """
        refused = _MODEL_GENERATE_REFUSED.get("encoder-decoder" if self.spec.encoder_decoder else self.spec.model_type)
        if refused:
            raise UnsupportedModelError(f"{self.spec.model_type}: model_generate is refused: {refused}; "
                                        "use AttachedModel.generate, which is exact for it")
        if {"past_key_values", "cache_params"} & generate_kwargs.keys():
            raise InvalidRequestError("model_generate brings its own cache: do not pass past_key_values")
        t0 = time.perf_counter()
        ids = as_tokens(input_ids)
        self.check_weights()
        ctx = self.context()
        restored = self._restore(ctx, ids, request_id or f"hf-{next(_request_ids)}", use_cache)
        cache, snapshots = restored.cache, dict[int, Snapshot]()
        keep = store or restored.shadow is not None
        if keep:
            self.codec.record(cache)
        if keep and self.spec.stateful:  # states at chunk boundaries exist only if computed piece by piece
            boundary = (len(ids) - 1) // self.chunk_size * self.chunk_size
            if boundary > restored.reused:
                self.prefill(ctx, ids[:boundary], cache, restored.reused, snapshots)
        kwargs = {"return_dict_in_generate": True, **generate_kwargs, self.runner.cache_kw: cache}
        with torch.no_grad():
            output = self.model.generate(ids.reshape(1, -1).to(self.runner.device), **kwargs)
        sequences = output.sequences if hasattr(output, "sequences") else output
        generated = [int(t) for t in sequences[0, len(ids):]]
        verdict = restored.shadow.run(cache, snapshots) if restored.shadow is not None else None
        shadow = None if restored.shadow is None else "skipped" if verdict is None else verdict.outcome
        stored = 0
        if store:
            seen = torch.cat([ids, torch.tensor(generated[:-1], dtype=torch.long)]) if generated else ids
            stored = self.store(ctx, seen, cache, snapshots)
        return ModelGeneration(output=output, prompt_tokens=len(ids), reused_tokens=restored.reused,
                               new_tokens=tuple(generated), stored_chunks=stored, restore_s=restored.seconds,
                               total_s=time.perf_counter() - t0, load_ok=restored.load_ok, shadow=shadow)


#: Families whose ``generate`` over a cache kvengine prefilled is not exact, with what was measured
#: (``tests/integrations/test_hf_model_generate.py`` proves the others against a plain ``generate``).
_MODEL_GENERATE_REFUSED = {
    "encoder-decoder": "greedy outputs of T5 and BART through generate over a restored decoder cache differed "
                       "from a plain generate",
    "mamba2": "scores differed from a plain generate by up to 2.5e-2 (sequences equal), also on a miss: "
              "generate continuing over prefilled recurrent state is not the same computation",
}


@dataclass(frozen=True, slots=True)
class _Restored:
    cache: Any
    reused: int
    load_ok: bool
    shadow: ShadowCheck | None
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelGeneration:
    """One :meth:`AttachedModel.model_generate` call: what the model's ``generate`` returned, and what
    kvengine reused and stored around it."""

    output: Any  # as model.generate returns it (return_dict_in_generate=True unless the caller said otherwise)
    prompt_tokens: int
    reused_tokens: int
    new_tokens: tuple[int, ...]
    stored_chunks: int
    restore_s: float
    total_s: float
    load_ok: bool
    shadow: str | None = None


def _eos_set(model: Any, eos: int | Sequence[int] | None) -> frozenset[int]:
    if eos == -1:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _sample(logits: torch.Tensor, sampling: Sampling, rng: torch.Generator) -> int:
    scores = logits.float()
    if sampling.temperature == 0:
        return int(torch.argmax(scores))
    scores = scores / sampling.temperature
    if sampling.top_k is not None:
        k = min(sampling.top_k, scores.numel())
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=rng))
