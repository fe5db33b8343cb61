"""What one kvengine chunk holds for a vLLM model, derived from vLLM's own declarations.

Two steps, both fail-closed (:class:`~kvengine.errors.UnsupportedModelError`
naming the group, layer or setting):

* :func:`plan_groups` (scheduler and worker) -- from ``kv_cache_config``:
  one :class:`GroupPlan` per KV cache group, by spec class. Only spec
  classes whose reuse has been validated end to end are accepted.
* :func:`derive_layout` (worker) -- from the registered per-layer caches, the
  attention backend each layer declares and the resolved
  :class:`~vllm.v1.kv_cache_layout.KVCacheLayout`: a :class:`PagedLayout`
  whose :class:`~kvengine.chunks.layout.ChunkLayout` stores, per layer, the whole
  KV pages of one chunk.

A chunk is stored as whole pages: vLLM hands each layer over as a logical
``[blocks, heads, block_tokens, content]`` view whatever its physical layout,
and what the content of a page means (the CPU backend keeps all K rows of a
head before its V rows, flash-attn splits K|V along the last axis) is the
backend's business. So the page bytes are copied as they are, and the
backend name and layout are part of the namespace: pages written by one
backend are never read by another.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
from kvengine.errors import UnsupportedModelError

#: One list of block ids per KV cache group, as vLLM's ``KVCacheBlocks.get_block_ids()``.
BlockIds = tuple[tuple[int, ...], ...]

#: Attention backends whose pages have been validated end to end (vLLM CPU build): the CPU backend, and
#: the AMX MLA backend (DeepSeek-style latent pages; AMX CPUs, bf16).
ATTENTION_BACKENDS = frozenset({"CPU_ATTN", "AMX_MLA"})
#: Backends accepted only with proof from the machine they run on: their pages are copied through vLLM's logical
#: [blocks, heads, tokens, content] view like every backend's (the layout math is unit-tested for every
#: KVCacheLayout), but this tree cannot run them (CUDA builds of vLLM). A worker serves with one only when a
#: verification record of ``kvengine verify vllm`` matches the running platform and model, or under the opt-in
#: that names the risk (:mod:`.acceptance`).
PROVABLE_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLASHMLA", "TRITON_MLA", "CUTLASS_MLA",
                               "FLASHINFER_MLA", "FLASH_ATTN_MLA"})
#: Backends refused for a known reason (anything else unknown is refused as not validated).
REFUSED_BACKENDS: Mapping[str, str] = {
    "CPU_MLA": "vLLM's reference CPU MLA backend has no prefill-with-context path (vLLM turns prefix caching "
               "and chunked prefill off for it), so the pages of a hit would be ignored and the model would "
               "answer from a truncated context; vLLM picks AMX_MLA instead on CPUs with AMX and bf16",
}
#: The KV cache spec classes :func:`plan_groups` accepts (the others are refused as not validated).
SUPPORTED_SPECS = ("FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, "
                   "MambaSpec in 'align' mode")
#: Spec classes that have no prefix reuse value, and why (any other unknown class: not validated).
NO_PREFIX_REUSE: Mapping[str, str] = {
    "CrossAttentionSpec": "holds K/V computed from the encoder's input (audio, source text), not from the "
                          "decoder's prefix: there is no prefix correspondence to key it by",
    "EncoderOnlyAttentionSpec": "is bidirectional encoder attention: every token's K/V depends on the whole "
                                "input and nothing is cached between steps",
    "CircularBufferSpec": "is a ring buffer overwritten in place (keys still being compressed): no position "
                          "keeps its content",
}
#: Recurrent-state backends whose state blocks have been validated (Qwen3-Next's gated delta net).
STATE_BACKENDS = frozenset({"GDN_ATTN"})
#: Physical layouts (``vllm.v1.kv_cache_layout.KVCacheLayout``: stride orders of the logical
#: [layers, blocks, heads, tokens, content] cache). Pages are copied through each layer's logical view, so
#: any of them works; its name is part of the namespace all the same.
KV_LAYOUTS = frozenset({"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"})


class GroupKind(enum.Enum):
    FULL = "full_attention"  # every block of the prefix is read
    MLA = "mla_latent"  # as FULL: one latent (+ rope key) page per block, shared by every head
    SLIDING = "sliding_window"  # only the blocks inside the window are read
    CHUNKED = "chunked_local"  # only the blocks of the current attention chunk are read (Llama 4)
    STATE = "recurrent_state"  # one state per block boundary vLLM materialized (mamba_cache_mode 'align')

    @property
    def every_block(self) -> bool:
        """Whether attention reads every block of the prefix (so a freed page makes a chunk unusable)."""
        return self in (GroupKind.FULL, GroupKind.MLA)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupPlan:
    """One vLLM KV cache group as the connector treats it."""

    group_id: int
    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    #: CHUNKED groups: tokens attend only within their aligned chunk of this many tokens
    attention_chunk_size: int | None = None
    #: the cache dtype vLLM chose for the group (attention pages), or each state tensor's dtype
    dtypes: tuple[str, ...] = ()
    #: STATE groups: each state tensor's shape per block (conv, then recurrent state)
    state_shapes: tuple[tuple[int, ...], ...] = ()
    #: bytes of one layer's state (conv + recurrent) in a block of a STATE group
    state_bytes: int = 0

    @property
    def category(self) -> KVCategory:
        return {GroupKind.FULL: KVCategory.FULL_ATTENTION, GroupKind.MLA: KVCategory.MLA_LATENT,
                GroupKind.SLIDING: KVCategory.SLIDING_WINDOW, GroupKind.CHUNKED: KVCategory.CHUNKED_LOCAL,
                GroupKind.STATE: KVCategory.LINEAR_STATE}[self.kind]


#: Why recurrent-state groups (Mamba, GDN linear attention: Qwen3-Next, ...) need mamba_cache_mode 'align'.
STATE_REFUSAL = (
    "recurrent (Mamba / linear-attention) state is reusable only at a position where vLLM materialized it; "
    "with mamba_cache_mode 'none' vLLM keeps one running state per request and materializes none. Enable "
    "prefix caching (vLLM then uses mamba_cache_mode 'align': a state at block-aligned chunk ends)")


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _refuse(what: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"kvengine vLLM connector: {what}: {why}; refusing to start "
                                 "(see docs/vllm.md, 'What is reused, and what is refused')")


def _plan_one(group_id: int, spec: Any, layer_names: Iterable[str]) -> GroupPlan:
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    name = type(spec).__name__
    layers = tuple(layer_names)
    where = f"KV cache group {group_id} ({name}, layers {list(layers)[:3]}{'...' if len(layers) > 3 else ''})"
    if isinstance(spec, AttentionSpec):
        if spec.kv_quant_mode != KVQuantMode.NONE:
            raise _refuse(where, f"quantized KV ({spec.kv_quant_mode.name}) keeps scales outside the pages")
        if spec.tokens_per_state != 1:
            raise _refuse(where, f"tokens_per_state={spec.tokens_per_state} (compressed pages) is not supported")
    if type(spec) is FullAttentionSpec:
        if spec.non_causal:
            raise _refuse(where, "non-causal attention: a prefix's KV depends on tokens after it")
        # A sliding window recorded on a FullAttentionSpec keeps every block (hybrid allocator off).
        return GroupPlan(group_id=group_id, kind=GroupKind.FULL, block_size=spec.block_size, layer_names=layers,
                         dtypes=(_dtype_name(spec.dtype),))
    if type(spec) is MLAAttentionSpec:
        # DeepSeek V2/V3-style latent attention: one [latent | rope key] vector per token, read by every head.
        if spec.model_version is not None or spec.alignment is not None or spec.non_causal \
                or spec.non_causal_multi_token_decode:
            raise _refuse(where, f"MLA variant (model_version={spec.model_version!r}, sparse/indexed caches, "
                                 "padded pages or non-causal decode) has not been validated")
        return GroupPlan(group_id=group_id, kind=GroupKind.MLA, block_size=spec.block_size, layer_names=layers,
                         dtypes=(_dtype_name(spec.dtype),))
    if type(spec) is SlidingWindowSpec:
        if spec.extra_retained_tokens:
            raise _refuse(where, "extra_retained_tokens (multi-token speculative prefill) is not supported")
        return GroupPlan(group_id=group_id, kind=GroupKind.SLIDING, block_size=spec.block_size,
                         layer_names=layers, sliding_window=spec.sliding_window, dtypes=(_dtype_name(spec.dtype),))
    if type(spec) is ChunkedLocalAttentionSpec:
        # Per-token K/V like full attention; vLLM frees the blocks before the current attention chunk, so
        # pages are handled as for a sliding window (dropped pages zero-filled, never read back).
        return GroupPlan(group_id=group_id, kind=GroupKind.CHUNKED, block_size=spec.block_size, layer_names=layers,
                         attention_chunk_size=spec.attention_chunk_size, dtypes=(_dtype_name(spec.dtype),))
    if type(spec) is MambaSpec:
        if spec.mamba_cache_mode != "align":
            raise _refuse(where, f"mamba_cache_mode={spec.mamba_cache_mode!r}: {STATE_REFUSAL}")
        if spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks:
            raise _refuse(where, "speculative or prefill-checkpoint state blocks move the state of a position "
                                 "to another block; not validated")
        return GroupPlan(group_id=group_id, kind=GroupKind.STATE, block_size=spec.block_size, layer_names=layers,
                         dtypes=tuple(_dtype_name(d) for d in spec.dtypes),
                         state_shapes=tuple(tuple(int(n) for n in shape) for shape in spec.shapes),
                         state_bytes=spec.state_content_size_bytes)
    why = NO_PREFIX_REUSE.get(name, "has not been validated for reuse")
    raise _refuse(where, f"spec class {name} {why} (supported: {SUPPORTED_SPECS})")


#: vLLM custom ops whose CPU kernels compute wrong KV for a group kind, and what to do about it.
INEXACT_KERNELS: Mapping[tuple[GroupKind, str], str] = {
    (GroupKind.MLA, "rotary_embedding"): (
        "vLLM's CPU rotary_embedding kernel is wrong for the 3-D, strided rope inputs of MLA layers (the "
        "rope key in the latent page; measured: outputs differ from transformers, and cached and recomputed "
        "runs diverge), so the stored latents are not reproducible; set compilation_config={'custom_ops': "
        "['-rotary_embedding']} (vLLM then uses its plain-torch rotary embedding)"),
}


def check_kernels(plans: Iterable[GroupPlan], enabled_custom_ops: Iterable[str]) -> None:
    """Refuse groups whose KV a custom op vLLM dispatched in this process computes wrongly
    (:data:`INEXACT_KERNELS`); ``enabled_custom_ops`` is vLLM's record of the ops it dispatched."""
    enabled = set(enabled_custom_ops)
    for plan in plans:
        for (kind, op), why in INEXACT_KERNELS.items():
            if plan.kind is kind and op in enabled:
                raise _refuse(f"KV cache group {plan.group_id} ({kind.value})", why)


def plan_groups(kv_cache_config: object) -> tuple[GroupPlan, ...]:
    """Classify every KV cache group; raise for anything that cannot be reused exactly."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        raise _refuse("model", "it has no KV cache groups (encoder-only or pooling model)")
    plans = []
    for group_id, group in enumerate(groups):
        where = f"KV cache group {group_id}"
        if not getattr(group, "enable_kv_transfer", True) or getattr(group, "host_resident", False):
            raise _refuse(where, "host-resident or non-transferable groups are not supported")
        if getattr(group, "is_eagle_group", False):
            raise _refuse(where, "EAGLE/MTP draft groups are not supported")
        plans.append(_plan_one(group_id, group.kv_cache_spec, group.layer_names))
    return tuple(plans)


#: The smallest chunk ``chunk_size: "auto"`` picks (tokens): large enough that per-chunk costs
#: (hashing, a record, a lookup step) stay small next to the copy, small enough to match short prefixes.
AUTO_CHUNK_TARGET = 256


@dataclass(frozen=True, slots=True)
class Chunking:
    """How this instance cuts KV into chunks: decided once, when the connector starts
    (:func:`resolve_chunking`), and trusted by everything below it (both halves, the layout)."""

    #: vLLM's KV cache groups, in group id order.
    plans: tuple[GroupPlan, ...]
    #: Tokens per chunk: a whole number of blocks of every group.
    chunk_size: int
    #: Hits end at a multiple of this many tokens past the last whole chunk (0: whole chunks only).
    tail_step: int
    #: Whether the user set ``chunk_size`` (else "auto" chose it).
    explicit: bool

    @property
    def state_group(self) -> GroupPlan | None:
        """The recurrent-state group of a hybrid model, if any."""
        return next((p for p in self.plans if p.kind is GroupKind.STATE), None)


def resolve_chunking(plans: tuple[GroupPlan, ...], requested: int | None, *, world_size: int,
                     tails: bool = True) -> Chunking:
    """The chunking of ``plans``: ``requested`` chunk size or "auto" (None; :func:`resolve_chunk_size`),
    and with ``tails`` (a cache, not a handoff role) its tail step (:func:`tail_step`).

    :raises UnsupportedModelError: ``requested`` does not cover whole blocks of every group.
    """
    size = resolve_chunk_size(plans, requested)
    return Chunking(plans, size, tail_step(plans, size, world_size) if tails else 0, requested is not None)


def resolve_chunk_size(plans: Iterable[GroupPlan], requested: int | None) -> int:
    """The chunk size: ``requested`` if it covers whole blocks of every group (else refused, naming a
    valid value), or for ``None`` ("auto") the smallest multiple of every group's block size (their
    least common multiple) that is at least :data:`AUTO_CHUNK_TARGET`.

    Chunks must cover whole blocks of every group: the engine's unit is a page. vLLM picks the block
    sizes at start-up, per model, dtype and platform (a hybrid model's attention block grows to hold
    its recurrent state page, whose size follows the platform's state dtype), so only "auto" is
    portable across machines.
    """
    sizes = sorted({p.block_size for p in plans})
    need = math.lcm(*sizes)
    auto = need * -(-AUTO_CHUNK_TARGET // need)
    if requested is None:
        return auto
    if requested <= 0 or requested % need:
        valid = need * max(1, -(-requested // need)) if requested > 0 else auto
        raise _refuse("chunk_size", f"kvengine chunk_size {requested} must be a positive multiple of vLLM's "
                                    f"block size{'s' if len(sizes) > 1 else ''} {sizes} (chosen by vLLM for "
                                    f"this model and platform); set kv_connector_extra_config['kvengine']"
                                    f"['chunk_size'] to 'auto' (here {auto}) or e.g. {valid}")
    return requested


def tail_step(plans: tuple[GroupPlan, ...], chunk_size: int, world_size: int) -> int:
    """Tokens per tail step (:mod:`kvengine.core.tails`): every group's block (their least common multiple),
    so hits end at the last whole block; 0 (whole chunks only) where a chunk is one block, for models with
    recurrent state (hits end where a state is stored: chunk boundaries) and where ranks share one MLA copy
    (the other ranks mirror rank 0's chunks whole, :mod:`.replica`)."""
    step = math.lcm(*(p.block_size for p in plans))
    if step >= chunk_size or chunk_size % step or any(p.kind is GroupKind.STATE for p in plans) or \
            shares_one_copy(plans, world_size):
        return 0
    return step


def shares_one_copy(plans: tuple[GroupPlan, ...], world_size: int) -> bool:
    """Whether rank 0 stores the only copy and shares its loads (MLA under tensor parallelism, :mod:`.replica`)."""
    return world_size > 1 and all(p.kind is GroupKind.MLA for p in plans)


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedTensor:
    """One stored tensor of a chunk: a layer's pages."""

    layer: str
    group_id: int
    kind: GroupKind
    #: kernel blocks per vLLM (manager) block; vLLM may split pages for its kernels.
    kernel_ratio: int
    #: kernel pages of this tensor per chunk
    pages: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StateTensor:
    """One layer's recurrent state: the first ``nbytes`` of each block of its cache (conv, then SSM state)."""

    layer: str
    group_id: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """A chunk of a vLLM model: the :class:`ChunkLayout` plus where each tensor comes from."""

    chunk: ChunkLayout
    tensors: tuple[PagedTensor, ...]  # same order as chunk.tensors
    groups: tuple[GroupPlan, ...]
    #: backend/layout/page geometry, for the namespace
    layout_id: str
    spec_fingerprint: str
    #: layers that share another layer's cache (stored once), to that layer
    aliases: Mapping[str, str] = field(default_factory=dict)
    #: recurrent-state layers (stored per block boundary, apart from the chunks), in layer order
    states: tuple[StateTensor, ...] = ()
    #: every attention and state backend the layers declared
    backends: frozenset[str] = frozenset()

    @property
    def unproven_backends(self) -> frozenset[str]:
        """The backends that need a verification record (or the risk opt-in) to serve: :data:`PROVABLE_BACKENDS`."""
        return self.backends & PROVABLE_BACKENDS

    @property
    def state_group(self) -> GroupPlan | None:
        """The recurrent-state group, if the model has one."""
        return next((g for g in self.groups if g.kind is GroupKind.STATE), None)

    def tensor_index(self, layer: str) -> int | None:
        """Index in :attr:`tensors` of the pages that hold ``layer``'s KV (None: not a cached layer)."""
        owner = self.aliases.get(layer, layer)
        return next((i for i, t in enumerate(self.tensors) if t.layer == owner), None)


def platform_choices(plans: Iterable[GroupPlan], conv_state_layout: str | None) -> str:
    """What vLLM chose for this model *on this platform* that changes the bytes of a chunk or a state,
    by name: each group's block size and dtypes, and for recurrent state the tensors' shapes and the
    conv state layout (``VLLM_SSM_CONV_STATE_LAYOUT``: ``SD`` is (state_len, dim), ``DS`` its
    transpose, whose byte count and, for square states, shape are the same).

    These follow the CPU (an AVX-512 bf16 machine keeps the SSM state in float32 and so picks a larger
    block) and settings, so two machines sharing a cache differ here and never exchange chunks.
    """
    parts = []
    for p in plans:
        part = f"g{p.group_id}:{p.kind.value}:block={p.block_size}:dtypes={','.join(p.dtypes)}"
        if p.kind is GroupKind.SLIDING:
            part += f":window={p.sliding_window}"
        if p.kind is GroupKind.CHUNKED:
            part += f":local_chunk={p.attention_chunk_size}"
        if p.kind is GroupKind.STATE:
            part += f":shapes={'|'.join('x'.join(map(str, s)) for s in p.state_shapes)}:conv={conv_state_layout}"
        parts.append(part)
    return ";".join(parts)


def spec_fingerprint(kv_cache_config: object) -> str:
    """Digest of every group's spec (class, geometry, dtype, window) and layer names."""
    desc = [[type(g.kv_cache_spec).__name__, repr(g.kv_cache_spec), list(g.layer_names)]
            for g in kv_cache_config.kv_cache_groups]  # type: ignore[attr-defined]
    return xxhash.xxh3_128_hexdigest(json.dumps(desc, separators=(",", ":")).encode())


def derive_layout(
    chunking: Chunking,
    kv_caches: Mapping[str, torch.Tensor],
    backends: Mapping[str, str],
    kv_layout: str,
    *,
    num_blocks: int,
    fingerprint: str,
    conv_state_layout: str | None = None,
) -> PagedLayout:
    """The chunk layout of a model whose caches vLLM registered as ``kv_caches``, cut as ``chunking`` says.

    ``backends`` maps each layer to its declared backend name; ``kv_layout``
    is the resolved :class:`KVCacheLayout` name; ``conv_state_layout`` is
    vLLM's conv state layout (``SD``/``DS``), required with a state group.
    """
    plans, chunk_size = chunking.plans, chunking.chunk_size
    if kv_layout not in KV_LAYOUTS:
        raise _refuse("KV cache layout", f"{kv_layout!r} has not been validated (supported: {sorted(KV_LAYOUTS)})")
    specs: list[tuple[TensorSpec, PagedTensor]] = []
    # Groups overlay one backing allocation (block ids tell them apart), so
    # only a layer of the *same* group with the same view shares a cache.
    owners: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    used_backends: set[str] = set()
    states: list[StateTensor] = []
    for plan in plans:
        if plan.kind is GroupKind.STATE:
            if conv_state_layout not in ("SD", "DS"):
                raise _refuse(f"KV cache group {plan.group_id}", f"conv state layout {conv_state_layout!r} is "
                                                                 "unknown (expected 'SD' or 'DS')")
            states += [_state_tensor(plan, layer, kv_caches, backends, num_blocks) for layer in plan.layer_names]
            used_backends |= {backends[layer] for layer in plan.layer_names}
            continue
        for layer in plan.layer_names:
            backend = backends.get(layer)
            if backend not in ATTENTION_BACKENDS | PROVABLE_BACKENDS:
                why = REFUSED_BACKENDS.get(backend or "", "it has not been validated")
                raise _refuse(f"layer {layer}", f"attention backend {backend!r}: {why} (supported: "
                                                f"{sorted(ATTENTION_BACKENDS)}; with a verification record of "
                                                f"this platform: {sorted(PROVABLE_BACKENDS)})")
            used_backends.add(str(backend))
            cache = kv_caches.get(layer)
            if cache is None:
                raise _refuse(f"layer {layer}", "vLLM registered no KV cache tensor for it")
            identity = (plan.group_id, cache.data_ptr(), tuple(cache.shape), tuple(cache.stride()))
            if identity in owners:  # a layer sharing another layer's cache: stored once
                aliases[layer] = owners[identity]
                continue
            owners[identity] = layer
            specs.append(_paged_tensor(plan, layer, cache, num_blocks=num_blocks, chunk_size=chunk_size))
    # Typed views need byte offsets aligned to each item size: largest items first.
    specs.sort(key=lambda s: -s[0].itemsize)
    chunk = ChunkLayout(chunk_size, tuple(s for s, _ in specs))
    ratios = sorted({(t.group_id, t.kernel_ratio) for _, t in specs})
    layout_id = f"vllm:{'+'.join(sorted(used_backends))}:{kv_layout}:kernel{ratios}:" \
                f"{platform_choices(plans, conv_state_layout if states else None)}"
    if states:
        layout_id += f":state{sorted({t.nbytes for t in states})}"
    return PagedLayout(chunk, tuple(t for _, t in specs), plans, layout_id, fingerprint, aliases, tuple(states),
                       backends=frozenset(used_backends))


def _state_tensor(plan: GroupPlan, layer: str, kv_caches: Mapping[str, torch.Tensor], backends: Mapping[str, str],
                  num_blocks: int) -> StateTensor:
    backend = backends.get(layer)
    if backend not in STATE_BACKENDS:
        raise _refuse(f"layer {layer}", f"recurrent-state backend {backend!r} has not been validated "
                                        f"(supported: {sorted(STATE_BACKENDS)})")
    cache = kv_caches.get(layer)
    if cache is None:
        raise _refuse(f"layer {layer}", "vLLM registered no state tensor for it")
    if cache.dtype not in (torch.int8, torch.uint8) or cache.shape[0] != num_blocks or \
            cache[0].numel() < plan.state_bytes:
        raise _refuse(f"layer {layer}", f"state cache of shape {tuple(cache.shape)} / {cache.dtype} is not "
                                        f"[{num_blocks} blocks, ...] of bytes holding {plan.state_bytes} B each")
    return StateTensor(layer=layer, group_id=plan.group_id, nbytes=plan.state_bytes)


def _paged_tensor(plan: GroupPlan, layer: str, cache: torch.Tensor, *, num_blocks: int,
                  chunk_size: int) -> tuple[TensorSpec, PagedTensor]:
    if cache.dim() != 4 or cache.shape[0] % num_blocks:
        raise _refuse(f"layer {layer}", f"cache view of shape {tuple(cache.shape)} is not [blocks, heads, "
                                        f"tokens, content] over {num_blocks} blocks")
    ratio = cache.shape[0] // num_blocks
    page_shape = tuple(int(d) for d in cache.shape[1:])
    kernel_tokens = page_shape[1]
    if kernel_tokens * ratio != plan.block_size:
        raise _refuse(f"layer {layer}", f"{ratio} kernel pages of {kernel_tokens} tokens do not make a "
                                        f"block of {plan.block_size}")
    pages = chunk_size // kernel_tokens
    # token_dim=None: pages are indivisible, the engine never stores partial chunks here.
    spec = TensorSpec(name=layer, group=plan.group_id, category=plan.category, dtype=cache.dtype,
                      shape=(pages, *page_shape), token_dim=None)
    return spec, PagedTensor(layer=layer, group_id=plan.group_id, kind=plan.kind, kernel_ratio=ratio, pages=pages)
