"""The namespace of a vLLM model: everything that changes the bytes of its KV pages.

* ``model`` -- the model id or path vLLM was given.
* ``model_fingerprint`` -- the HF config, dtype, quantization and load
  format, plus the *content* of every weight file (:mod:`kvengine.trust.weights`:
  full-file xxh3-128, cached in a sidecar by size, mtime, inode and ctime).
  A hub id resolves to its local snapshot (revision and file digests). An
  explicit ``model_fingerprint`` option replaces the weights part, for users
  who manage versions themselves.
* ``kv_spec_fingerprint`` -- every KV cache group's spec and layers.
* ``layout_id`` -- vLLM version, attention backends, KV cache layout,
  kernel page split, and by name every per-platform choice that changes the
  bytes: block sizes, cache and state dtypes, state shapes and the conv
  state layout (:func:`.layout.platform_choices`).
* ``rank`` / ``world_size`` -- tensor-parallel position.
* ``cache_salt`` -- per request, from vLLM's ``cache_salt`` (a separate binding each).
"""

from __future__ import annotations

import json

import xxhash

from kvengine.chunks.keys import Namespace
from kvengine.trust.weights import model_identity


def model_fingerprint(vllm_config: object, explicit: str | None = None) -> str:
    mc = vllm_config.model_config  # type: ignore[attr-defined]
    cc = vllm_config.cache_config  # type: ignore[attr-defined]
    load_format = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    hf = mc.hf_config.to_json_string(use_diff=False) if hasattr(mc.hf_config, "to_json_string") else repr(mc.hf_config)
    desc = [mc.model, str(mc.dtype), str(mc.quantization), str(cc.cache_dtype), str(load_format), hf,
            model_identity(str(mc.model), mc.revision, explicit=explicit)]
    return xxhash.xxh3_128_hexdigest(json.dumps(desc, separators=(",", ":")).encode())


def namespace_for(vllm_config: object, *, layout_id: str, spec_fingerprint: str,
                  explicit_fingerprint: str | None = None) -> Namespace:
    import vllm

    pc = vllm_config.parallel_config  # type: ignore[attr-defined]
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return Namespace(
        model=str(vllm_config.model_config.model),  # type: ignore[attr-defined]
        model_fingerprint=model_fingerprint(vllm_config, explicit_fingerprint),
        kv_spec_fingerprint=spec_fingerprint,
        layout_id=f"vllm-{vllm.__version__}/{layout_id}",
        rank=get_tensor_model_parallel_rank(),
        world_size=pc.tensor_parallel_size,
    )
