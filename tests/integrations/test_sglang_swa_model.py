"""A tiny KV + sliding-window hybrid (Gemma2: a 32-token sliding-window layer and a full-attention layer)
resumed exactly through SGLang's HybridCacheController, its host pools and the kvengine backend, in a fresh
process: the full layer's pages through the KV pool, the sliding layer's through the SWA pool, of which a
prefix needs only its trailing window.

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

WINDOW = 2 * PAGE  # the sliding window: a prefix needs its last two SWA pages
KV_PAGES = 5  # full-attention pages backed up
SWA_PAGES = 4  # sliding-window pages backed up: the fifth's is missing, so 5 pages are not restorable
PROMPT = 6 * PAGE
FINGERPRINT = "tiny-gemma2"
#: layer 0 sliding window, layer 1 full attention (2 KV heads of 16: the pools')
MODEL = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW)


def prompt_tokens(seed: int = 7) -> list[int]:
    return torch.randint(2, 512, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def write(model_dir: str, disk: str) -> None:
    """The writer process: prefill page by page (the sliding layer keeps only its window, so each page's
    sliding K/V is taken right after that page); back the full layer's pages up through the KV pool and the
    sliding layer's through the SWA pool, under the same page hashes."""
    model = load_model(Path(model_dir), "gemma2", **MODEL)
    tokens = prompt_tokens()
    keys = get_hash_str(tokens, None, page_size=PAGE)
    host, swa = kv_pool(), kv_pool()
    kv_slots, swa_slots = host.alloc(KV_PAGES * PAGE), swa.alloc(SWA_PAGES * PAGE)
    cache = None
    for page in range(KV_PAGES):
        _, cache = forward(model, tokens[page * PAGE:(page + 1) * PAGE], cache)
        if page < SWA_PAGES:
            sliding = cache.layers[0]
            put_kv(swa, swa_slots[page * PAGE:(page + 1) * PAGE], sliding.keys[0, :, -PAGE:],
                   sliding.values[0, :, -PAGE:])
    put_kv(host, kv_slots, cache.layers[1].keys[0], cache.layers[1].values[0])
    ctl = controller(host, PoolName.SWA, swa, Path(disk), FINGERPRINT)
    try:
        back_up(ctl, kv_slots, tokens[:KV_PAGES * PAGE], keys[:KV_PAGES],
                PoolTransfer(name=PoolName.SWA, host_indices=swa_slots, keys=keys[:SWA_PAGES],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES))
    finally:
        ctl.detach_storage_backend()


def restore(model: Any, tokens: list[int], disk: Path) -> tuple[int, Any]:
    """The reader: the controller's prefetch of ``tokens`` (the longest prefix whose trailing window of SWA
    pages is stored), its full-attention pages and window put into a transformers cache whose every tensor
    was first computed for other tokens. Returns the tokens restored and the cache."""
    host, swa = kv_pool(), kv_pool()
    host.alloc(PAGE)  # other host slots than the writer's
    window = swa.alloc(WINDOW)
    ctl = controller(host, PoolName.SWA, swa, disk, FINGERPRINT)
    try:
        pages, slots = prefetch(ctl, tokens, PoolTransfer(name=PoolName.SWA, keys=["_"] * (WINDOW // PAGE),
                                                          hit_policy=PoolHitPolicy.TRAILING_PAGES),
                                lambda _transfer: window)
    finally:
        ctl.detach_storage_backend()
    _, shell = forward(model, prompt_tokens(seed=99)[:pages * PAGE])
    sliding, full = shell.layers
    held = sliding.keys.shape[-2]  # the tokens transformers keeps of the window (window - 1)
    sliding.keys, sliding.values = (t[:, -held:].unsqueeze(0).clone() for t in kv_of(swa, window))
    full.keys, full.values = (t.unsqueeze(0).clone() for t in kv_of(host, slots))
    return pages * PAGE, shell


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model_dir, disk = write_in_subprocess(__name__, tmp_path_factory.mktemp("swa_model"))
    return load_model(model_dir, "gemma2", **MODEL), disk


def reference(model: Any, tokens: list[int], n: int) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """The suffix's logits and greedy continuation after computing the first ``n`` tokens here, page by page
    (the writer's split)."""
    cache = None
    for page in range(n // PAGE):
        _, cache = forward(model, tokens[page * PAGE:(page + 1) * PAGE], cache)
    logits, cache = forward(model, tokens[n:], cache)
    return logits, *greedy(model, logits, cache)


def test_a_fresh_process_resumes_the_sliding_window_model_exactly(written):
    """A fresh process's prefetch restores the longest prefix whose trailing window of sliding-window pages is
    stored (4 pages: the fifth KV page's window lacks its SWA page); from the full layer's pages and the
    sliding layer's window alone, the suffix's logits and every generated token's logits equal, bit for bit,
    a run that computed the prefix itself (same split); the greedy tokens equal one prefill of the prompt."""
    model, disk = written
    tokens = prompt_tokens()
    n, cache = restore(model, tokens, disk)
    assert n == SWA_PAGES * PAGE
    logits, cache = forward(model, tokens[n:], cache)
    restored, restored_steps = greedy(model, logits, cache)
    ref_logits, expected, expected_steps = reference(model, tokens, n)
    assert torch.equal(logits, ref_logits)
    assert restored == expected and all(torch.equal(a, b) for a, b in zip(restored_steps, expected_steps))
    whole, whole_cache = forward(model, tokens)
    assert greedy(model, whole, whole_cache)[0] == expected


def test_a_window_of_other_pages_changes_the_answer(written):
    """The control: the 4-page prefix's full-attention pages with the sliding window of the 3-page prefix
    (one page early) give other logits."""
    model, disk = written
    tokens = prompt_tokens()
    n, cache = restore(model, tokens, disk)
    short, short_cache = restore(model, tokens[:3 * PAGE + 1], disk)
    assert short == 3 * PAGE
    sliding = cache.layers[0]
    sliding.keys, sliding.values = short_cache.layers[0].keys, short_cache.layers[0].values
    logits, _ = forward(model, tokens[n:], cache)
    assert (logits - reference(model, tokens, n)[0]).abs().max() > 1e-2
