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

Every request's binding comes from :meth:`AttachedModel.context`, and every
building block (``restore``, ``prefill``, ``store``) re-checks the model
first: a model whose weights, dtype or device changed since attach moves to
its new namespace (a new dtype re-derives the KV layout and re-runs the attach
canary; a new device re-runs it) before anything is looked up or stored, and
a context made before the change is refused. No path serves the old model's KV.

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
from typing import Any, NamedTuple

import torch
import xxhash

from kvengine.chunks.hashing import token_bytes
from kvengine.chunks.keys import Namespace
from kvengine.chunks.layout import ChunkLayout
from kvengine.errors import InvalidRequestError, KVEngineError, ModelChangedError, UnsupportedModelError
from kvengine.facade import KVEngine
from kvengine.lookups import LookupResult
from kvengine.semantics.canary import CanaryReport
from kvengine.semantics.families import derive_spec
from kvengine.semantics.spec import ModelKVSpec
from kvengine.trust.provenance import CanaryResult, ShadowSampler
from kvengine.types import ChunkView, ModelBinding

from .codec import ChunkUnavailable, HFCacheCodec, Snapshot
from .decoding import GREEDY, DecodingRules, Sampling, sample
from .proof import ShadowCheck, prove_namespace
from .runner import ModelRunner
from .verify import check_real_cache, verify
from .weights_watch import ModelChange, ModelWatch

logger = logging.getLogger("kvengine.hf")

_ENCODER_BINDINGS = 256
_request_ids = itertools.count()

__all__ = ["GREEDY", "AttachedModel", "GenerationResult", "ModelGeneration", "RequestContext", "Sampling"]


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
    """Where a request's chunks live (and the encoder outputs of encoder-decoder models), for the model as
    it was when the context was made (``epoch``: the building blocks refuse a context of an earlier one)."""

    binding: ModelBinding
    encoder_outputs: Any = None
    epoch: int = 0


class _Derived(NamedTuple):
    """Everything an :class:`AttachedModel` derives from the model's identity (restored when a change
    cannot be followed)."""

    spec: ModelKVSpec
    layout: ChunkLayout
    codec: HFCacheCodec
    runner: ModelRunner
    namespace: Namespace
    binding: ModelBinding | None
    canary: CanaryReport | None
    proof: CanaryResult | None
    content: str


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
        self._content = content_fingerprint  # the weights the namespace stands for
        self._explicit = explicit_fingerprint
        self._watch = ModelWatch(model, content_fingerprint)
        self._epoch = 0  # one per identity the model had: contexts of an earlier one are refused
        self._refusal: KVEngineError | None = None  # a change that could not be followed: every request is refused
        self._shadow = ShadowSampler(engine.config.shadow)

    # -- identity -------------------------------------------------------------------
    def check_weights(self) -> bool:
        """Before a request (every building block calls it): if the model changed since attach (or the
        last check), follow it, so no chunk of the old model is served. New weights move to their
        namespace (proved by the namespace canary); a new dtype also re-derives the KV spec and layout,
        and a new dtype or device re-runs the attach canary there. Returns whether the namespace changed.

        :raises ModelChangedError: the weights changed (a new dtype changes them too) but the namespace
            was given an explicit fingerprint at attach, which kvengine cannot update for you.
        :raises AttachError: the attach canary refused the model in its new dtype or on its new device.
        :raises UnsupportedModelError: the new dtype's KV spec is not reusable.

        A refusal repeats on every request until the model changes again (back, or to a form it accepts).
        """
        change = self._watch.poll()
        if change is None:
            if self._refusal is not None:
                raise self._refusal.with_traceback(None)
            return False
        self._watch.accept(change)  # judged once: a later poll reports only a further change
        self._refusal = None
        saved = self._derived()
        try:
            return self._follow(change)
        except KVEngineError as exc:
            self._roll_back(saved)
            self._refusal = exc
            raise

    def _follow(self, change: ModelChange) -> bool:
        name, old = self.namespace.model, self.namespace
        what = change.describe() if change.form_changed else "weights changed"
        if change.content != self._content and self._explicit:
            raise ModelChangedError(
                f"model {name!r}: {what} since attach, but it was attached with an explicit fingerprint, which "
                "kvengine cannot update for you; attach it again with the new weights' fingerprint (or none, to "
                "derive it)")
        self._epoch += 1
        self._encoder_bindings.clear()
        self.binding = None
        if change.form_changed:
            self.spec = derive_spec(self.model.config, dtype=change.form.dtype)
            self.layout = self.spec.layout(self.chunk_size)
            self.codec = HFCacheCodec(self.spec, self.model.config, self.layout)
            self.runner = ModelRunner(self.model, self.spec)
        fingerprint = old.model_fingerprint  # explicit: the content is unchanged (a move), the name stays
        if not self._explicit:
            self._content = fingerprint = change.content
        self.namespace = old.with_updates(model_fingerprint=fingerprint, kv_spec_fingerprint=self.spec.fingerprint,
                                          layout_id=self.layout.fingerprint)
        if change.form_changed:
            if self.namespace.verified:
                self.canary = verify(self)
            else:
                check_real_cache(self)
        self.binding = self.engine.bind(self.namespace, self.layout)
        moved = self.namespace != old
        if moved:
            logger.warning("kvengine: %r: %s since attach; moving to the new namespace (no KV of the old model is "
                           "served)", name, what)
            self.engine.metrics.namespace_changes.inc()
        else:
            logger.info("kvengine: %r: %s; the attach canary passed there, namespace unchanged", name, what)
        if self.namespace.verified:
            self.proof = prove_namespace(self)
        return moved

    def _derived(self) -> _Derived:
        return _Derived(self.spec, self.layout, self.codec, self.runner, self.namespace, self.binding, self.canary,
                        self.proof, self._content)

    def _roll_back(self, saved: _Derived) -> None:
        (self.spec, self.layout, self.codec, self.runner, self.namespace, self.binding, self.canary, self.proof,
         self._content) = saved
        self._encoder_bindings.clear()

    def _current(self, ctx: RequestContext) -> None:
        """Check the model, then refuse ``ctx`` if it was made for an earlier identity of it."""
        self.check_weights()
        if ctx.epoch != self._epoch:
            raise InvalidRequestError(
                f"this request context of {self.namespace.model!r} was made before the model changed (weights, "
                "dtype or device): its binding names the old model; call context() again")

    # -- context ------------------------------------------------------------------
    def context(self, encoder_input_ids: Any = None, *, binding: ModelBinding | None = None) -> RequestContext:
        """The binding a request uses: the model's, or for encoder-decoder models one per encoder input.
        Checks the model first (:meth:`check_weights`), so the binding is the current model's."""
        self.check_weights()
        base = binding or self.binding
        if not self.spec.encoder_decoder:
            if encoder_input_ids is not None:
                raise InvalidRequestError(f"{self.spec.model_type} is decoder-only; encoder_input_ids is not accepted")
            if base is None:
                raise InvalidRequestError("model is not bound (attach() did not finish)")
            return RequestContext(base, epoch=self._epoch)
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
        return RequestContext(bound, self.runner.encode(enc), epoch=self._epoch)

    # -- building blocks (also used by the canary); each re-checks the model first ----------
    def restore(self, ctx: RequestContext, ids: torch.Tensor, request_id: str, *,
                through: Callable[[ChunkView], ChunkView] | None = None) -> tuple[Any, int, bool]:
        """Look up and load the longest cached prefix (<= len-1 tokens); returns (cache, tokens, load ok).

        ``through`` rewrites every loaded chunk before it reaches the cache (the attach canary passes
        its chunks through the lower tiers' lossy codec with it).

        :raises InvalidRequestError: ``ctx`` was made before the model changed (see :meth:`check_weights`
            for what a change itself raises).
        """
        self._current(ctx)
        return self._load(self.engine.lookup(ctx.binding, request_id, ids, max_tokens=len(ids) - 1), through)

    def _load(self, res: LookupResult,
              through: Callable[[ChunkView], ChunkView] | None = None) -> tuple[Any, int, bool]:
        if not res.loadable:
            self.engine.release(res)
            return self.codec.new_cache(), 0, True
        restorer = self.codec.restorer(res.tokens, self.runner.device)
        sink: Callable[[ChunkView], None] = restorer if through is None else lambda view: restorer(through(view))
        result = self.engine.load(res, sink)
        cache, used = restorer.build(result.loaded_tokens)
        if not result.ok:
            logger.warning("kvengine: load delivered %d of %d tokens; recomputing the rest",
                           result.loaded_tokens, result.promised_tokens)
        return cache, used, result.ok

    def prefill_pieces(self, start: int, end: int, *, snapshots: bool) -> list[tuple[int, int]]:
        """The forwards that compute tokens ``[start, end)``: chunk-sized pieces ending at every chunk
        boundary for stateful families with ``snapshots`` (a state exists only where a piece ended),
        otherwise one piece. The attach canary's plain reference is split the same way."""
        c = self.chunk_size
        bounds = [end]
        if snapshots and self.spec.stateful:
            bounds = [*range((start // c + 1) * c, end, c), end]
        pieces, a = [], start
        for b in bounds:
            if b > a:
                pieces.append((a, b))
                a = b
        return pieces

    def prefill(self, ctx: RequestContext, ids: torch.Tensor, cache: Any, start: int,
                snapshots: dict[int, Snapshot] | None, *, all_logits: bool = False) -> torch.Tensor:
        """Compute tokens ``ids[start:]`` over ``cache``; snapshot state at chunk ends when asked
        (:meth:`prefill_pieces`).

        :raises InvalidRequestError: ``ctx`` was made before the model changed.
        """
        self._current(ctx)
        return self._prefill(ctx, ids, cache, start, snapshots, all_logits=all_logits)

    def _prefill(self, ctx: RequestContext, ids: torch.Tensor, cache: Any, start: int,
                 snapshots: dict[int, Snapshot] | None, *, all_logits: bool = False) -> torch.Tensor:
        c = self.chunk_size
        logits: list[torch.Tensor] = []
        for a, b in self.prefill_pieces(start, len(ids), snapshots=snapshots is not None):
            logits.append(self.runner.forward(ids[a:b], cache, a, encoder_outputs=ctx.encoder_outputs,
                                              all_logits=all_logits))
            if snapshots is not None and self.spec.stateful and b % c == 0:
                snapshots[b // c - 1] = self.codec.snapshot(cache)
        return torch.cat(logits) if all_logits else logits[-1]

    def store(self, ctx: RequestContext, tokens: torch.Tensor, cache: Any, snapshots: dict[int, Snapshot]) -> int:
        """Store the full chunks of ``tokens`` not cached yet; returns chunks stored.

        :raises InvalidRequestError: ``ctx`` was made before the model changed (its KV would be stored
            under the old model's namespace).
        """
        self._current(ctx)
        return self._store(ctx, tokens, cache, snapshots)

    def _store(self, ctx: RequestContext, tokens: torch.Tensor, cache: Any, snapshots: dict[int, Snapshot]) -> int:
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

        ``eos_token_id=-1`` means the model's generation config; None never stops early. The generation
        config's ``forced_bos_token_id`` and ``forced_eos_token_id`` apply as in transformers' ``generate``;
        sampling and length come from ``sampling`` and ``max_new_tokens`` (see :mod:`.decoding`).
        ``use_cache=False`` skips the lookup (plain prefill); ``store=False`` stores nothing.

        :raises InvalidRequestError: bad arguments, or a generation-config field the loop does not honour
            (named; nothing is looked up or stored).
        """
        if max_new_tokens <= 0:
            raise InvalidRequestError("max_new_tokens must be positive")
        t0 = time.perf_counter()
        ids = as_tokens(input_ids)
        rules = DecodingRules.of(self.model, eos_token_id)
        ctx = self.context(encoder_input_ids)  # checks the model: one check covers this whole request
        rid = request_id or f"hf-{next(_request_ids)}"
        restored = self._restore_for(ctx, ids, rid, use_cache)
        cache, reused, load_ok, shadow = restored.cache, restored.reused, restored.load_ok, restored.shadow
        restore_s = restored.seconds
        snapshots: dict[int, Snapshot] = {}
        keep = store or shadow is not None  # the computed chunks are wanted after the prefill
        if keep:
            self.codec.record(cache)
        logits = self._prefill(ctx, ids, cache, reused, snapshots if keep else None)
        rng = torch.Generator().manual_seed(sampling.seed)
        token = sample(logits[-1], sampling, rng, rules, length=len(ids), last=max_new_tokens == 1)
        ttft = time.perf_counter() - t0
        verdict = shadow.run(cache, snapshots) if shadow is not None else None
        shadow_outcome = None if shadow is None else "skipped" if verdict is None else verdict.outcome
        stored = self._store(ctx, ids, cache, snapshots) if store else 0
        generated = [token]
        if on_token is not None:
            on_token(token)
        pos = len(ids)
        while len(generated) < max_new_tokens and token not in rules.stops:
            logits = self.runner.forward(torch.tensor([token]), cache, pos, encoder_outputs=ctx.encoder_outputs)
            pos += 1
            if store and self.spec.stateful and pos % self.chunk_size == 0:
                snapshots[pos // self.chunk_size - 1] = self.codec.snapshot(cache)
            token = sample(logits[-1], sampling, rng, rules, length=pos, last=len(generated) + 1 == max_new_tokens)
            generated.append(token)
            if on_token is not None:
                on_token(token)
        if store and len(generated) > 1:
            seen = torch.cat([ids, torch.tensor(generated[:-1], dtype=torch.long)])
            stored += self._store(ctx, seen, cache, snapshots)
        return GenerationResult(
            prompt_tokens=len(ids), reused_tokens=reused, computed_tokens=len(ids) - reused,
            new_tokens=tuple(generated), stored_chunks=stored, restore_s=restore_s, ttft_s=ttft,
            total_s=time.perf_counter() - t0,
            load_ok=load_ok, shadow=shadow_outcome,
        )

    def _restore_for(self, ctx: RequestContext, ids: torch.Tensor, request_id: str, use_cache: bool) -> _Restored:
        """A fresh cache holding the longest cached prefix of ``ids`` (nothing when ``use_cache`` is False,
        or when the hit is sampled for a shadow check: then the request computes it all, and the check
        compares)."""
        t0 = time.perf_counter()
        if not use_cache:
            return _Restored(self.codec.new_cache(), 0, True, None, 0.0)
        res = self.engine.lookup(ctx.binding, request_id, ids, max_tokens=len(ids) - 1)
        if res.loadable and self._shadow.pick(ctx.binding):
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
        ctx = self.context()  # checks the model: one check covers this whole request
        restored = self._restore_for(ctx, ids, request_id or f"hf-{next(_request_ids)}", use_cache)
        cache, snapshots = restored.cache, dict[int, Snapshot]()
        keep = store or restored.shadow is not None
        if keep:
            self.codec.record(cache)
        if keep and self.spec.stateful:  # states at chunk boundaries exist only if computed piece by piece
            boundary = (len(ids) - 1) // self.chunk_size * self.chunk_size
            if boundary > restored.reused:
                self._prefill(ctx, ids[:boundary], cache, restored.reused, snapshots)
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
            stored = self._store(ctx, seen, cache, snapshots)
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
