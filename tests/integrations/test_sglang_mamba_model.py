"""A tiny KV + Mamba hybrid (Qwen3-Next: a linear-attention layer and a full-attention layer) resumed exactly
through SGLang's HybridCacheController, its host pools and the kvengine backend, in a fresh process.

The forward passes are transformers' (see :mod:`tests.integrations.sglang_models` for what is SGLang's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations import sglang_env

sglang_env.require_sglang()

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_hash_str

from tests.integrations.sglang_models import (
    PAGE,
    back_up,
    controller,
    forward,
    greedy,
    kv_of,
    kv_pool,
    load_model,
    prefetch,
    put_kv,
    write_in_subprocess,
)

STATE_PAGES = (2, 4)  # radix nodes end at these pages: each backs up its state there
KV_PAGES = 5  # pages written back (the fifth belongs to a node whose state was not stored)
PROMPT = 6 * PAGE
FINGERPRINT = "tiny-qwen3-next"
#: layer 0 linear attention (conv + recurrent state), layer 1 full attention (2 KV heads of 16: the pool's)
MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
             linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, moe_intermediate_size=32,
             shared_expert_intermediate_size=32)


def prompt_tokens(seed: int = 5) -> list[int]:
    return torch.randint(2, 512, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def linear_state(cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[0]
    return layer.recurrent_states[0][0], layer.conv_states[0][0]


def mamba_pool(recurrent: torch.Tensor, conv: torch.Tensor) -> Any:
    return sglang_env.make_mamba_host_pool(layers=1, slots=8, temporal_shape=tuple(recurrent.shape),
                                           conv_shapes=(tuple(conv.shape),), temporal_dtype=recurrent.dtype,
                                           conv_dtype=conv.dtype)


def state_of(mamba: Any, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear layer's (recurrent, conv) state in a page-first Mamba host slot: [slot, layer, 1, ...]."""
    return mamba.temporal_buffer[slot, 0, 0], mamba.conv_buffer[0][slot, 0, 0]


def write(model_dir: str, disk: str) -> None:
    """The writer process: prefill node by node as SGLang would (nodes end at STATE_PAGES, then the last KV
    page); back the KV pages and each node's state (under its last page hash) up through the controller."""
    model = load_model(Path(model_dir), "qwen3_next", **MODEL)
    tokens = prompt_tokens()
    keys = get_hash_str(tokens, None, page_size=PAGE)
    cache, done, states = None, 0, {}
    for end in (*STATE_PAGES, KV_PAGES):
        _, cache = forward(model, tokens[done * PAGE:end * PAGE], cache)
        done = end
        states[end] = tuple(t.clone() for t in linear_state(cache))
    host, mamba = kv_pool(), mamba_pool(*states[KV_PAGES])
    ctl = controller(host, PoolName.MAMBA, mamba, Path(disk), FINGERPRINT)
    try:
        slots = host.alloc(KV_PAGES * PAGE)
        put_kv(host, slots, cache.layers[1].keys[0], cache.layers[1].values[0])
        state_slots = mamba.alloc(len(STATE_PAGES))
        for slot, end in zip(state_slots.tolist(), STATE_PAGES):
            for dst, src in zip(state_of(mamba, slot), states[end]):
                dst.copy_(src)
        back_up(ctl, slots, tokens[:KV_PAGES * PAGE], keys[:KV_PAGES],
                PoolTransfer(name=PoolName.MAMBA, host_indices=state_slots, keys=[keys[e - 1] for e in STATE_PAGES],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES))
    finally:
        ctl.detach_storage_backend()


def restore(model: Any, tokens: list[int], disk: Path) -> tuple[int, Any]:
    """The reader: the controller's prefetch of ``tokens`` (the longest prefix with a state), its KV pages and
    state put into a transformers cache whose every tensor was first computed for other tokens (so that
    anything not restored would show). Returns the tokens restored and the cache."""
    _, shell = forward(model, prompt_tokens(seed=99)[:STATE_PAGES[-1] * PAGE])
    host, mamba = kv_pool(), mamba_pool(*linear_state(shell))
    host.alloc(PAGE)  # other host slots than the writer's
    state_slot = mamba.alloc(1)
    ctl = controller(host, PoolName.MAMBA, mamba, disk, FINGERPRINT)
    try:
        pages, slots = prefetch(ctl, tokens, PoolTransfer(name=PoolName.MAMBA, keys=["_"],
                                                          hit_policy=PoolHitPolicy.TRAILING_PAGES),
                                lambda _transfer: state_slot)
    finally:
        ctl.detach_storage_backend()
    for dst, src in zip(linear_state(shell), state_of(mamba, int(state_slot[0]))):
        dst.copy_(src)
    layer = shell.layers[1]
    layer.keys, layer.values = (t.unsqueeze(0).clone() for t in kv_of(host, slots))
    return pages * PAGE, shell


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model_dir, disk = write_in_subprocess(__name__, tmp_path_factory.mktemp("mamba_model"))
    return load_model(model_dir, "qwen3_next", **MODEL), disk


def test_a_fresh_process_resumes_the_hybrid_model_from_stored_kv_and_state_exactly(written):
    """A fresh process's prefetch restores the longest prefix with a stored state (4 pages, not the 5 KV
    pages stored), its attention KV and linear-attention state; continuing from it, the suffix's logits and
    every generated token's logits equal, bit for bit, a run that computed the same prefix itself (same
    prefill split); the greedy tokens also equal one prefill of the whole prompt."""
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
