"""Fail-closed attach of a transformers model to a :class:`~kvengine.KVEngine`.

:func:`attach` derives the model's KV spec (unknown families raise
:class:`~kvengine.errors.UnsupportedModelError`), checks it against the
cache the model really builds, then runs the attach canary:

1. a plain transformers run of a probe prompt (reference logits and per-layer
   states), split where the cached path splits it: the stored prefix, then the
   suffix over the model's own cache;
2. the store path over the probe's chunk-aligned prefix, into a canary namespace;
3. a fresh lookup + load of that prefix into a new cache, compared bit for bit
   with the in-memory cache it was stored from;
4. continuing the probe over the restored cache, compared bit for bit with
   step 1, layer by layer (same kernels, shapes and order: an exact path has no
   rounding to allow for; :mod:`.verify`).

Any difference raises :class:`~kvengine.errors.AttachError` naming the layer
group, and nothing is bound. The same verification runs again when the model
later changes dtype or device (:meth:`AttachedModel.check_weights`).

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
int4 1/7 of each tensor's largest magnitude): the canary's only tolerance,
because that path changes the KV by design. The continuation over that
cache is measured and reported (largest logit error, greedy agreement), not
judged: its quality is what the user opted into. ``debug_unverified=True``
skips the canary, logs loudly and binds under ``Namespace(verified=False)``,
whose chunks never reach verified readers.
"""

from __future__ import annotations

import logging
from typing import Any

from kvengine.chunks.codecs import Codec
from kvengine.chunks.keys import Namespace
from kvengine.compression import LOSSLESS_FAMILY, codec_family, error_bound
from kvengine.errors import InvalidRequestError
from kvengine.facade import KVEngine
from kvengine.semantics.families import derive_spec

from .generator import AttachedModel
from .proof import prove_namespace
from .verify import check_real_cache, verify
from .weights_watch import model_fingerprint

__all__ = ["attach"]

logger = logging.getLogger("kvengine.hf")


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
    if debug_unverified:
        check_real_cache(attached)
        logger.warning(
            "\n" + "!" * 78 + "\n"
            "kvengine: ATTACH VERIFICATION SKIPPED for %r (debug_unverified=True).\n"
            "Cached continuations of this model were NOT checked against a plain prefill.\n"
            "Its chunks are stored under Namespace(verified=False) and never served to verified readers.\n"
            + "!" * 78, name,
        )
    else:
        attached.canary = verify(attached)
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
