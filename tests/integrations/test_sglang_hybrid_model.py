"""A tiny hybrid model (Qwen3-Next: linear-attention state + full attention) resumed exactly through SGLang's
HybridCacheController, its host pools and the kvengine backend, across processes.

SGLang's own model runner needs its CUDA kernels, so the forward passes are transformers' Qwen3-Next (its
plain-torch gated-delta-rule path). Between the model's cache and the disk everything is SGLang's: the host
pools (``MHATokenToKVPoolHost`` for the attention KV, ``MambaPoolHost`` for the linear-attention state; their
copies from and to device pools need SGLang's CUDA kernels, so the test writes and reads their host slots
directly, in the page-first layout those copies use), SGLang's page hash chain, and the controller's own
``write_storage`` and ``prefetch`` paths (which call the backend's v1 and v2 methods). The test stands in for
the radix cache only where it hands the controller host slots.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integrations import sglang_env

sglang_env.require_sglang()

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_hash_str

from kvengine.integrations.sglang import extra_config
from kvengine.integrations.sglang.backend import KVEngineHiCacheStorage

REPO = Path(__file__).resolve().parents[2]
PAGE = 16
STATE_PAGES = (2, 4)  # radix nodes end at these pages: each backs up its state there
KV_PAGES = 5  # pages written back (the fifth belongs to a node whose state was not stored)
PROMPT = 6 * PAGE
NEW_TOKENS = 8
GEOMETRY = sglang_env.PoolGeometry(layers=1, heads=2, head_dim=16, page=PAGE, device_tokens=8 * PAGE,
                                   dtype=torch.float32)
#: tiny Qwen3-Next: layer 0 linear attention (conv + recurrent state), layer 1 full attention
MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
             linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, moe_intermediate_size=32,
             shared_expert_intermediate_size=32)


def load_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    from kvengine.integrations.vllm.tiny_models import build_model_dir

    build_model_dir(path, "qwen3_next", **MODEL)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def prompt_tokens() -> list[int]:
    return torch.randint(2, 512, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()


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


def linear_state(cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[0]
    return layer.recurrent_states[0][0], layer.conv_states[0][0]


def pools(recurrent: torch.Tensor, conv: torch.Tensor) -> tuple[Any, Any]:
    """SGLang's host pools: KV for the attention layer, Mamba state for the linear-attention layer."""
    _, host = sglang_env.make_mha_pools("page_first", GEOMETRY)
    mamba = sglang_env.make_mamba_host_pool(layers=1, slots=8, temporal_shape=tuple(recurrent.shape),
                                            conv_shapes=(tuple(conv.shape),), temporal_dtype=recurrent.dtype,
                                            conv_dtype=conv.dtype)
    return host, mamba


def controller_for(host: Any, mamba: Any, disk: Path) -> Any:
    """SGLang's HybridCacheController over the KV and Mamba host pools, with the kvengine backend attached
    (the Mamba pool's device side is never touched: its copies need CUDA kernels)."""
    device = SimpleNamespace(layer_num=1)
    controller = sglang_env.make_controller(
        sglang_env.make_mha_pools("page_first", GEOMETRY)[0], host, backend="dynamic", hybrid=True,
        extra_config=extra_config(kvengine_config={"memory": {"capacity_bytes": "16MiB"},
                                                   "disk": {"path": str(disk), "fsync": "data"}},
                                  model_fingerprint="tiny-qwen3-next"),
        extra_pools={PoolName.MAMBA: (device, mamba)})
    assert isinstance(controller.storage_backend, KVEngineHiCacheStorage)
    return controller


def state_of(mamba: Any, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear layer's (recurrent, conv) state in a page-first Mamba host slot: [slot, layer, 1, ...]."""
    return mamba.temporal_buffer[slot, 0, 0], mamba.conv_buffer[0][slot, 0, 0]


def kv_of(host: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention layer's K and V at token ``slots`` of a page-first KV host pool: [kv, slot, layer, ...]."""
    return host.kv_buffer[0, slots, 0], host.kv_buffer[1, slots, 0]


def write(model_dir: str, disk: str) -> None:
    """The writer process: prefill page by radix node as SGLang would (nodes end at STATE_PAGES, then the last
    KV page), back each node's state up through the Mamba pools and the KV pages through the MHA pools."""
    model = load_model(Path(model_dir))
    tokens = prompt_tokens()
    keys = get_hash_str(tokens, None, page_size=PAGE)
    cache, done = None, 0
    states = {}
    for end in (*STATE_PAGES, KV_PAGES):
        _, cache = forward(model, tokens[done * PAGE:end * PAGE], cache)
        done = end
        states[end] = tuple(t.clone() for t in linear_state(cache))
    host, mamba = pools(*states[STATE_PAGES[0]])
    controller = controller_for(host, mamba, Path(disk))
    try:
        slots = host.alloc(KV_PAGES * PAGE)
        layer = cache.layers[1]
        host.kv_buffer[0, slots, 0] = layer.keys[0].transpose(0, 1)  # [heads, T, D] -> [T, heads, D]
        host.kv_buffer[1, slots, 0] = layer.values[0].transpose(0, 1)
        state_slots = mamba.alloc(len(STATE_PAGES))
        for slot, end in zip(state_slots.tolist(), STATE_PAGES):
            for dst, src in zip(state_of(mamba, slot), states[end]):
                dst.copy_(src)
        # each node's state under its last page hash, then the KV pages, as the radix cache backs a path up
        states_transfer = PoolTransfer(name=PoolName.MAMBA, host_indices=state_slots,
                                       keys=[keys[end - 1] for end in STATE_PAGES],
                                       hit_policy=PoolHitPolicy.TRAILING_PAGES)
        controller.write_storage(slots, tokens[:KV_PAGES * PAGE], hash_value=keys[:KV_PAGES],
                                 extra_pools=[states_transfer])
        assert controller.ack_backup_queue.get(timeout=60).completed_tokens == KV_PAGES * PAGE
    finally:
        controller.detach_storage_backend()


def restore(model: Any, tokens: list[int], disk: Path) -> tuple[int, Any]:
    """The reader: find the longest restorable prefix, load its KV pages and its state through SGLang's pools,
    and put them into a transformers cache whose every tensor was first computed for other tokens (so that
    anything not restored would show)."""
    other = torch.randint(2, 512, (PROMPT,), generator=torch.Generator().manual_seed(99)).tolist()
    _, shell = forward(model, other[:STATE_PAGES[-1] * PAGE])
    host, mamba = pools(*linear_state(shell))
    host.alloc(PAGE)  # other host slots than the writer's
    controller = controller_for(host, mamba, disk)
    try:
        trailing = PoolTransfer(name=PoolName.MAMBA, keys=["_"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        hit = controller.prefetch(sglang_env.RequestHandle("reader"), tokens, extra_pools=[trailing])
        assert controller.prefetch_hit_queue.get(timeout=60) is hit
        pages = hit.storage_hit_count // PAGE
        slots, _ = controller.allocate_storage_hit(hit, hit.storage_hit_count, allow_partial=False, min_tokens=0,
                                                   evict_host=lambda n: 0)
        # What the radix cache does for a trailing pool: a host slot for the state (the controller keys it).
        (transfer,) = hit.pool_transfers
        transfer.host_indices = mamba.alloc(1)
        hit.host_indices = slots
        controller.prefetch_buffer.put(hit)
        completed = 0
        while True:
            ack = controller.ack_prefetch_queue.get(timeout=60)
            completed = max(completed, ack.completed_tokens or 0)
            if ack.completed_req:
                break
        assert completed == pages * PAGE
    finally:
        controller.detach_storage_backend()
    for dst, src in zip(linear_state(shell), state_of(mamba, int(transfer.host_indices[0]))):
        dst.copy_(src)
    layer = shell.layers[1]
    k, v = kv_of(host, slots)
    layer.keys, layer.values = (t.transpose(0, 1).unsqueeze(0).clone() for t in (k, v))
    return pages * PAGE, shell


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    work = tmp_path_factory.mktemp("hybrid_model")
    model_dir, disk = work / "model", work / "disk"
    code = (f"from tests.integrations.test_sglang_hybrid_model import write; "
            f"write({json.dumps(str(model_dir))}, {json.dumps(str(disk))})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return load_model(model_dir), disk


def test_a_fresh_process_resumes_the_hybrid_model_from_stored_kv_and_state_exactly(written):
    """A fresh process finds the longest prefix with a stored state (4 pages, not the 5 KV pages stored),
    restores its attention KV and linear-attention state through SGLang's pools, and continues: the suffix's
    logits and every generated token's logits equal, bit for bit, a run that computed the same prefix itself
    (same prefill split); the greedy tokens also equal one prefill of the whole prompt."""
    model, disk = written
    tokens = prompt_tokens()
    n, cache = restore(model, tokens, disk)
    assert n == STATE_PAGES[-1] * PAGE
    logits, cache = forward(model, tokens[n:], cache)
    restored, restored_steps = greedy(model, logits, cache)

    ref_cache, done = None, 0
    for end in STATE_PAGES:  # the writer's split, computed here
        _, ref_cache = forward(model, tokens[done * PAGE:end * PAGE], ref_cache)
        done = end
    ref_logits, ref_cache = forward(model, tokens[n:], ref_cache)
    expected, expected_steps = greedy(model, ref_logits, ref_cache)
    assert torch.equal(logits, ref_logits)
    assert restored == expected and all(torch.equal(a, b) for a, b in zip(restored_steps, expected_steps))
    whole, whole_cache = forward(model, tokens)
    assert greedy(model, whole, whole_cache)[0] == expected


def test_a_state_of_another_prefix_changes_the_answer(written):
    """The control: the 4-page prefix's KV with the state restored for the 2-page prefix gives other logits
    (the test above would see a state restored at the wrong position)."""
    model, disk = written
    tokens = prompt_tokens()
    n, cache = restore(model, tokens, disk)
    ref_logits, _ = forward(model, tokens[n:], restore(model, tokens, disk)[1])
    short, short_cache = restore(model, tokens[:3 * PAGE], disk)
    assert short == STATE_PAGES[0] * PAGE
    for dst, src in zip(linear_state(cache), linear_state(short_cache)):
        dst.copy_(src)
    logits, _ = forward(model, tokens[n:], cache)
    assert (logits - ref_logits).abs().max() > 1e-2
