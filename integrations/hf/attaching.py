"""Fail-closed attach of a transformers model to a :class:`~kvengine.KVEngine`.

:func:`attach` derives the model's KV spec (unknown families raise
:class:`~kvengine.errors.UnsupportedModelError`), checks it against the
cache the model really builds, then runs the attach canary:

1. plain prefill of a probe prompt (reference logits and per-layer states);
2. the store path over the probe's chunk-aligned prefix, into a canary namespace;
3. a fresh lookup + load of that prefix into a new cache, compared bit for bit
   with the in-memory cache it was stored from;
4. continuing the probe over the restored cache, compared with step 1 within
   the dtype's tolerance, layer by layer.

Any difference raises :class:`~kvengine.errors.AttachError` naming the layer
group, and nothing is bound.

Lossy codecs are opt-in: an engine whose lower tiers write with a lossy codec
(``disk.codec: int8-channel``, ...) serves KV that differs from what was
stored, so :func:`attach` refuses it unless ``lossy_kv=True``, which binds the
model in that codec's family (``Namespace(codec_family="lossy:<codec>")``);
``lossy_kv=True`` on lossless tiers is refused too (nothing lossy to opt into).
A lossy model's hits are exact from memory or lossy from the lower tiers, so
its canary checks both: steps 1-4 unchanged (as strict as the lossless canary),
then a second restore of the probe whose chunks pass through the tiers' codec
(encoded and decoded with the same record descriptors the tier writer and the
promoter use: exactly the KV a disk or peer hit holds, without waiting for the
write to land), which must be within the codec's error bound of the stored
cache (:func:`kvengine.compression.error_bound`: int8 1/127, fp8 1/16,
int4 1/7 of each tensor's largest magnitude). The continuation over that
cache is measured and reported (largest logit error, greedy agreement), not
judged: its quality is what the user opted into. ``debug_unverified=True`` skips the canary,
logs loudly and binds under ``Namespace(verified=False)``, whose chunks
never reach verified readers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import torch

from kvengine import KVEngine, Namespace
from kvengine.chunks.codecs import Codec
from kvengine.chunks.record import descriptors_for
from kvengine.compression import LOSSLESS_FAMILY, codec_family, error_bound
from kvengine.compression.quality import roundtrip
from kvengine.errors import InvalidRequestError
from kvengine.semantics.canary import CanaryReport, LossyProbe, judge
from kvengine.semantics.families import derive_spec
from kvengine.types import ChunkView

from .generator import AttachedModel
from .proof import probe_tokens, prove_namespace
from .weights_watch import model_fingerprint as model_fingerprint

logger = logging.getLogger("kvengine.hf")

CANARY_KEY = "kvengine-attach-canary"


def attach(
    model: Any,
    engine: KVEngine,
    *,
    model_id: str | None = None,
    fingerprint: str | None = None,
    debug_unverified: bool = False,
    lossy_kv: bool = False,
) -> AttachedModel:
    """Verify ``model`` and bind it to ``engine``; see the module docstring.

    ``lossy_kv=True`` opts into the lossy codec of ``engine``'s lower tiers: the model binds in that
    codec's family, and the canary also measures a hit read through the codec (``AttachedModel.canary``).

    :raises InvalidRequestError: the tiers' codec is lossy but ``lossy_kv`` is False, or the reverse.
    :raises UnsupportedModelError: the family, a layer type or a config feature is not reusable.
    :raises AttachError: the canary found a cached continuation that differs from a plain prefill.
    """
    lossy = _lossy_codec(engine, lossy_kv)
    model.eval()
    spec = derive_spec(model.config, dtype=model.dtype)
    chunk = engine.config.chunk_size
    layout = spec.layout(chunk)
    name = model_id or getattr(model.config, "_name_or_path", "") or spec.model_type
    content = model_fingerprint(model)
    namespace = Namespace(
        model=name,
        model_fingerprint=fingerprint if fingerprint is not None else content,
        kv_spec_fingerprint=spec.fingerprint,
        layout_id=layout.fingerprint,
        verified=not debug_unverified,
        codec_family=codec_family(lossy) if lossy is not None else LOSSLESS_FAMILY,
    )
    attached = AttachedModel(model, engine, spec, layout, namespace, content_fingerprint=content,
                             explicit_fingerprint=fingerprint is not None)
    _check_real_cache(attached)
    if debug_unverified:
        logger.warning(
            "\n" + "!" * 78 + "\n"
            "kvengine: ATTACH VERIFICATION SKIPPED for %r (debug_unverified=True).\n"
            "Cached continuations of this model were NOT checked against a plain prefill.\n"
            "Its chunks are stored under Namespace(verified=False) and never served to verified readers.\n"
            + "!" * 78, name,
        )
    else:
        report = run_canary(attached)
        report.raise_if_failed()
        attached.canary = report
        if report.lossy:
            logger.info("kvengine: attach canary passed for %r under lossy codec %s: exact restore (max logit "
                        "error %.3g); restore through %s within %.3g of the stored KV (bound %.3g, relative to "
                        "each tensor's max), continuation max logit error %.3g, greedy next token agrees at "
                        "%.0f%% of probe positions", name, report.codec, report.max_logit_error, report.codec,
                        report.restored_error, report.restored_bound, report.lossy_logit_error,
                        100 * (report.lossy_greedy_agreement or 0.0))
        else:
            logger.info("kvengine: attach canary passed for %r (max logit error %.3g)", name,
                        report.max_logit_error)
    attached.binding = engine.bind(namespace, layout)
    if not debug_unverified:
        attached.proof = prove_namespace(attached)
    return attached


def _lossy_codec(engine: KVEngine, lossy_kv: bool) -> Codec | None:
    """The lossy codec this attach opts into (None: lossless); refuses a mismatch with the engine's tiers
    before anything is bound, and a lossy codec with no known error bound for the canary."""
    codec = engine.lossy_codec
    if codec is None:
        if lossy_kv:
            raise InvalidRequestError(
                "attach(..., lossy_kv=True) but the engine's lower tiers use no lossy codec (disk.codec "
                f"{engine.config.disk.codec!r}): there is nothing lossy to opt into; drop lossy_kv or configure "
                "a lossy disk.codec such as 'int8-channel'")
        return None
    if not lossy_kv:
        raise InvalidRequestError(
            f"the engine's lower tiers store KV with the lossy codec {codec.name!r}: hits from them differ from "
            "the KV that was stored; pass attach(..., lossy_kv=True) to opt into it, or configure a lossless "
            "codec (raw, zstd-byteshuffle, ...)")
    if error_bound(codec) is None:
        raise InvalidRequestError(f"lossy codec {codec.name!r} has no known error bound: the attach canary "
                                  "cannot judge KV restored through it")
    return codec


def through_codec(codec: Codec, view: ChunkView) -> ChunkView:
    """``view`` as a lower tier would deliver it: its payload encoded and decoded by ``codec``, with the
    descriptors the tier writer records for it (:func:`~kvengine.chunks.record.descriptors_for`), which
    are also those the promoter decodes with."""
    descriptors = descriptors_for(view.layout, view.token_range[1] - view.token_range[0])
    decoded, _ = roundtrip(codec, view.tensors, descriptors)
    return dataclasses.replace(view, tensors=tuple(d.to(t.device) for d, t in zip(decoded, view.tensors)))


def _check_real_cache(attached: AttachedModel) -> None:
    """Prefill a few tokens and compare the cache the model builds with the spec."""
    ids = _probe_tokens(attached, 3)
    ctx = attached.context(_probe_tokens(attached, 5, seed=1) if attached.spec.encoder_decoder else None,
                           binding=_canary_binding(attached))
    cache = attached.codec.new_cache()
    attached.runner.forward(ids, cache, 0, encoder_outputs=ctx.encoder_outputs)
    attached.codec.check_cache(cache)


def _probe_tokens(attached: AttachedModel, n: int, *, seed: int = 0) -> torch.Tensor:
    return probe_tokens(attached.model, n, seed=seed)


def _canary_binding(attached: AttachedModel):  # -> ModelBinding
    """The attach canary's own namespace: its own root too, so that it checks this process's reuse path
    even when the model's namespace is quarantined (it never reads anything another process wrote:
    it stores its probe first, and memory answers before the lower tiers)."""
    ns = attached.namespace
    ns = ns.with_updates(model_fingerprint=f"{ns.model_fingerprint}#{CANARY_KEY}",
                         extra_keys=(*ns.extra_keys, CANARY_KEY))
    return attached.engine.bind(ns, attached.layout)


def probe_lengths(attached: AttachedModel) -> tuple[int, int]:
    """(stored prefix, total) probe lengths: >= 2 chunks, past every window, >= 2 suffix tokens."""
    c = attached.chunk_size
    chunks = max(2, math.ceil(attached.spec.max_window / c) + 1)
    prefix = chunks * c
    return prefix, prefix + max(2, min(c // 2, 32))


def run_canary(attached: AttachedModel) -> CanaryReport:
    """Store -> fresh load -> continue a probe and compare with a plain prefill (see module docstring)."""
    codec, runner = attached.codec, attached.runner
    prefix, total = probe_lengths(attached)
    ids = _probe_tokens(attached, total)
    if attached.spec.encoder_decoder:
        start = getattr(attached.model.config, "decoder_start_token_id", None)
        if start is not None:
            ids[0] = int(start)
    encoder_ids = _probe_tokens(attached, attached.chunk_size + 3, seed=1) if attached.spec.encoder_decoder else None
    ctx = attached.context(encoder_ids, binding=_canary_binding(attached))

    reference = codec.new_cache()
    ref_logits = runner.forward(ids, reference, 0, encoder_outputs=ctx.encoder_outputs, all_logits=True)

    in_memory = codec.new_cache()
    codec.record(in_memory)
    snapshots: dict = {}
    attached.prefill(ctx, ids[:prefix], in_memory, 0, snapshots)
    attached.store(ctx, ids[:prefix], in_memory, snapshots)

    restored, matched, load_ok = attached.restore(ctx, ids, "kvengine-attach-canary")
    if not load_ok:  # nothing to compare: a restore path that cannot load is refused as it is
        return _load_failed(attached, total, matched, f"store -> fresh load failed: {matched} of {prefix} stored "
                                                      "tokens usable")
    restored_states = codec.comparable(restored)
    in_memory_states = codec.comparable(in_memory)
    lossy: LossyProbe | None = None
    tier_codec = attached.engine.lossy_codec if attached.namespace.codec_family != LOSSLESS_FAMILY else None
    if tier_codec is not None:  # a hit from the lower tiers: the same chunks, through their codec
        through = functools.partial(through_codec, tier_codec)
        lossy_cache, lossy_matched, lossy_ok = attached.restore(ctx, ids, f"{CANARY_KEY}-lossy", through=through)
        if not lossy_ok:
            return _load_failed(attached, total, lossy_matched, f"store -> load through codec {tier_codec.name} "
                                f"failed: {lossy_matched} of {prefix} stored tokens usable", codec=tier_codec.name)
        lossy_states = codec.comparable(lossy_cache)
        lossy_logits = runner.forward(ids[lossy_matched:], lossy_cache, lossy_matched,
                                      encoder_outputs=ctx.encoder_outputs, all_logits=True)
        lossy = LossyProbe(codec=tier_codec.name, bound=error_bound(tier_codec) or 0.0, matched_tokens=lossy_matched,
                           restored=lossy_states, cached_logits=lossy_logits[-(total - prefix):])
    cached_logits = runner.forward(ids[matched:], restored, matched, encoder_outputs=ctx.encoder_outputs,
                                   all_logits=True)
    return judge(
        spec=attached.spec,
        model=attached.namespace.model,
        probe_tokens=total,
        expected_match=prefix,
        matched_tokens=matched,
        in_memory=in_memory_states,
        restored=restored_states,
        reference_logits=ref_logits[matched:] if matched == prefix else ref_logits[prefix:],
        cached_logits=cached_logits if matched == prefix else cached_logits[-(total - prefix):],
        reference_states=codec.comparable(reference),
        continued_states=codec.comparable(restored),
        lossy=lossy,
    )


def _load_failed(attached: AttachedModel, total: int, matched: int, failure: str,
                 codec: str | None = None) -> CanaryReport:
    """The canary's report when a restore could not load its probe: nothing was compared."""
    return CanaryReport(model=attached.namespace.model, probe_tokens=total, matched_tokens=matched,
                        restored_exact=False, max_logit_error=float("nan"), logit_bound=float("nan"),
                        codec=codec, failure=failure)
