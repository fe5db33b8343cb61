"""The connector's halves against vLLM's own classes, without starting an engine.

* refusals: spec classes, quantized KV, chunk sizes, backends, layouts, vLLM settings;
* the scheduler half driving a real :class:`~kvengine.KVEngine` over the real
  channel: repeated asks, release of hits vLLM does not take, requests that
  finish before being scheduled, load plans handed to the worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import time
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (use .venv-vllm, see docs/vllm.md)")

BS = 32


def spec(cls_name: str, **kw):
    import vllm.v1.kv_cache_interface as kvi

    base = dict(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    if cls_name == "MambaSpec":
        return kvi.MambaSpec(block_size=BS, shapes=((3, 8),), dtypes=(torch.float32,), **kw)
    return getattr(kvi, cls_name)(**{**base, **kw})


def config_of(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec(layer_names=[f"l{i}"], kv_cache_spec=s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


# ------------------------------------------------------------------ refusals --
def test_full_sliding_window_and_chunked_local_groups_are_planned():
    """Sliding-window, chunked-local and full-attention groups are planned in order, with their window or
    attention chunk (named in the layout id: it changes which pages a chunk holds) and layer names."""
    from kvengine.integrations.vllm.layout import GroupKind, plan_groups, platform_choices

    plans = plan_groups(config_of(spec("SlidingWindowSpec", sliding_window=64), spec("FullAttentionSpec"),
                                  spec("ChunkedLocalAttentionSpec", attention_chunk_size=128)))
    assert [p.kind for p in plans] == [GroupKind.SLIDING, GroupKind.FULL, GroupKind.CHUNKED]
    assert plans[0].sliding_window == 64 and plans[1].layer_names == ("l1",) and plans[2].attention_chunk_size == 128
    assert not plans[2].kind.every_block and "local_chunk=128" in platform_choices(plans, None)


def test_mla_group_is_planned_as_one_latent_page_per_block():
    """DeepSeek-style MLA: one latent (+ rope key) vector per token, shared by every head; a missing page
    makes a chunk unusable, as for full attention."""
    from kvengine import KVCategory
    from kvengine.integrations.vllm.layout import GroupKind, plan_groups

    (plan,) = plan_groups(config_of(spec("MLAAttentionSpec", num_kv_heads=1, head_size=576)))
    assert plan.kind is GroupKind.MLA and plan.category is KVCategory.MLA_LATENT and plan.kind.every_block


def test_mla_under_vllms_cpu_rotary_kernel_is_refused():
    """vLLM's CPU rotary_embedding custom op computes wrong rope keys for MLA: an MLA group is refused while vLLM
    dispatched it, accepted once it is off; other groups are not concerned."""
    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.vllm.layout import check_kernels, plan_groups

    mla = plan_groups(config_of(spec("MLAAttentionSpec", num_kv_heads=1, head_size=576)))
    with pytest.raises(UnsupportedModelError, match="custom_ops.*-rotary_embedding"):
        check_kernels(mla, {"rms_norm", "rotary_embedding"})
    check_kernels(mla, {"rms_norm"})
    check_kernels(plan_groups(config_of(spec("FullAttentionSpec"))), {"rotary_embedding"})


def test_recurrent_state_group_is_planned_in_align_mode():
    """A Mamba group in align mode is planned as a state group of its state bytes, next to full attention."""
    from kvengine.integrations.vllm.layout import GroupKind, plan_groups

    plans = plan_groups(config_of(spec("MambaSpec", mamba_cache_mode="align"), spec("FullAttentionSpec")))
    assert [p.kind for p in plans] == [GroupKind.STATE, GroupKind.FULL]
    assert plans[0].state_bytes == 3 * 8 * 4


@pytest.mark.parametrize("make, match", [
    (lambda: spec("MambaSpec"), "mamba_cache_mode='none'.*Enable prefix caching"),
    (lambda: spec("MambaSpec", mamba_cache_mode="align", num_speculative_blocks=1), "speculative"),
    (lambda: spec("MLAAttentionSpec", num_kv_heads=1, head_size=576, model_version="deepseek_v4"), "MLA variant"),
    (lambda: spec("SinkFullAttentionSpec", sink_len=4), "SinkFullAttentionSpec has not been validated"),
    (lambda: spec("CrossAttentionSpec"), "CrossAttentionSpec holds K/V computed from the encoder's input"),
    (lambda: spec("FullAttentionSpec", non_causal=True), "non-causal"),
])
def test_unvalidated_or_inexact_groups_are_refused(make, match):
    """Whatever cannot be reused exactly is refused at start-up, naming the group and why."""
    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.vllm.layout import plan_groups

    with pytest.raises(UnsupportedModelError, match=match) as err:
        plan_groups(config_of(spec("FullAttentionSpec"), make()))
    assert "KV cache group 1" in str(err.value) and "refusing to start" in str(err.value)


def test_quantized_kv_is_refused():
    """A group with quantized KV is refused at start-up."""
    from vllm.v1.kv_cache_interface import KVQuantMode

    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.vllm.layout import plan_groups

    with pytest.raises(UnsupportedModelError, match="quantized KV"):
        plan_groups(config_of(spec("FullAttentionSpec", kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)))


@pytest.mark.parametrize("block_sizes, auto", [
    ((16,), 256), ((128,), 256), ((384,), 384), ((544,), 544), ((96, 64), 384), ((32, 1152), 1152), ((100,), 300),
])
def test_auto_chunk_size_is_the_smallest_common_multiple_of_the_block_sizes_at_least_the_target(block_sizes, auto):
    """chunk_size "auto": the least common multiple of every group's block size, scaled up to at least
    AUTO_CHUNK_TARGET tokens; an explicit multiple is kept as it is."""
    from kvengine.integrations.vllm.layout import AUTO_CHUNK_TARGET, plan_groups, resolve_chunk_size

    plans = plan_groups(config_of(*(spec("FullAttentionSpec", block_size=b) for b in block_sizes)))
    chosen = resolve_chunk_size(plans, None)
    assert chosen == auto and chosen >= AUTO_CHUNK_TARGET and all(chosen % b == 0 for b in block_sizes)
    assert resolve_chunk_size(plans, 2 * auto) == 2 * auto


@pytest.mark.parametrize("requested, valid", [(192, 256), (0, 256), (-128, 256), (64, 128)])
def test_explicit_chunk_size_that_does_not_cover_whole_blocks_is_refused_naming_a_valid_value(requested, valid):
    """An explicit chunk_size that is not a positive multiple of the block size is refused, naming 'auto' and a
    valid value."""
    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.vllm.layout import plan_groups, resolve_chunk_size

    plans = plan_groups(config_of(spec("FullAttentionSpec", block_size=128)))
    with pytest.raises(UnsupportedModelError, match=rf"chunk_size {requested} must be a positive multiple of "
                                                    rf"vLLM's block size \[128\].*'auto' \(here 256\) or e\.g\. "
                                                    rf"{valid}\b"):
        resolve_chunk_size(plans, requested)


def test_connector_options_read_auto_explicit_and_environment_chunk_sizes(monkeypatch):
    """chunk_size unset or "auto" (in the section or KVENGINE_CHUNK_SIZE) means auto; a number is kept;
    anything else is a ConfigError naming chunk_size and 'auto'."""
    from kvengine.errors import ConfigError
    from kvengine.integrations.vllm.options import ConnectorOptions

    monkeypatch.delenv("KVENGINE_CHUNK_SIZE", raising=False)
    assert ConnectorOptions.from_extra_config({}).chunk_size is None
    assert ConnectorOptions.from_extra_config({"kvengine": {"chunk_size": "auto"}}).chunk_size is None
    assert ConnectorOptions.from_extra_config({"kvengine": {"chunk_size": 768}}).chunk_size == 768
    monkeypatch.setenv("KVENGINE_CHUNK_SIZE", "auto")
    assert ConnectorOptions.from_extra_config({"kvengine": {"chunk_size": 768}}).chunk_size is None
    monkeypatch.setenv("KVENGINE_CHUNK_SIZE", "512")
    options = ConnectorOptions.from_extra_config({})
    assert options.chunk_size == 512 and options.with_chunk_size(512).engine.chunk_size == 512
    monkeypatch.setenv("KVENGINE_CHUNK_SIZE", "big")
    with pytest.raises(ConfigError, match="chunk_size.*'auto'"):
        ConnectorOptions.from_extra_config({})


def _derive(backend: str = "CPU_ATTN", layout: str = "LBHNC", chunk: int = 2 * BS, caches=None):
    from kvengine.integrations.vllm.layout import derive_layout, plan_groups, resolve_chunking

    plans = plan_groups(config_of(spec("SlidingWindowSpec", sliding_window=64), spec("FullAttentionSpec")))
    if caches is None:
        backing = torch.zeros(16, 2, BS, 64)
        caches = {"l0": backing, "l1": backing}  # groups overlay one allocation, as vLLM does
    return derive_layout(resolve_chunking(plans, chunk, world_size=1), caches, {"l0": backend, "l1": backend},
                         layout, num_blocks=16, fingerprint="fp")


def test_overlaid_groups_are_stored_separately():
    """Regression: two groups whose layers view the same backing tensor are two tensors of the chunk
    (only a layer sharing a cache within one group is stored once)."""
    layout = _derive()
    assert [t.layer for t in layout.tensors] == ["l0", "l1"]
    assert layout.chunk.tensors[0].shape == (2, 2, BS, 64) and layout.layout_id.startswith("vllm:CPU_ATTN:LBHNC")


def test_kernel_pages_smaller_than_blocks():
    """vLLM may split a block into kernel pages: a chunk holds chunk/kernel_tokens pages per layer."""
    backing = torch.zeros(32, 2, BS // 2, 64)
    layout = _derive(caches={"l0": backing, "l1": backing})
    assert layout.tensors[0].kernel_ratio == 2 and layout.chunk.tensors[0].shape == (4, 2, BS // 2, 64)


def _derive_hybrid(conv: str | None, *, block: int = BS, state_dtypes=(torch.bfloat16, torch.bfloat16),
                   shapes=((3, 8), (2, 4, 4))):
    """A recurrent-state group next to a full-attention group, as vLLM registers Qwen3-Next's."""
    import vllm.v1.kv_cache_interface as kvi

    from kvengine.integrations.vllm.layout import derive_layout, plan_groups, resolve_chunking

    state = kvi.MambaSpec(block_size=block, shapes=shapes, dtypes=state_dtypes, mamba_cache_mode="align")
    plans = plan_groups(config_of(state, spec("FullAttentionSpec", block_size=block)))
    caches = {"l0": torch.zeros(16, 4096, dtype=torch.int8), "l1": torch.zeros(16, 2, block, 64)}
    return derive_layout(resolve_chunking(plans, block, world_size=1), caches, {"l0": "GDN_ATTN", "l1": "CPU_ATTN"},
                         "LBHNC", num_blocks=16, fingerprint="fp", conv_state_layout=conv)


def test_every_per_platform_choice_is_named_in_the_layout_id():
    """The conv state layout (SD/DS: same bytes, transposed), the state dtypes (float32 on AVX-512 bf16
    CPUs, the model dtype elsewhere), state shapes and block sizes each change the layout id by name,
    so two machines that chose differently never share a chunk or a state."""
    sd = _derive_hybrid("SD")
    assert "conv=SD" in sd.layout_id and "block=32" in sd.layout_id and "dtypes=bfloat16,bfloat16" in sd.layout_id
    variants = [_derive_hybrid("DS"), _derive_hybrid("SD", state_dtypes=(torch.bfloat16, torch.float32)),
                _derive_hybrid("SD", shapes=((8, 3), (2, 4, 4))), _derive_hybrid("SD", block=64)]
    ids = {sd.layout_id} | {v.layout_id for v in variants}
    assert len(ids) == 5
    # SD and DS states have the same byte count: only the name tells them apart.
    assert _derive_hybrid("DS").states == sd.states


def test_a_state_group_without_a_known_conv_layout_is_refused():
    """A recurrent-state group whose conv state layout is unknown (none or unrecognized) is refused."""
    from kvengine.errors import UnsupportedModelError

    for conv in (None, "XY"):
        with pytest.raises(UnsupportedModelError, match="conv state layout"):
            _derive_hybrid(conv)


@pytest.mark.parametrize("kw, match", [
    ({"backend": "CPU_MLA"}, "attention backend 'CPU_MLA': .*no prefill-with-context path"),
    ({"backend": "SOME_NEW_ATTN"}, "attention backend 'SOME_NEW_ATTN': it has not been validated"),
    ({"layout": "LXYZC"}, "KV cache layout"),
    ({"chunk": 48}, "chunk_size 48"),
])
def test_unknown_backend_layout_or_chunk_is_refused(kw, match):
    """An unvalidated attention backend, an unknown KV cache layout or a chunk size off the blocks is refused."""
    from kvengine.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=match):
        _derive(**kw)


@pytest.mark.parametrize("layout_name, kernel_tokens", [
    *((name, BS) for name in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")),
    # vLLM splits blocks into kernel pages only where a block is one dense page
    ("LBHNC", BS // 2), ("LBNHC", BS // 2),
])
def test_pages_round_trip_through_every_kv_cache_layout(layout_name, kernel_tokens):
    """Every physical layout vLLM declares (``KVCacheLayout``: stride orders of [layers, blocks, heads,
    tokens, content], GPU backends' included), built with vLLM's own ``create_kv_cache_views`` over one
    allocation shared by two layers, with kernel pages of a block and half a block: a chunk gathered
    from a request's blocks holds each token's logical page content, and scattered into other blocks of
    a cache in another layout it lands on the same logical positions, touching nothing else."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvengine.integrations.vllm.layout import derive_layout, plan_groups, resolve_chunking
    from kvengine.integrations.vllm.paging import PagedCopier

    kv = spec("FullAttentionSpec")
    plans = plan_groups(config_of(kv))
    blocks_n, layers = 16, ("l0", "l0b")

    def caches(name: str, seed: int) -> dict[str, torch.Tensor]:
        layout = KVCacheLayout[name]
        nbytes = blocks_n * kv.page_size_bytes * len(layers)
        # the strides vLLM's allocator gives this layout (blocks of all layers' pages when B is outermost)
        fixed = kv.page_size_bytes * len(layers) if layout.is_block_outermost else None
        layer_stride, block_stride, *_ = compute_layout_strides(kv, blocks_n, len(layers), layout,
                                                                fixed_strides=(None, fixed, None, None, None))
        tensor = KVCacheTensor(size=nbytes, layers=list(layers), layer_stride=layer_stride,
                               block_stride=block_stride)
        raw = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
        views = create_kv_cache_views(raw, kv, blocks_n, layout, tensor,
                                      kernel_block_size=None if kernel_tokens == BS else kernel_tokens)
        return dict(zip(layers, views))

    src = caches(layout_name, 1)
    # another layout that vLLM can split the same way
    dst_layout = ("LBNHC" if layout_name == "LBHNC" else "LBHNC") if kernel_tokens != BS or layout_name == "BLNHC" \
        else "BLNHC"
    dst = caches(dst_layout, 2)
    before = {k: v.clone() for k, v in dst.items()}
    plans = (dataclasses.replace(plans[0], layer_names=layers),)
    paged = derive_layout(resolve_chunking(plans, 2 * BS, world_size=1), src, dict.fromkeys(layers, "CPU_ATTN"),
                          layout_name, num_blocks=blocks_n, fingerprint="fp")
    src_ids, dst_ids = ((5, 2, 9),), ((11, 0, 7),)
    out = [torch.empty(t.shape, dtype=t.dtype) for t in paged.chunk.tensors]
    reader, writer = PagedCopier(paged, src), PagedCopier(paged, dst)
    for i in range(len(paged.tensors)):
        reader.gather_into(i, 0, src_ids, -1, out[i])
    for i in range(len(paged.tensors)):
        writer.scatter_tensor(i, out[i], 0, dst_ids, -1, 0, 2 * BS)

    def page(cache: torch.Tensor, block: int) -> torch.Tensor:  # one manager block's bits: [heads, tokens, content]
        ratio = cache.shape[0] // blocks_n
        return torch.cat([cache[block * ratio + r] for r in range(ratio)], dim=1).view(torch.int32)

    for layer in layers:
        for s_block, d_block in zip(src_ids[0][:2], dst_ids[0][:2]):
            assert torch.equal(page(dst[layer], d_block), page(src[layer], s_block))
        untouched = [b for b in range(blocks_n) if b not in dst_ids[0][:2]]
        assert all(torch.equal(page(dst[layer], b), page(before[layer], b)) for b in untouched)


def vllm_config(**over):
    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1, prefill_context_parallel_size=1),
        speculative_config=None, model_config=SimpleNamespace(is_encoder_decoder=False, enable_sleep_mode=False),
        kv_transfer_config=SimpleNamespace(kv_role="kv_both", kv_load_failure_policy="recompute"),
        cache_config=SimpleNamespace(cache_dtype="auto"))
    for path, value in over.items():
        obj = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg


@pytest.mark.parametrize("over, error, match", [
    ({"kv_transfer_config.kv_load_failure_policy": "fail"}, "ConfigError", "kv_load_failure_policy='recompute'"),
    ({"kv_transfer_config.kv_role": "kv_mirror"}, "ConfigError", "kv_role must be one of"),
    ({"parallel_config.pipeline_parallel_size": 2}, "UnsupportedModelError", "pipeline_parallel_size=2"),
    ({"cache_config.cache_dtype": "fp8"}, "UnsupportedModelError", "kv_cache_dtype"),
    ({"speculative_config": object()}, "UnsupportedModelError", "speculative"),
    ({"model_config.enable_sleep_mode": True}, "UnsupportedModelError", "enable_sleep_mode is not supported"),
])
def test_vllm_settings_the_connector_refuses(over, error, match):
    """The default settings pass; a non-recompute failure policy, an unknown role, pipeline parallelism, an
    fp8 KV cache, speculative decoding or sleep mode (weights reloaded after wake-up are not the ones
    fingerprinted) are refused by name."""
    import kvengine.errors as errors
    from kvengine.integrations.vllm.connector import check_vllm_config

    check_vllm_config(vllm_config())  # the defaults pass
    with pytest.raises(getattr(errors, error), match=match):
        check_vllm_config(vllm_config(**over))


def test_only_a_consumer_may_fail_requests_it_cannot_load():
    """kv_load_failure_policy 'fail' is accepted for a kv_consumer (its handed-off prompts fail when they cannot
    be loaded) and refused for a cache or a producer, where a fault must be a miss."""
    from kvengine.errors import ConfigError
    from kvengine.integrations.vllm.connector import check_vllm_config

    check_vllm_config(vllm_config(**{"kv_transfer_config.kv_role": "kv_consumer",
                                     "kv_transfer_config.kv_load_failure_policy": "fail"}))
    with pytest.raises(ConfigError, match="'fail' is for a kv_consumer"):
        check_vllm_config(vllm_config(**{"kv_transfer_config.kv_role": "kv_producer",
                                         "kv_transfer_config.kv_load_failure_policy": "fail"}))


@pytest.mark.parametrize("role, extra, kinds, world, error, match", [
    ("kv_producer", {}, ("full_attention",), 1, "ConfigError", "needs kv_connector_extra_config handoff.listen.*or a "
                                                               "kvengine.mooncake tier"),
    ("kv_consumer", {}, ("full_attention",), 1, "ConfigError", "needs kvengine.peers.peers"),
    ("kv_producer", {"handoff": {"listen": "127.0.0.1:7000"}}, ("recurrent_state", "full_attention"), 2,
     "UnsupportedModelError", "recurrent-state KV cache groups \\[0\\] at tensor_parallel_size=2 is not validated"),
])
def test_handoff_roles_refuse_what_they_lack_or_cannot_serve(role, extra, kinds, world, error, match):
    """A producer without a handoff address, a consumer without producers to load from, and a hybrid model
    under tensor parallelism (its handoff is validated at one rank, where it is accepted)."""
    import kvengine.errors as errors
    from kvengine.integrations.vllm.connector import check_roles
    from kvengine.integrations.vllm.handoff import Role
    from kvengine.integrations.vllm.layout import GroupKind, GroupPlan
    from kvengine.integrations.vllm.options import ConnectorOptions

    plans = tuple(GroupPlan(group_id=i, kind=GroupKind(kind), block_size=BS, layer_names=(f"l{i}",))
                  for i, kind in enumerate(kinds))
    options = ConnectorOptions.from_extra_config(extra)
    check_roles(plans, options, Role.BOTH, world)  # a local cache needs neither
    if world > 1:
        check_roles(plans, options, Role(role))  # one rank: accepted
    with pytest.raises(getattr(errors, error), match=match):
        check_roles(plans, options, Role(role), world)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_mooncake_tier_is_enough_for_either_handoff_role(role):
    """A producer with no handoff server and a consumer with no peers hand off through the Mooncake Store they
    share; the consumer then trusts params naming it (and its peers, where it has some)."""
    from kvengine.integrations.vllm.connector import check_roles
    from kvengine.integrations.vllm.handoff import VIA_MOONCAKE, Role, handoff_sources
    from kvengine.integrations.vllm.layout import GroupKind, GroupPlan
    from kvengine.integrations.vllm.options import ConnectorOptions

    plans = (GroupPlan(group_id=0, kind=GroupKind.FULL, block_size=BS, layer_names=("l0",)),)
    options = ConnectorOptions.from_extra_config({"kvengine": {"mooncake": {"master": "127.0.0.1:50051"}}})
    check_roles(plans, options, Role(role))
    assert handoff_sources(options.engine) == {VIA_MOONCAKE}
    both = ConnectorOptions.from_extra_config({"kvengine": {"mooncake": {"master": "127.0.0.1:50051"},
                                                            "peers": {"peers": ["127.0.0.1:7601"]}}})
    assert handoff_sources(both.engine) == {VIA_MOONCAKE, "127.0.0.1:7601"}
    assert handoff_sources(ConnectorOptions.from_extra_config({}).engine) == frozenset()


# ------------------------------------------------------------------ scheduler half --
CHUNK = 2 * BS


@contextlib.contextmanager
def make_halves(*, held_chunks: tuple[int, ...] = (3,), has_state: bool = False, tail_step: int = 0,
                held_tokens: int = 0, **engine_extra):
    """The scheduler half wired through the real channel to one real engine per tensor-parallel rank (no vLLM
    engine); rank r holds the first ``held_chunks[r]`` chunks of ``tokens`` (or, where given, what a store of
    its first ``held_tokens`` tokens keeps: with ``tail_step``, a tail too). ``engine`` and ``desk`` are
    rank 0's."""
    from kvengine import ChunkLayout, KVCategory, KVEngine, Namespace, TensorSpec
    from kvengine.integrations.vllm.channel import LookupService
    from kvengine.integrations.vllm.layout import GroupKind, GroupPlan
    from kvengine.integrations.vllm.metadata import ChannelAddress
    from kvengine.integrations.vllm.scheduler import SchedulerSide
    from kvengine.integrations.vllm.worker import ReservationDesk

    layout = ChunkLayout(CHUNK, (TensorSpec(name="l0", group=0, category=KVCategory.FULL_ATTENTION,
                                            dtype=torch.float32, shape=(2, 2, BS, 8), token_dim=None),))
    tokens = list(range(10, 10 + 4 * CHUNK))
    ranks, addresses = [], []
    with contextlib.ExitStack() as stack:
        for rank, held in enumerate(held_chunks):
            engine = stack.enter_context(KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "8MiB"},
                                                   **engine_extra}, transports=[]))
            desk = ReservationDesk(engine, Namespace(model="halves-test", rank=rank, world_size=len(held_chunks)),
                                   layout, tail_step=tail_step)
            service = LookupService(desk)
            stack.callback(service.close)
            path, key = service.start()
            addresses.append(ChannelAddress(path, key, 0))
            if held:
                engine.store(desk.binding(""), tokens[:held_tokens or held * CHUNK],
                             lambda i, s, e: [torch.full((2, 2, BS, 8), float(i))])
            ranks.append(SimpleNamespace(engine=engine, desk=desk))
        state = GroupPlan(group_id=0, kind=GroupKind.STATE, block_size=BS, layer_names=("s0",)) if has_state else None
        sched = SchedulerSide(chunk_size=CHUNK, asynchronous=False, lookup_wait_s=5.0, state_group=state,
                              tail_step=tail_step)
        sched.connect(addresses)
        stack.callback(sched.shutdown)
        sched.bind_kv_cache_manager(SimpleNamespace(block_pool=SimpleNamespace(null_block=SimpleNamespace(
            block_id=0)), get_block_ids=lambda rid: ([1, 2, 3, 4, 5],)))
        yield SimpleNamespace(engine=ranks[0].engine, desk=ranks[0].desk, ranks=ranks, sched=sched, tokens=tokens)


@pytest.fixture
def halves():
    with make_halves() as h:
        yield h


def request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_tokens=len(tokens), all_token_ids=tokens, prompt_token_ids=tokens,
                           num_prompt_tokens=len(tokens), mm_features=[], lora_request=None, cache_salt=None,
                           skip_reading_prefix_cache=False, pooling_params=None, prompt_embeds=None)


def settle(h, active: int) -> None:
    """Releases are fire-and-forget: wait until the worker side has handled them."""
    deadline = time.monotonic() + 5
    while h.engine.metrics.value("kvengine_reservations_active") != active and time.monotonic() < deadline:
        time.sleep(0.01)


def blocks(*ids: int) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def test_repeated_asks_return_the_same_reservation(halves):
    """vLLM asks again while a request waits for blocks: same answer, no new pins or lookups counted."""
    req = request("a", halves.tokens)
    assert halves.sched.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    pins = halves.engine._core.memory.total_pins()
    assert pins == 3
    assert halves.sched.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    assert halves.engine._core.memory.total_pins() == pins
    assert halves.engine.metrics.value("kvengine_lookups_total") == 1


def test_hit_not_taken_by_vllm_is_released_at_once(halves):
    """Scenario: vLLM allocates the request without the external tokens (it trimmed the hit)."""
    req = request("a", halves.tokens)
    halves.sched.get_num_new_matched_tokens(req, 0)
    halves.sched.update_state_after_alloc(req, blocks(1, 2, 3), 0)
    settle(halves, 0)
    assert halves.engine._core.memory.total_pins() == 0 and len(halves.desk) == 0


def test_request_finished_before_being_scheduled_leaves_nothing_pinned(halves):
    """Scenario: looked up, never scheduled (no free blocks), then aborted."""
    req = request("a", halves.tokens)
    halves.sched.get_num_new_matched_tokens(req, 0)
    assert halves.sched.request_finished(req) == (False, None)
    settle(halves, 0)
    assert halves.engine._core.memory.total_pins() == 0 and len(halves.desk) == 0


def test_local_hit_covering_the_match_releases(halves):
    """vLLM's own prefix cache already covers what the engine holds: nothing to load, nothing kept."""
    req = request("a", halves.tokens)
    assert halves.sched.get_num_new_matched_tokens(req, 3 * CHUNK) == (0, False)
    settle(halves, 0)
    assert halves.engine._core.memory.total_pins() == 0


def test_committed_load_is_handed_to_the_worker_with_its_blocks_and_stores_follow(halves):
    """update_state_after_alloc commits; build_connector_meta emits the load (tokens [local, matched)) once,
    and the prompt chunks the step completes beyond the hit as a store."""
    req = request("a", halves.tokens)
    assert halves.sched.get_num_new_matched_tokens(req, CHUNK) == (2 * CHUNK, False)
    halves.sched.update_state_after_alloc(req, blocks(1, 2, 3, 4, 5), 2 * CHUNK)
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=3 * CHUNK)],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                          num_scheduled_tokens={"a": CHUNK})
    meta = halves.sched.build_connector_meta(out)
    (load,) = meta.loads
    assert (load.request_id, load.start, load.end, load.block_ids) == ("a", CHUNK, 3 * CHUNK, ((1, 2, 3, 4, 5),))
    (save,) = meta.saves
    assert len(save.tokens) == 4 * 4 * CHUNK  # the whole prompt (4 chunks) as uint32
    assert halves.desk.take("a") is not None  # the reservation waits for the worker's load
    assert halves.sched.build_connector_meta(out).loads == []


def test_tensor_parallel_refuses_what_is_not_validated_across_ranks():
    """Several ranks: full attention and recurrent state pass, and MLA alone at two ranks (rank 0's one copy,
    loaded by both); MLA next to another group or at more than two ranks, and shadow checks are refused by
    name. Only MLA alone at several ranks shares one copy."""
    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.vllm.connector import check_tensor_parallel
    from kvengine.integrations.vllm.layout import plan_groups, shares_one_copy
    from kvengine.integrations.vllm.options import ConnectorOptions

    options = ConnectorOptions.from_extra_config({})
    full = plan_groups(config_of(spec("FullAttentionSpec")))
    mla = spec("MLAAttentionSpec", num_kv_heads=1, head_size=576)
    check_tensor_parallel(full, options, 2)
    check_tensor_parallel(plan_groups(config_of(mla)), options, 2)
    assert shares_one_copy(plan_groups(config_of(mla)), 2) and not shares_one_copy(plan_groups(config_of(mla)), 1)
    assert not shares_one_copy(full, 2)
    check_tensor_parallel(plan_groups(config_of(spec("MambaSpec", mamba_cache_mode="align"))), options, 2)
    for groups, world, match in (((mla, spec("FullAttentionSpec")), 2, r"MLA latent pages \(KV cache groups \[0\]\) "
                                                                       "next to other"),
                                 ((mla,), 3, "MLA latent pages has not been validated: rank 0 stores the one copy")):
        check_tensor_parallel(plan_groups(config_of(*groups)), options, 1)
        with pytest.raises(UnsupportedModelError, match=f"tensor_parallel_size={world} with {match}"):
            check_tensor_parallel(plan_groups(config_of(*groups)), options, world)
    shadowed = ConnectorOptions.from_extra_config({"kvengine": {"shadow": {"first_hits": 1}}})
    with pytest.raises(UnsupportedModelError, match="shadow checks"):
        check_tensor_parallel(full, shadowed, 2)


def test_each_rank_gets_its_own_disk_directory_and_metrics_port(tmp_path):
    """One writer per disk directory: rank r of n uses disk.path/tp<r>-of-<n> and metrics_port + r; one rank
    uses the options as given. Only rank 0 publishes KV events (one stream per engine for a router)."""
    from kvengine.integrations.vllm.options import ConnectorOptions

    options = ConnectorOptions.from_extra_config({"kvengine": {"disk": {"path": str(tmp_path / "kv")},
                                                               "metrics_port": 9400,
                                                               "events": {"endpoint": "tcp://127.0.0.1:5557"}}})
    assert options.for_rank(0, 1) is options
    rank0, rank1 = options.for_rank(0, 2).engine, options.for_rank(1, 2).engine
    assert rank1.disk.path == tmp_path / "kv" / "tp1-of-2" and rank1.metrics_port == 9401
    assert (rank0.events.endpoint, rank1.events.endpoint) == ("tcp://127.0.0.1:5557", None)


def test_a_handoff_rank_serves_and_reads_at_its_ports_plus_its_rank():
    """Handoff roles under tensor parallelism: rank r of a producer serves on handoff.listen / advertise + r,
    rank r of a consumer reads from each peer's port + r (the producers' rank r, the same shard); a cache
    (kv_both) keeps its peers as given."""
    from kvengine.integrations.vllm.options import ConnectorOptions

    options = ConnectorOptions.from_extra_config({
        "kvengine": {"peers": {"peers": ["10.0.0.1:7601", "10.0.0.2:7601"]}},
        "handoff": {"listen": "0.0.0.0:7601", "advertise": "10.0.0.3:7701"}})
    rank1 = options.for_rank(1, 2, handoff=True)
    assert rank1.engine.peers.peers == ("10.0.0.1:7602", "10.0.0.2:7602")
    assert (rank1.handoff.listen, rank1.handoff.advertise) == ("0.0.0.0:7602", "10.0.0.3:7702")
    assert options.for_rank(0, 2, handoff=True).handoff == options.handoff
    assert options.for_rank(1, 2).engine.peers.peers == options.engine.peers.peers


def test_handoff_roles_at_two_ranks_refuse_mla_and_an_unfixed_port():
    """Rank r finds its counterpart at a port + r: a producer's port must be given; MLA at TP > 1 keeps one
    copy on rank 0, which handoffs do not cover."""
    from kvengine.errors import ConfigError, UnsupportedModelError
    from kvengine.integrations.vllm.connector import check_roles
    from kvengine.integrations.vllm.handoff import Role
    from kvengine.integrations.vllm.layout import GroupKind, GroupPlan
    from kvengine.integrations.vllm.options import ConnectorOptions

    full = (GroupPlan(group_id=0, kind=GroupKind.FULL, block_size=BS, layer_names=("l0",)),)
    mla = (GroupPlan(group_id=0, kind=GroupKind.MLA, block_size=BS, layer_names=("l0",)),)
    fixed = ConnectorOptions.from_extra_config({"handoff": {"listen": "127.0.0.1:7601"}})
    check_roles(full, fixed, Role.PRODUCER, 2)
    with pytest.raises(UnsupportedModelError, match="'kv_producer' with MLA at tensor_parallel_size=2"):
        check_roles(mla, fixed, Role.PRODUCER, 2)
    any_port = ConnectorOptions.from_extra_config({"handoff": {"listen": "127.0.0.1:0"}})
    check_roles(full, any_port, Role.PRODUCER, 1)
    with pytest.raises(ConfigError, match="handoff.listen 127.0.0.1:0: at tensor_parallel_size=2 give a port"):
        check_roles(full, any_port, Role.PRODUCER, 2)


def _pins_settle(ranks, expected):
    deadline = time.monotonic() + 5
    while [r.engine._core.memory.total_pins() for r in ranks] != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return [r.engine._core.memory.total_pins() for r in ranks]


def test_a_hit_across_ranks_is_what_every_rank_holds_and_releases_reach_every_rank():
    """Tensor parallelism: the scheduler asks every rank; the hit is the minimum; asking again is stable and
    pins nothing more; a request finished unscheduled releases every rank's reservation."""
    with make_halves(held_chunks=(3, 2)) as h:
        req = request("a", h.tokens)
        assert h.sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
        pins = [r.engine._core.memory.total_pins() for r in h.ranks]
        assert pins == [3, 2]  # each rank holds its own reservation until its load ends
        assert h.sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
        assert [r.engine._core.memory.total_pins() for r in h.ranks] == pins
        h.sched.request_finished(req)
        assert _pins_settle(h.ranks, [0, 0]) == [0, 0]


def test_a_prefix_one_rank_lacks_is_a_miss_and_the_other_ranks_release_it():
    """A rank without the prefix makes it a miss: the ranks that reserved it release at once."""
    with make_halves(held_chunks=(3, 0)) as h:
        assert h.sched.get_num_new_matched_tokens(request("a", h.tokens), 0) == (0, False)
        assert _pins_settle(h.ranks, [0, 0]) == [0, 0]
        assert all(len(r.desk) == 0 for r in h.ranks)


def decode_step(rid: str, computed_before: int) -> SimpleNamespace:
    """A scheduler output in which ``rid`` decodes one token after ``computed_before`` computed ones."""
    return SimpleNamespace(scheduled_new_reqs=[],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[rid], num_computed_tokens=[computed_before]),
                           num_scheduled_tokens={rid: 1})


@pytest.mark.parametrize("has_state", [False, True])
def test_chunks_completed_by_generated_tokens_are_stored_as_they_fill(has_state):
    """The next turn of a chat contains this reply: a chunk completed while decoding is stored in the step
    that computes its last token (with the generated ids), and only once; not before its tokens are known
    (async scheduling). A hybrid model stores its prompt only (no recurrent state at decode boundaries)."""
    from kvengine.integrations.vllm.scheduler import token_bytes

    with make_halves(has_state=has_state) as h:
        prompt = h.tokens[:CHUNK + 10]
        req = request("d", prompt)
        h.sched.get_num_new_matched_tokens(req, 0)
        h.sched.update_state_after_alloc(req, blocks(1, 2), 0)
        first = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="d", num_computed_tokens=0)],
                                scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                                num_scheduled_tokens={"d": len(prompt)})
        assert [len(s.tokens) // 4 for s in h.sched.build_connector_meta(first).saves] == [CHUNK]
        generated = list(range(900, 900 + 3 * CHUNK))
        saves = []
        for n in range(1, CHUNK):  # decode: token len(prompt) + n - 1 is fed and computed in this step
            req.all_token_ids = prompt + generated[:n]
            req.num_tokens = len(req.all_token_ids)
            saves += h.sched.build_connector_meta(decode_step("d", len(prompt) + n - 1)).saves
        if has_state:
            assert saves == []
            return
        (save,) = saves
        assert save.tokens == token_bytes((prompt + generated)[:2 * CHUNK]) and not save.state_at_end
        # Async scheduling: the step that computes the last token of chunk 3 runs before its id is known here.
        req.all_token_ids = (prompt + generated)[:3 * CHUNK - 1]
        assert h.sched.build_connector_meta(decode_step("d", 3 * CHUNK - 1)).saves == []
        req.all_token_ids = (prompt + generated + [7])[:3 * CHUNK + 1]
        (late,) = h.sched.build_connector_meta(decode_step("d", 3 * CHUNK)).saves
        assert late.tokens == token_bytes(req.all_token_ids[:3 * CHUNK])


def test_with_tails_hits_and_stores_end_at_whole_blocks():
    """tail_step (vLLM's block): the stored tail after the last whole chunk is offered, asking again renews
    it (same pins), and stores follow every block a step completes: the prompt's last whole block, then each
    block the reply completes."""
    with make_halves(tail_step=BS, held_tokens=2 * CHUNK + BS + 5) as h:
        req = request("t", h.tokens[: 3 * CHUNK])
        assert h.sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK + BS, False)
        pins = h.engine._core.memory.total_pins()
        assert pins == 3  # two chunks and the tail
        assert h.sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK + BS, False)
        assert h.engine._core.memory.total_pins() == pins
        assert h.sched.request_finished(req) == (False, None)
        settle(h, 0)
        prompt = h.tokens[3 * CHUNK : 3 * CHUNK + BS + 10]  # unrelated to what is held
        req = request("u", prompt)
        assert h.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # a lookup of less than a chunk goes out
        h.sched.update_state_after_alloc(req, blocks(1, 2), 0)
        first = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="u", num_computed_tokens=0)],
                                scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                                num_scheduled_tokens={"u": len(prompt)})
        assert [len(s.tokens) // 4 for s in h.sched.build_connector_meta(first).saves] == [BS]
        saves = []
        for n in range(1, 2 * BS):
            req.all_token_ids = prompt + list(range(700, 700 + n))
            req.num_tokens = len(req.all_token_ids)
            saves += h.sched.build_connector_meta(decode_step("u", len(prompt) + n - 1)).saves
        assert [len(s.tokens) // 4 for s in saves] == [2 * BS, 3 * BS]


def test_a_hit_sampled_for_a_shadow_check_is_computed_by_vllm_and_compared_by_the_worker():
    """shadow.first_hits=1: the first hit is answered with 0 external tokens and nothing reserved (asking
    again gives the same answer); the steps that compute it carry a verify range for the worker; the next
    request's hit is offered as usual."""
    with make_halves(shadow={"first_hits": 1}) as h:
        req = request("a", h.tokens)
        for _ in range(2):
            assert h.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        settle(h, 0)
        assert h.engine._core.memory.total_pins() == 0 and h.desk.take("a") is None
        out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=0)],
                              scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                              num_scheduled_tokens={"a": 2 * CHUNK})
        (save,) = h.sched.build_connector_meta(out).saves
        assert save.verify == (0, 2 * CHUNK)  # the chunks this step computed, of the 3 cached
        out = SimpleNamespace(scheduled_new_reqs=[],
                              scheduled_cached_reqs=SimpleNamespace(req_ids=["a"], num_computed_tokens=[2 * CHUNK]),
                              num_scheduled_tokens={"a": 2 * CHUNK - 1})
        (save,) = h.sched.build_connector_meta(out).saves
        assert save.verify == (2 * CHUNK, 3 * CHUNK)
        assert h.sched.stats.shadow_checks == 1
        assert h.sched.get_num_new_matched_tokens(request("b", h.tokens), 0) == (3 * CHUNK, False)


# ------------------------------------------------------------- recurrent state --
STATE_BYTES = 40


@pytest.fixture
def state_desk():
    """A desk for a hybrid model: attention chunks plus recurrent states at chunk boundaries."""
    from kvengine import ChunkLayout, KVCategory, KVEngine, Namespace, TensorSpec
    from kvengine.integrations.vllm.layout import GroupKind, GroupPlan, PagedLayout, StateTensor
    from kvengine.integrations.vllm.state import BoundaryStates
    from kvengine.integrations.vllm.worker import ReservationDesk

    chunk = ChunkLayout(CHUNK, (TensorSpec(name="attn", group=1, category=KVCategory.FULL_ATTENTION,
                                           dtype=torch.float32, shape=(2, 2, BS, 8), token_dim=None),))
    groups = (GroupPlan(group_id=0, kind=GroupKind.STATE, block_size=BS, layer_names=("lin",),
                        state_bytes=STATE_BYTES),
              GroupPlan(group_id=1, kind=GroupKind.FULL, block_size=BS, layer_names=("attn",)))
    paged = PagedLayout(chunk, (), groups, "test", "fp", {}, (StateTensor(layer="lin", group_id=0,
                                                                          nbytes=STATE_BYTES),))
    caches = {"lin": torch.zeros(8, 1, 1, STATE_BYTES, dtype=torch.int8)}
    engine = KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "8MiB"}}, transports=[])
    states = BoundaryStates(engine, paged, caches)
    desk = ReservationDesk(engine, Namespace(model="hybrid-test"), chunk, states)
    tokens = list(range(10, 10 + 4 * CHUNK))
    engine.store(desk.binding(""), tokens[:3 * CHUNK], lambda i, s, e: [torch.full((2, 2, BS, 8), float(i))])
    yield SimpleNamespace(engine=engine, desk=desk, states=states, cache=caches["lin"], tokens=tokens)
    engine.close()


def test_hybrid_hit_stops_at_the_last_boundary_with_a_stored_state(state_desk):
    """Chunks cover 3 chunks but only the state at 2 chunks is stored: the hit is 2 chunks, stable when
    asked again, and carries that state; the third chunk's pin is dropped."""
    import numpy as np

    from kvengine.integrations.vllm.scheduler import token_bytes

    h = state_desk
    ids = np.array(h.tokens, dtype="<u4")
    h.cache[5].fill_(7)
    assert h.states.save(h.desk.binding(""), ids[:2 * CHUNK], block_id=5)
    for _ in range(2):
        assert h.desk.lookup("r", "", token_bytes(h.tokens), 4 * CHUNK - 1).loadable == 2 * CHUNK
        assert h.engine._core.memory.total_pins() == 2
    taken = h.desk.take("r")
    res, state = taken.hit, taken.state
    assert res.tokens == 2 * CHUNK and state[0].eq(7).all()
    h.states.install(state, 3)
    assert torch.equal(h.cache[3], h.cache[5])
    h.engine.release(res)
    assert h.engine._core.memory.total_pins() == 0


def test_hybrid_load_offered_less_than_this_ranks_hit_gets_the_state_at_the_offered_end(state_desk):
    """Tensor parallelism offers vLLM the least hit over the ranks: a rank whose own hit (2 chunks) is longer
    hands its load the state at the offered end (1 chunk), looked up then; at an end with no stored state,
    none (the load fails: every rank recomputes); asked for its own end, the state it held."""
    import numpy as np

    from kvengine.integrations.vllm.scheduler import token_bytes

    h = state_desk
    ids = np.array(h.tokens, dtype="<u4")
    for block, chunks, value in ((5, 2, 7), (6, 1, 3)):
        h.cache[block].fill_(value)
        assert h.states.save(h.desk.binding(""), ids[:chunks * CHUNK], block_id=block)
    for end, want in ((CHUNK, 3), (2 * CHUNK, 7), (CHUNK + BS, None)):
        assert h.desk.lookup("r", "", token_bytes(h.tokens), 4 * CHUNK - 1).loadable == 2 * CHUNK
        taken = h.desk.take("r", end)
        res, state = taken.hit, taken.state
        assert res.tokens == 2 * CHUNK
        assert (state is None) if want is None else state[0].eq(want).all()
        h.engine.release(res)
    assert h.engine._core.memory.total_pins() == 0


def test_hybrid_hit_without_any_stored_state_is_a_miss(state_desk):
    """Chunks are cached but no boundary state is: the hybrid lookup is a miss, pins nothing, reserves nothing."""
    from kvengine.integrations.vllm.scheduler import token_bytes

    h = state_desk
    assert h.desk.lookup("r", "", token_bytes(h.tokens), 4 * CHUNK - 1).loadable == 0
    assert h.engine._core.memory.total_pins() == 0 and h.desk.take("r") is None


class _HungWorker:
    """A worker whose lookups do not return until :attr:`go` is set (a read stuck past its own deadline)."""

    def __init__(self, matched: int) -> None:
        import threading

        self.go = threading.Event()
        self.matched = matched
        self.released: list[str] = []

    def lookup(self, request_id, salt, tokens, max_tokens, producer=None, computed=0):
        from kvengine.lookups import MISS, LookupOutcome, LookupResult

        self.go.wait(30)
        return LookupResult(LookupOutcome.HIT, self.matched) if self.matched else MISS

    def lookup_now(self, *args, **kwargs):
        return None

    def release(self, request_id):
        self.released.append(request_id)

    def stats(self):
        return {}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_lookup_the_worker_never_answers_becomes_a_miss_at_its_deadline(policy):
    """Scenario: the worker's lookup hangs (a fetch stuck past its own timeout). The scheduler says 'not yet'
    until its deadline, then gives it up: a miss the request computes (recompute policy; a handed-off prompt
    under 'fail' is offered whole so its load fails and vLLM fails it), counted, the same answer when vLLM asks
    again; and what the late lookup reserves is released after it (the worker runs a request's calls in order)."""
    from kvengine.integrations.vllm.channel import LookupService
    from kvengine.integrations.vllm.handoff import HandoffParams, Role
    from kvengine.integrations.vllm.metadata import ChannelAddress
    from kvengine.integrations.vllm.scheduler import SchedulerSide
    from kvengine.integrations.vllm.stats import SchedulerStatsSource

    worker = _HungWorker(matched=2 * CHUNK)
    service = LookupService(worker)
    path, key = service.start()
    producer = "127.0.0.1:7000"
    sched = SchedulerSide(chunk_size=CHUNK, asynchronous=False, lookup_wait_s=0.01, lookup_deadline_s=0.5,
                          role=Role.CONSUMER, producers=frozenset({producer}), fail_short_handoffs=policy == "fail")
    try:
        sched.connect([ChannelAddress(path, key, 0, namespace="ns")])
        tokens = list(range(10, 10 + 3 * CHUNK))
        req = request("a", tokens)
        req.kv_transfer_params = HandoffParams(producer, len(tokens) - 1, "ns").to_transfer_params()
        t0 = time.monotonic()
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        while (answer := sched.get_num_new_matched_tokens(req, 0)) == (None, False):
            assert time.monotonic() - t0 < 5, "the scheduler kept waiting past its deadline"
            time.sleep(0.05)
        assert time.monotonic() - t0 >= 0.5
        assert sched.stats.lookup_timeouts == 1 and sched.stats.lookups == 1
        assert SchedulerStatsSource(sched.stats).take().data["counters"]["lookup_timeouts"] == 1  # vLLM's metrics
        if policy == "recompute":
            assert answer == (0, False)
        else:  # the whole prompt less its last token, which the worker holds no reservation for: the load fails
            assert answer == (len(tokens) - 1, False) and sched.stats.failed_handoffs == 1
        assert sched.get_num_new_matched_tokens(req, 0) == answer  # the same answer, never waited for again
        assert sched.stats.lookups == 1
        worker.go.set()
        deadline = time.monotonic() + 5
        while "a" not in worker.released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.released == ["a"]  # after the late lookup, once
    finally:
        worker.go.set()
        sched.shutdown()
        service.close()
