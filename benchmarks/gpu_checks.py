"""The correctness parts of the GPU run (``bench_gpu.py``), on any device (``cpu`` for the smoke run here).

* :func:`hf_on_device` -- the ``kvengine verify hf`` proof (plain transformers against kvengine's generate:
  greedy tokens, per-step log-probabilities, the loaded KV per layer group) for three tiny families with
  the model and its cache on the device.
* :func:`self_check_on_device` -- the vLLM worker's device self-check (``integrations/vllm/self_check.py``)
  against tensors laid out as vLLM's GPU attention backends register them, built by hand (the GPU machine
  has no vLLM): one allocation per layout in the physical dimension order the layout names (a permutation
  of the logical ``[layers, blocks, heads, tokens, content]``), handed over per layer as the logical
  ``[blocks, heads, tokens, content]`` view; attention pages hold K|V along the content axis, MLA pages one
  head of latent + rope key. Each layout must pass, and a copy path reading one layer a token off must be
  caught, naming the layer.

Each case reports its own outcome: one failing case never hides the others.
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch

#: (backend, KV cache layout, block size, KV heads, content per token): the GPU backends' documented page
#: geometry (attention: K|V of one head; MLA: 512 latent + 64 rope key, one shared head; FlashMLA blocks of 64).
GPU_LAYOUTS = (
    ("FLASH_ATTN", "LBNHC", 16, 8, 2 * 128),
    ("FLASH_ATTN", "BLNHC", 16, 8, 2 * 128),
    ("FLASHINFER", "LBHNC", 16, 8, 2 * 128),
    ("FLASHINFER", "BLHNC", 32, 4, 2 * 64),
    ("TRITON_ATTN", "LBNHC", 16, 8, 2 * 128),
    ("TRITON_ATTN", "BHLNC", 16, 2, 2 * 64),
    ("FLASHMLA", "LBNHC", 64, 1, 576),
    ("CUTLASS_MLA", "LBNHC", 128, 1, 576),
    ("TRITON_MLA", "LHBNC", 16, 1, 576),
)
HF_FAMILIES = ("llama", "gemma2", "qwen3_next")


def _logical_views(device: torch.device, dtype: torch.dtype, layers: int, blocks: int, heads: int, tokens: int,
                   content: int, order: str) -> list[torch.Tensor]:
    """Per-layer ``[blocks, heads, tokens, content]`` views of one allocation laid out in ``order``."""
    sizes = dict(zip("LBHNC", (layers, blocks, heads, tokens, content)))
    physical = torch.zeros([sizes[d] for d in order], dtype=dtype, device=device)
    logical = physical.permute([order.index(d) for d in "LBHNC"])
    return list(logical.unbind(0))


def _shifted(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` read one token off (each token position sees the next one's content): the same shape, the
    wrong pages -- a planted layout error that a single-head MLA page cannot hide, unlike a heads/tokens swap."""
    return torch.as_strided(cache, cache.shape, cache.stride(), cache.storage_offset() + cache.stride(2))


def self_check_on_device(device: torch.device) -> list[dict[str, Any]]:
    from kvengine.compression import HAVE_BLOSC2, default_codecs
    from kvengine.integrations.vllm.layout import GroupKind, GroupPlan, derive_layout, resolve_chunking
    from kvengine.integrations.vllm.paging import PagedCopier
    from kvengine.integrations.vllm.self_check import SelfCheckError, SelfCheckOutcome, run_self_check

    registry = default_codecs(threads=1)
    codecs = [registry.by_name(n) for n in registry.names()
              if registry.by_name(n).lossless and (HAVE_BLOSC2 or n == "raw")]
    out = []
    for backend, order, block, heads, content in GPU_LAYOUTS:
        case: dict[str, Any] = {"backend": backend, "layout": order, "block": block, "heads": heads,
                                "content": content}
        try:
            layers = ("model.layers.0.attn", "model.layers.1.attn")
            mla = heads == 1 and content == 576
            plan = GroupPlan(group_id=0, kind=GroupKind.MLA if mla else GroupKind.FULL, block_size=block,
                             layer_names=layers, dtypes=("bfloat16",))
            chunk = block * math.ceil(256 / block)
            blocks = 4 * chunk // block + 8  # the check's two chunks, loaded into two others, and spare blocks
            views = _logical_views(device, torch.bfloat16, len(layers), blocks, heads, block, content, order)
            caches = dict(zip(layers, views))
            layout = derive_layout(resolve_chunking((plan,), chunk, world_size=1), caches,
                                   dict.fromkeys(layers, backend), order, num_blocks=blocks, fingerprint="hand-built")
            order_ids = list(range(len(layout.tensors)))
            report = run_self_check(layout, caches, PagedCopier(layout, caches), order_ids, num_blocks=blocks,
                                    codecs=codecs)
            case.update(outcome=report.outcome.value, seconds=report.seconds, chunk_bytes=report.chunk_bytes,
                        unproven=sorted(layout.unproven_backends))
            # the same check over a copy path that reads layer 0 a token off must refuse, naming it
            wrong = dict(caches, **{layers[0]: _shifted(caches[layers[0]])})
            try:
                run_self_check(layout, caches, PagedCopier(layout, wrong), order_ids, num_blocks=blocks)
                case["planted_error_caught"] = False
            except SelfCheckError as exc:
                case["planted_error_caught"] = layers[0] in str(exc)
            case["ok"] = report.outcome is SelfCheckOutcome.PASSED and case["planted_error_caught"]
        except Exception as exc:  # reported, the other layouts still run
            case.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
        out.append(case)
    return out


def hf_on_device(device: torch.device, *, max_seconds: float = 120.0) -> list[dict[str, Any]]:
    from kvengine import KVEngine
    from kvengine.integrations.hf.tiny_models import build_tiny
    from kvengine.integrations.hf.verify_run import ProofSettings, run_proof
    from kvengine.trust.verification import Outcome

    out = []
    for family in HF_FAMILIES:
        case: dict[str, Any] = {"family": family}
        try:
            model = build_tiny(family).to(device)

            def make_engine() -> KVEngine:
                return KVEngine({"chunk_size": 16, "memory": {"capacity_bytes": "64MiB"}}, transports=[])

            result = run_proof(model, make_engine, fresh_reader=False, model_id=f"tiny:{family}",
                               settings=ProofSettings(max_seconds=max_seconds))
            case.update(ok=result.ok and all(g.outcome is Outcome.EXACT for g in result.groups),
                        failure=result.failure, tokens_loaded=result.tokens_loaded,
                        groups=[g.as_dict() for g in result.groups], platform=result.platform.as_dict())
        except Exception as exc:
            case.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
        out.append(case)
    return out
