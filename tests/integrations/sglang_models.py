"""Test helpers for running tiny hybrid models' caches through SGLang's HybridCacheController (CPU, no server).

SGLang's model runner and its device<->host pool copies need its CUDA kernels, so the forward passes are
transformers' and the tests write and read the host pools' slots directly, in their page-first layout. The
controller's own ``write_storage`` and ``prefetch`` paths carry the pages between host pools and the
kvengine backend; the tests stand in for the radix cache only where it hands the controller host slots.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tests.integrations import sglang_env

PAGE = 16
NEW_TOKENS = 8
#: one attention layer per pool, float32 (the tiny models' dtype)
GEOMETRY = sglang_env.PoolGeometry(layers=1, heads=2, head_dim=16, page=PAGE, device_tokens=8 * PAGE,
                                   dtype=torch.float32)


def write_in_subprocess(module: str, work: Path) -> tuple[Path, Path]:
    """Run ``module.write(model_dir, disk)`` in a fresh Python process (the writer); return both paths."""
    model_dir, disk = work / "model", work / "disk"
    code = f"from {module} import write; write({json.dumps(str(model_dir))}, {json.dumps(str(disk))})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model_dir, disk


def load_model(path: Path, family: str, **config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from kvengine.integrations.vllm.tiny_models import build_model_dir

    build_model_dir(path, family, **config)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def forward(model: Any, tokens: list[int], cache: Any = None) -> tuple[torch.Tensor, Any]:
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return out.logits[0], out.past_key_values


def greedy(model: Any, logits: torch.Tensor, cache: Any) -> tuple[list[int], list[torch.Tensor]]:
    """NEW_TOKENS greedy tokens after ``logits``' last position, and every step's logits."""
    out, steps = [], [logits[-1]]
    for _ in range(NEW_TOKENS):
        out.append(int(steps[-1].argmax()))
        logits, cache = forward(model, [out[-1]], cache)
        steps.append(logits[-1])
    return out, steps


def kv_pool() -> Any:
    """A page-first KV host pool of one attention layer."""
    return sglang_env.make_mha_pools("page_first", GEOMETRY)[1]


def kv_of(host: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at token ``slots`` of a one-layer page-first KV host pool ([kv, slot, layer, heads, dim]), as
    [heads, tokens, dim] like a transformers cache layer holds them (copies)."""
    return host.kv_buffer[0, slots, 0].transpose(0, 1), host.kv_buffer[1, slots, 0].transpose(0, 1)


def put_kv(host: Any, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A transformers cache layer's K and V ([heads, tokens, dim]) into token ``slots`` of a KV host pool."""
    host.kv_buffer[0, slots, 0] = keys.transpose(0, 1)
    host.kv_buffer[1, slots, 0] = values.transpose(0, 1)


def controller(host: Any, name: Any, pool: Any, disk: Path, fingerprint: str) -> Any:
    """SGLang's HybridCacheController over a KV host pool and one extra host pool ``name`` (a one-layer
    sidecar whose device side is never touched), with the kvengine backend attached on ``disk``."""
    from kvengine.integrations.sglang import extra_config
    from kvengine.integrations.sglang.backend import KVEngineHiCacheStorage

    out = sglang_env.make_controller(
        sglang_env.make_mha_pools("page_first", GEOMETRY)[0], host, backend="dynamic", hybrid=True,
        extra_config=extra_config(kvengine_config={"memory": {"capacity_bytes": "16MiB"},
                                                   "disk": {"path": str(disk), "fsync": "data"}},
                                  model_fingerprint=fingerprint),
        extra_pools={name: (SimpleNamespace(layer_num=1), pool)})
    assert isinstance(out.storage_backend, KVEngineHiCacheStorage)
    return out


def back_up(ctl: Any, slots: torch.Tensor, tokens: list[int], keys: list[str], transfer: Any) -> None:
    """``write_storage`` of the KV pages at ``slots`` plus ``transfer``, as the radix cache backs a path up."""
    ctl.write_storage(slots, tokens, hash_value=keys, extra_pools=[transfer])
    assert ctl.ack_backup_queue.get(timeout=60).completed_tokens == len(tokens)


def prefetch(ctl: Any, tokens: list[int], transfer: Any,
             extra_slots: Callable[[Any], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """The controller's prefetch of ``tokens`` with a trailing-window ``transfer``; ``extra_slots(transfer)``
    hands it host slots for that pool (the radix cache's part; the controller keys them). Returns the pages
    restored and the KV host slots they are in."""
    from tests.integrations.sglang_env import RequestHandle

    hit = ctl.prefetch(RequestHandle("reader"), tokens, extra_pools=[transfer])
    assert ctl.prefetch_hit_queue.get(timeout=60) is hit
    slots, _ = ctl.allocate_storage_hit(hit, hit.storage_hit_count, allow_partial=False, min_tokens=0,
                                        evict_host=lambda n: 0)
    (hit_transfer,) = hit.pool_transfers
    hit_transfer.host_indices = extra_slots(hit_transfer)
    hit.host_indices = slots
    ctl.prefetch_buffer.put(hit)
    completed = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=60)
        completed = max(completed, ack.completed_tokens or 0)
        if ack.completed_req:
            break
    assert completed == hit.storage_hit_count
    return hit.storage_hit_count // PAGE, slots
