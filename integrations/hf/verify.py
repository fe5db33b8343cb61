"""The attach canary of the HF integration: is a cached continuation the computation a plain run does?

:func:`verify` runs at attach and again whenever the model changes form
(another dtype or device) under an :class:`~.generator.AttachedModel`:

1. the cache the model really builds is checked against the spec;
2. a reference probe runs through plain transformers only (no kvengine code:
   the model's own cache, positions derived by transformers): the stored
   prefix in the pieces kvengine prefills it in (chunk-sized for stateful
   families, one piece otherwise), then the suffix over that cache;
3. the store path over the same prefix, into a canary namespace;
4. a fresh lookup + load of that prefix into a new cache, compared bit for
   bit with the in-memory cache it was stored from;
5. continuing the probe over the restored cache, compared bit for bit with
   step 2, layer by layer, then the logits.

Step 5 is bitwise because the reference is split at the same boundaries as
the cached continuation: both run the same kernels on the same shapes in the
same order, so any difference is a fault (layout, positions, state), never
rounding. Comparing with one unsplit prefill instead would need a tolerance
for the split's own rounding, which differs by family and CPU (transformers'
Qwen3-Next split prefill rounds by up to 3e-5 in fp32 on AVX2).

A tolerance remains only where a bitwise comparison is impossible: a lossy
attach (``lossy_kv=True``) also restores the probe through the lower tiers'
lossy codec, which changes the KV by design; that restore is judged against
the codec's error bound (:func:`kvengine.compression.error_bound`) and its
continuation is measured, not judged (see :func:`kvengine.semantics.canary.judge`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvengine.chunks.codecs import Codec
from kvengine.chunks.record import descriptors_for
from kvengine.compression import LOSSLESS_FAMILY, error_bound
from kvengine.compression.quality import roundtrip
from kvengine.semantics.canary import CanaryReport, LossyProbe, judge
from kvengine.types import ChunkView, ModelBinding

from .proof import probe_tokens

if TYPE_CHECKING:
    from .generator import AttachedModel

logger = logging.getLogger("kvengine.hf")

CANARY_KEY = "kvengine-attach-canary"


def verify(attached: AttachedModel) -> CanaryReport:
    """Check the real cache, then run the attach canary and raise unless it passed (logging what it measured).

    :raises UnsupportedModelError: the cache the model builds disagrees with the spec.
    :raises AttachError: the canary found a cached continuation that differs from a plain run.
    """
    check_real_cache(attached)
    report = run_canary(attached)
    report.raise_if_failed()
    name = attached.namespace.model
    if report.lossy:
        logger.info("kvengine: attach canary passed for %r under lossy codec %s: exact restore (max logit "
                    "error %.3g); restore through %s within %.3g of the stored KV (bound %.3g, relative to "
                    "each tensor's max), continuation max logit error %.3g, greedy next token agrees at "
                    "%.0f%% of probe positions", name, report.codec, report.max_logit_error, report.codec,
                    report.restored_error, report.restored_bound, report.lossy_logit_error,
                    100 * (report.lossy_greedy_agreement or 0.0))
    else:
        logger.info("kvengine: attach canary passed for %r (cached continuation bitwise equal to a plain run)",
                    name)
    return report


def through_codec(codec: Codec, view: ChunkView) -> ChunkView:
    """``view`` as a lower tier would deliver it: its payload encoded and decoded by ``codec``, with the
    descriptors the tier writer records for it (:func:`~kvengine.chunks.record.descriptors_for`), which
    are also those the promoter decodes with."""
    descriptors = descriptors_for(view.layout, view.token_range[1] - view.token_range[0])
    decoded, _ = roundtrip(codec, view.tensors, descriptors)
    return dataclasses.replace(view, tensors=tuple(d.to(t.device) for d, t in zip(decoded, view.tensors)))


def check_real_cache(attached: AttachedModel) -> None:
    """Prefill a few tokens and compare the cache the model builds with the spec."""
    ids = probe_tokens(attached.model, 3)
    ctx = attached.context(probe_tokens(attached.model, 5, seed=1) if attached.spec.encoder_decoder else None,
                           binding=canary_binding(attached))
    cache = attached.codec.new_cache()
    attached.runner.forward(ids, cache, 0, encoder_outputs=ctx.encoder_outputs)
    attached.codec.check_cache(cache)


def canary_binding(attached: AttachedModel) -> ModelBinding:
    """The attach canary's own namespace: its own root too, so that it checks this process's reuse path
    even when the model's namespace is quarantined (it never reads anything another process wrote:
    it stores its probe first, and memory answers before the lower tiers). Keyed by the device the
    model runs on: after a move, the probe stored on the old device (other kernels, other rounding)
    is not what the canary on the new one compares with."""
    ns = attached.namespace
    ns = ns.with_updates(model_fingerprint=f"{ns.model_fingerprint}#{CANARY_KEY}",
                         extra_keys=(*ns.extra_keys, CANARY_KEY, f"device:{_device_key(attached.runner.device)}"))
    return attached.engine.bind(ns, attached.layout)


def _device_key(device: torch.device) -> str:
    """A device by index and, for CUDA, model: ``cuda:0`` and ``cuda:1`` may be different GPUs."""
    if device.type == "cuda":
        return f"{device}:{torch.cuda.get_device_name(device)}"
    return str(device)


def probe_lengths(attached: AttachedModel) -> tuple[int, int]:
    """(stored prefix, total) probe lengths: >= 2 chunks, past every window, >= 2 suffix tokens."""
    c = attached.chunk_size
    chunks = max(2, math.ceil(attached.spec.max_window / c) + 1)
    prefix = chunks * c
    return prefix, prefix + max(2, min(c // 2, 32))


@torch.no_grad()
def plain_run(model: Any, ids: torch.Tensor, pieces: Sequence[tuple[int, int]], *, cache_kw: str,
              encoder_outputs: Any = None) -> tuple[Any, torch.Tensor]:
    """``ids`` through plain transformers, piece by piece over the cache the model builds itself (its
    positions derived by transformers from that cache, not by kvengine): (cache, every logit of the
    last piece)."""
    device = next(model.parameters()).device
    cache: Any = None
    logits = torch.empty(0)
    for a, b in pieces:
        kwargs: dict[str, Any] = {"use_cache": True}
        if cache is not None:
            kwargs[cache_kw] = cache
        piece = ids[a:b].reshape(1, -1).to(device)
        if encoder_outputs is not None:
            out = model(encoder_outputs=encoder_outputs, decoder_input_ids=piece, **kwargs)
        else:
            out = model(input_ids=piece, **kwargs)
        cache = getattr(out, cache_kw)
        logits = out.logits[0]
    return cache, logits


def run_canary(attached: AttachedModel) -> CanaryReport:
    """Store -> fresh load -> continue a probe and compare with a plain run split at the same boundaries
    (see the module docstring)."""
    codec, runner = attached.codec, attached.runner
    prefix, total = probe_lengths(attached)
    ids = probe_tokens(attached.model, total)
    if attached.spec.encoder_decoder:
        start = getattr(attached.model.config, "decoder_start_token_id", None)
        if start is not None:
            ids[0] = int(start)
    encoder_ids = (probe_tokens(attached.model, attached.chunk_size + 3, seed=1)
                   if attached.spec.encoder_decoder else None)
    ctx = attached.context(encoder_ids, binding=canary_binding(attached))

    pieces = [*attached.prefill_pieces(0, prefix, snapshots=True), (prefix, total)]
    reference, ref_logits = plain_run(attached.model, ids, pieces, cache_kw=runner.cache_kw,
                                      encoder_outputs=ctx.encoder_outputs)

    in_memory = codec.new_cache()
    codec.record(in_memory)
    snapshots: dict = {}
    attached.prefill(ctx, ids[:prefix], in_memory, 0, snapshots)
    attached.store(ctx, ids[:prefix], in_memory, snapshots)

    restored, matched, load_ok = attached.restore(ctx, ids, CANARY_KEY)
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
        reference_logits=ref_logits,
        cached_logits=cached_logits[-(total - prefix):],
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
