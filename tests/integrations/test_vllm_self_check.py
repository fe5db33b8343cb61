"""The worker's device self-check at start (:mod:`kvengine.integrations.vllm.self_check`).

On real vLLM-shaped CPU tensors in the CPU backend's page layout, with the connector's real layout
derivation, copier, layer pipeline, a private engine and the lossless codecs: it passes on a correct
layout and leaves every block as it was; a planted layout error (one layer's pages transposed), a load
that misplaces pages or a codec that does not give its bytes back refuses to start, naming the layer,
the layout and the first differing offset.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (use .venv-vllm, see docs/vllm.md)")

BS = 32
NUM_BLOCKS = 16


def spec(cls_name: str, **kw):
    import vllm.v1.kv_cache_interface as kvi

    if cls_name == "MambaSpec":
        return kvi.MambaSpec(block_size=BS, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.bfloat16),
                             mamba_cache_mode="align")
    return getattr(kvi, cls_name)(**{"block_size": BS, "num_kv_heads": 2, "head_size": 32, **kw})


def plans_of(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvengine.integrations.vllm.layout import plan_groups

    groups = [KVCacheGroupSpec(layer_names=[f"l{i}"], kv_cache_spec=s) for i, s in enumerate(specs)]
    return plan_groups(KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups))


def llama(dtype=torch.bfloat16):
    """Two full-attention layers, each its own (blocks, heads, tokens, 2 * head_size) tensor (CPU_ATTN)."""
    plans = plans_of(spec("FullAttentionSpec", dtype=dtype), spec("FullAttentionSpec", dtype=dtype))
    return plans, {f"l{i}": torch.zeros(NUM_BLOCKS, 2, BS, 64, dtype=dtype) for i in range(2)}, "CPU_ATTN"


def overlaid():
    """A sliding-window and a full-attention group overlaying one allocation, as vLLM's hybrid allocator does."""
    plans = plans_of(spec("SlidingWindowSpec", sliding_window=64, dtype=torch.float32),
                     spec("FullAttentionSpec", dtype=torch.float32))
    backing = torch.zeros(NUM_BLOCKS, 2, BS, 64)
    return plans, {"l0": backing, "l1": backing}, "CPU_ATTN"


def kernel_pages():
    """vLLM split each block into two kernel pages (float16)."""
    plans = plans_of(spec("FullAttentionSpec", dtype=torch.float16))
    return plans, {"l0": torch.zeros(2 * NUM_BLOCKS, 2, BS // 2, 64, dtype=torch.float16)}, "CPU_ATTN"


def mla():
    """DeepSeek-style latent pages: one head of [latent | rope key] per token (AMX_MLA)."""
    plans = plans_of(spec("MLAAttentionSpec", num_kv_heads=1, head_size=576, dtype=torch.bfloat16))
    return plans, {"l0": torch.zeros(NUM_BLOCKS, 1, BS, 576, dtype=torch.bfloat16)}, "AMX_MLA"


def hybrid():
    """A recurrent-state group (raw int8 blocks, GDN) next to full attention, as Qwen3-Next registers them."""
    plans = plans_of(spec("MambaSpec"), spec("FullAttentionSpec", dtype=torch.bfloat16))
    caches = {"l0": torch.zeros(NUM_BLOCKS, 4096, dtype=torch.int8),
              "l1": torch.zeros(NUM_BLOCKS, 2, BS, 64, dtype=torch.bfloat16)}
    return plans, caches, "GDN_ATTN"


def build(make, chunk: int = BS, num_blocks: int = NUM_BLOCKS):
    """The worker's pieces over ``make()``'s caches: layout, copier and forward order (as register_kv_caches)."""
    from kvengine.integrations.vllm.layout import GroupKind, derive_layout, resolve_chunking
    from kvengine.integrations.vllm.paging import PagedCopier

    plans, caches, backend = make()
    backends = {name: ("CPU_ATTN" if backend == "GDN_ATTN" and p.kind is not GroupKind.STATE else backend)
                for p in plans for name in p.layer_names}
    layout = derive_layout(resolve_chunking(plans, chunk, world_size=1), caches, backends, "LBHNC",
                           num_blocks=num_blocks, fingerprint="fp", conv_state_layout="SD" if backend == "GDN_ATTN" else None)
    return layout, caches, PagedCopier(layout, caches), list(range(len(layout.tensors)))


def lossless_codecs():
    from kvengine.compression import HAVE_BLOSC2, default_codecs

    registry = default_codecs(threads=1)
    return [registry.by_name(n) for n in registry.names() if registry.by_name(n).lossless and
            (HAVE_BLOSC2 or n == "raw")]


@pytest.mark.parametrize("make, pages, states", [
    (llama, 2, 0), (lambda: llama(torch.float32), 2, 0), (overlaid, 2, 0), (kernel_pages, 1, 0), (mla, 1, 0),
    (hybrid, 1, 1),
], ids=["llama-bf16", "llama-fp32", "overlaid-groups", "kernel-pages", "mla", "hybrid-state"])
def test_self_check_passes_on_the_cpu_layouts_and_leaves_every_block_as_it_was(make, pages, states):
    """Every layout the connector accepts passes, through every lossless codec; the blocks it used are zero
    again and a block it did not use (holding KV) is untouched."""
    from kvengine.integrations.vllm.self_check import SelfCheckOutcome, run_self_check

    layout, caches, copier, order = build(make)
    last = {name: cache[-1].clone().fill_(5) for name, cache in caches.items()}
    for name, cache in caches.items():
        cache[-1] = last[name]  # KV of a block the check must not touch
    codecs = lossless_codecs()
    report = run_self_check(layout, caches, copier, order, num_blocks=NUM_BLOCKS, codecs=codecs)
    assert report.outcome is SelfCheckOutcome.PASSED
    assert (report.page_tensors, report.state_tensors) == (pages, states)
    assert set(report.codecs) == {c.name for c in codecs} - {"raw"}
    assert report.chunk_bytes == 2 * layout.chunk.nbytes() and 0 < report.seconds < 5
    for name, cache in caches.items():
        assert torch.equal(cache[-1], last[name]) and not cache[:-1].any(), name


def transposed(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s memory read with heads and tokens swapped in every page: same shape, wrong layout."""
    n, heads, tokens, content = cache.shape
    return cache.view(n, tokens, heads, content).transpose(1, 2)


def test_a_layer_whose_pages_are_transposed_is_caught_naming_the_layer_layout_and_offset():
    """Regression (the self-check's purpose): a copy path that reads one layer's pages in another layout than
    vLLM's (here heads and tokens transposed) refuses to start, naming that layer, the layout id and the first
    differing block, token, head and element -- instead of serving scrambled KV."""
    from kvengine.integrations.vllm.paging import PagedCopier
    from kvengine.integrations.vllm.self_check import SelfCheckError, run_self_check

    layout, caches, _, order = build(llama)
    copier = PagedCopier(layout, {**caches, "l1": transposed(caches["l1"])})
    with pytest.raises(SelfCheckError) as err:
        run_self_check(layout, caches, copier, order, num_blocks=NUM_BLOCKS)
    message = str(err.value)
    assert "layer 'l1'" in message and layout.layout_id in message and "refusing to start" in message
    # head 0, token 0 reads the same memory either way; head 0, token 1 is where the views part
    assert "stored chunk 0" in message and "block 3, token 1 of the block" in message and "head 0, element 0" \
        in message, message
    assert not any(cache.any() for cache in caches.values())  # the blocks are zero again all the same


def test_a_load_that_misplaces_pages_is_caught_at_the_target_blocks():
    """A load path that writes one layer's pages one block off (a scatter bug the save path does not share)
    is caught in the loaded blocks, naming the layer and the block."""
    from kvengine.integrations.vllm.paging import PagedCopier
    from kvengine.integrations.vllm.self_check import SelfCheckError, run_self_check

    layout, caches, copier, order = build(llama)

    class OneBlockOff(PagedCopier):
        def scatter_tensor(self, i, tensor, start, block_ids, null, lo, hi):
            shifted = tuple(tuple(b + 1 for b in ids) for ids in block_ids) if i == 0 else block_ids
            super().scatter_tensor(i, tensor, start, shifted, null, lo, hi)

    with pytest.raises(SelfCheckError, match=r"layer 'l0'.*loaded pages differ .* at block \d+, token 0") as err:
        run_self_check(layout, caches, OneBlockOff(layout, caches), order, num_blocks=NUM_BLOCKS)
    assert layout.layout_id in str(err.value)


def test_a_codec_that_does_not_give_its_bytes_back_is_caught_naming_the_codec_and_layer():
    """A lower tier's lossless codec whose round trip changes one byte refuses to start, naming the codec,
    the layer whose bytes changed and where."""
    from kvengine.chunks.codecs import RawCodec
    from kvengine.integrations.vllm.self_check import SelfCheckError, run_self_check

    class FlipsAByte(RawCodec):
        codec_id, name = 99, "flips-a-byte"

        def decode(self, stored, tensors):
            out = bytearray(stored)
            out[len(out) // 2 + 3] ^= 1  # in the second tensor
            return memoryview(bytes(out))

    layout, caches, copier, order = build(llama)
    with pytest.raises(SelfCheckError, match=r"layer 'l1'.*codec flips-a-byte does not give back the stored "
                                             r"chunk 0: first at block \d+, token \d+ of the block"):
        run_self_check(layout, caches, copier, order, num_blocks=NUM_BLOCKS, codecs=[FlipsAByte()])


def test_too_few_blocks_skip_the_check_by_name_and_write_nothing():
    """A KV cache too small for the synthetic request (two chunks, source and target) is reported SKIPPED with
    the reason; no block is written."""
    from kvengine.integrations.vllm.self_check import SelfCheckOutcome, run_self_check

    layout, caches, copier, order = build(llama, chunk=4 * BS)
    report = run_self_check(layout, caches, copier, order, num_blocks=NUM_BLOCKS)
    assert report.outcome is SelfCheckOutcome.SKIPPED and "16 KV blocks" in report.reason
    assert report.page_tensors == 0 and not any(cache.any() for cache in caches.values())
