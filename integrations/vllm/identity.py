"""The namespace of a vLLM model: everything that changes the bytes of its KV pages.

* ``model`` -- the model id or path vLLM was given.
* ``model_fingerprint`` -- the HF config, dtype, revision and quantization,
  plus a sample of the weight files when the model is a local directory
  (name, size, first and last MiB of each), so two random models built with
  different seeds in the same place never share chunks.
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
from pathlib import Path

import xxhash

from kvengine.keys import Namespace

_SAMPLE = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weights_digest(model: str) -> str:
    """Digest of a local model directory's weight files (name, size, head and tail bytes); '' if not local."""
    path = Path(model)
    if not path.is_dir():
        return ""
    h = xxhash.xxh3_128()
    for file in sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            h.update(f.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                f.seek(size - _SAMPLE)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


def model_fingerprint(vllm_config: object) -> str:
    mc = vllm_config.model_config  # type: ignore[attr-defined]
    cc = vllm_config.cache_config  # type: ignore[attr-defined]
    hf = mc.hf_config.to_json_string(use_diff=False) if hasattr(mc.hf_config, "to_json_string") else repr(mc.hf_config)
    desc = [mc.model, str(mc.revision), str(mc.dtype), str(mc.quantization), str(cc.cache_dtype), hf,
            weights_digest(mc.model)]
    return xxhash.xxh3_128_hexdigest(json.dumps(desc, separators=(",", ":")).encode())


def namespace_for(vllm_config: object, *, layout_id: str, spec_fingerprint: str) -> Namespace:
    import vllm

    pc = vllm_config.parallel_config  # type: ignore[attr-defined]
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return Namespace(
        model=str(vllm_config.model_config.model),  # type: ignore[attr-defined]
        model_fingerprint=model_fingerprint(vllm_config),
        kv_spec_fingerprint=spec_fingerprint,
        layout_id=f"vllm-{vllm.__version__}/{layout_id}",
        rank=get_tensor_model_parallel_rank(),
        world_size=pc.tensor_parallel_size,
    )
