"""What one SGLang HiCache page is, as a kvengine chunk, and where it lives in the host pool.

A page is stored as the byte regions the host pool's ``get_page_buffer_meta``
names for it, in that order, so a store or a load is one copy per region
and nothing else. Those regions depend on the pool and its layout:

===================  ====================================  ==========================
pool / layout         regions per page                      region shape
===================  ====================================  ==========================
MHA layer_first       k.0, v.0, k.1, v.1, ... (2 x layers)  (page, heads, head_dim)
MHA page_first        k, v                                   (page, layers, heads, head_dim)
MHA page_first_direct k, v                                   (layers, page, heads, head_dim)
MLA layer_first       kv.0, kv.1, ... (layers)              (page, 1, kv_dim)
MLA page_first        kv                                     (page, layers, 1, kv_dim)
MLA page_first_direct kv                                     (layers, page, 1, kv_dim)
===================  ====================================  ==========================

The :class:`ChunkLayout` spells this out (dtype and shapes), and the host
layout is part of the namespace, so pages written under one layout or dtype
are never read under another. Any other pool class or layout is refused with
:class:`UnsupportedModelError` at registration, before anything is stored.

This module reads the host pool by duck typing and imports nothing from SGLang.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec
from kvengine.errors import InvalidRequestError, UnsupportedModelError

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
#: dtypes of host slot indices (SGLang's are int64): a float or bool tensor is a caller's mistake.
_INDEX_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))


class PoolKind(enum.Enum):
    MHA = "MHATokenToKVPoolHost"
    MLA = "MLATokenToKVPoolHost"


_SUPPORTED_POOLS = {kind.value: kind for kind in PoolKind}


@dataclass(frozen=True, slots=True, kw_only=True)
class PageGeometry:
    """Shape of a host pool's pages; everything that changes what their bytes mean."""

    kind: PoolKind
    host_layout: str
    dtype: torch.dtype
    page_size: int
    layers: int
    #: MHA: KV heads on this rank; MLA: 1.
    heads: int
    #: MHA: head dim (K and V alike); MLA: kv_lora_rank + qk_rope_head_dim.
    head_dim: int
    #: MLA: (kv_lora_rank, qk_rope_head_dim), the split of ``head_dim`` into latent and rope parts. Two
    #: splits of one width (512 + 64, 544 + 32) store bytes that mean different things.
    mla_split: tuple[int, int] | None = None
    #: SGLang's name for a page byte format of the pool's own (None for plain pools).
    format_tag: str | None = None

    def __post_init__(self) -> None:
        if self.host_layout not in SUPPORTED_LAYOUTS:
            raise UnsupportedModelError(
                f"SGLang host pool layout {self.host_layout!r} is not supported by the kvengine HiCache "
                f"backend; start SGLang with --hicache-mem-layout one of {', '.join(SUPPORTED_LAYOUTS)}"
            )
        if min(self.page_size, self.layers, self.heads, self.head_dim) <= 0:
            raise UnsupportedModelError(f"SGLang host pool has an empty geometry: {self}")
        if self.kind is PoolKind.MLA and self.mla_split is None:
            raise UnsupportedModelError("SGLang MLA host pool without kv_lora_rank / qk_rope_head_dim: its latent "
                                        "and rope widths are part of what a page means; refusing it")

    @property
    def regions_per_page(self) -> int:
        return len(self.region_names())

    def region_names(self) -> list[str]:
        parts = ("k", "v") if self.kind is PoolKind.MHA else ("kv",)
        if self.host_layout == "layer_first":
            return [f"{p}.{layer}" for layer in range(self.layers) for p in parts]
        return list(parts)

    def region_shape(self) -> tuple[tuple[int, ...], int]:
        """(shape of one region, its token dimension)."""
        page, layers, heads, dim = self.page_size, self.layers, self.heads, self.head_dim
        if self.host_layout == "layer_first":
            return (page, heads, dim), 0
        if self.host_layout == "page_first":
            return (page, layers, heads, dim), 0
        return (layers, page, heads, dim), 1

    def chunk_layout(self, category: KVCategory | None = None) -> ChunkLayout:
        shape, token_dim = self.region_shape()
        if category is None:
            category = KVCategory.FULL_ATTENTION if self.kind is PoolKind.MHA else KVCategory.MLA_LATENT
        return ChunkLayout(self.page_size, tuple(
            TensorSpec(name=name, group=0, category=category, dtype=self.dtype, shape=shape, token_dim=token_dim)
            for name in self.region_names()
        ))

    @property
    def region_bytes(self) -> int:
        shape, _ = self.region_shape()
        n = self.dtype.itemsize
        for d in shape:
            n *= d
        return n

    def describe(self) -> str:
        """Human-readable KV spec (goes into the namespace's ``kv_spec_fingerprint``)."""
        dtype = str(self.dtype).removeprefix("torch.")
        tag = f":{self.format_tag}" if self.format_tag else ""
        split = f":latent={self.mla_split[0]}+rope={self.mla_split[1]}" if self.mla_split else ""
        return (f"sglang-{self.kind.name.lower()}:{dtype}:layers={self.layers}:heads={self.heads}:"
                f"dim={self.head_dim}{split}:page={self.page_size}{tag}")

    def legacy_regions(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Split a flat page of SGLang's non-zero-copy API (``get_data_page(flat=True)``) into regions."""
        if flat.dtype != self.dtype or flat.numel() * flat.element_size() != self.region_bytes * self.regions_per_page:
            raise InvalidRequestError(
                f"flat page of {flat.dtype} x {flat.numel()} does not match the pool's pages "
                f"({self.dtype}, {self.regions_per_page} x {self.region_bytes} B)")
        if not flat.is_contiguous():
            raise InvalidRequestError("flat pages must be contiguous")
        shape, _ = self.region_shape()
        if self.kind is PoolKind.MHA and self.host_layout == "layer_first":
            # (2, layers, page, heads, dim): K of every layer, then V of every layer.
            kv = flat.view(2, self.layers, *shape)
            return [kv[part, layer] for layer in range(self.layers) for part in (0, 1)]
        # Every other format is already the regions in order.
        return list(flat.view(self.regions_per_page, *shape).unbind(0))


def geometry_of(pool: Any) -> PageGeometry:
    """The geometry of a supported host pool; :class:`UnsupportedModelError` for any other."""
    name = type(pool).__name__
    kind = _SUPPORTED_POOLS.get(name)
    if kind is None:
        raise UnsupportedModelError(
            f"the kvengine HiCache backend supports SGLang host pools {sorted(_SUPPORTED_POOLS)}; this model "
            f"uses {name} (hybrid, quantised-scale or sparse KV). Use another --hicache-storage-backend for it."
        )
    if getattr(pool, "dcp_size", 1) != 1:
        raise UnsupportedModelError("the kvengine HiCache backend does not support decode context parallelism "
                                    f"(dcp_size={pool.dcp_size})")
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor) or not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise UnsupportedModelError(f"{name} has no contiguous host kv_buffer to read pages from")
    if kind is PoolKind.MHA:
        if pool.head_dim != pool.v_head_dim:
            raise UnsupportedModelError(f"MHA with K head dim {pool.head_dim} != V head dim {pool.v_head_dim} "
                                        "is not supported by the kvengine HiCache backend")
        heads, dim, split = int(pool.head_num), int(pool.head_dim), None
    else:
        heads, dim = 1, int(pool.kv_cache_dim)
        lora, rope = getattr(pool, "kv_lora_rank", None), getattr(pool, "qk_rope_head_dim", None)
        split = (int(lora), int(rope)) if lora is not None and rope is not None else None
    return PageGeometry(kind=kind, host_layout=str(pool.layout), dtype=pool.dtype, page_size=int(pool.page_size),
                        layers=int(pool.layer_num), heads=heads, head_dim=dim, mla_split=split,
                        format_tag=getattr(pool, "storage_format_tag", None))


class HostPages:
    """Typed views of pages in a host pool, addressed through ``get_page_buffer_meta``.

    The pool's pointers are checked against its buffer before anything is
    read or written through them.
    """

    def __init__(self, pool: Any, geometry: PageGeometry) -> None:
        self.pool = pool
        self.geometry = geometry
        self._buffer = pool.kv_buffer.view(-1)
        self._base = self._buffer.data_ptr()
        self._storage_offset = self._buffer.storage_offset()
        self._nbytes = self._buffer.numel() * self._buffer.element_size()
        self._shape, _ = geometry.region_shape()
        self._strides = _contiguous_strides(self._shape)
        self._check_meta()

    def _check_meta(self) -> None:
        """Refuse a pool whose page pointers do not describe the regions this module assumes."""
        page = self.geometry.page_size
        ptrs, sizes = self.pool.get_page_buffer_meta(torch.arange(page, 2 * page, dtype=torch.int64))
        want = self.geometry.regions_per_page
        if len(ptrs) != want or any(int(s) != self.geometry.region_bytes for s in sizes):
            raise UnsupportedModelError(
                f"{type(self.pool).__name__} ({self.geometry.host_layout}) names {len(ptrs)} regions of "
                f"{sorted(set(sizes))} B per page; the kvengine backend expects {want} of "
                f"{self.geometry.region_bytes} B")

    def page_views(self, host_indices: torch.Tensor, num_pages: int) -> list[list[torch.Tensor]]:
        """For each page of ``host_indices`` (``num_pages`` x page_size slots), its regions' views."""
        check_host_indices(host_indices)
        if host_indices.dim() != 1:
            raise InvalidRequestError(f"host_indices must be 1-D, got shape {tuple(host_indices.shape)}")
        if host_indices.numel() != num_pages * self.geometry.page_size:
            raise InvalidRequestError(
                f"{num_pages} keys need {num_pages * self.geometry.page_size} host indices, "
                f"got {host_indices.numel()}")
        if num_pages == 0:
            return []
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        per = self.geometry.regions_per_page
        if len(ptrs) != num_pages * per:
            raise InvalidRequestError(f"host pool returned {len(ptrs)} regions for {num_pages} pages")
        size = self.geometry.region_bytes
        item = self._buffer.element_size()
        views = []
        for p in range(num_pages):
            page = []
            for ptr, nbytes in zip(ptrs[p * per:(p + 1) * per], sizes[p * per:(p + 1) * per]):
                offset = int(ptr) - self._base
                if nbytes != size or offset < 0 or offset + size > self._nbytes or offset % item:
                    raise InvalidRequestError(f"host pool region at offset {offset} (+{nbytes} B) lies "
                                              f"outside its {self._nbytes} B buffer")
                page.append(self._buffer.as_strided(self._shape, self._strides, self._storage_offset + offset // item))
            views.append(page)
        return views


def check_host_indices(host_indices: object) -> None:
    """Raise :class:`InvalidRequestError` unless ``host_indices`` is an integer tensor of host slots
    (a float index would be truncated to some other page's slot)."""
    if not isinstance(host_indices, torch.Tensor):
        raise InvalidRequestError(f"host_indices must be a torch.Tensor of host slot indices, "
                                  f"got {type(host_indices).__name__}")
    if host_indices.dtype not in _INDEX_DTYPES:
        raise InvalidRequestError(f"host_indices must be integers, got dtype {host_indices.dtype}")


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


# -- hybrid models: Mamba state slots ------------------------------------------------------------------
MAMBA_POOL = "MambaPoolHost"
MAMBA_LAYOUTS = ("page_first", "page_first_direct")


@dataclass(frozen=True, slots=True)
class MambaGeometry:
    """What one Mamba state slot of a ``MambaPoolHost`` holds: the regions of one radix node's state.

    In both page-first layouts a slot is ``temporal[slot]`` (layers, 1, *temporal shape) and
    ``conv_i[slot]`` (layers, 1, *conv_i shape), contiguous: the same bytes either way.
    """

    #: (name, dtype, shape) of each non-empty region, in the order they are stored.
    regions: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]

    def describe(self) -> str:
        parts = ",".join(f"{name}={str(dtype).removeprefix('torch.')}{list(shape)}"
                         for name, dtype, shape in self.regions)
        return f"sglang-mamba-state:{parts}"

    def chunk_layout(self, chunk_size: int) -> ChunkLayout:
        """One state as a keyed chunk: no token dimension (a snapshot at the node's end)."""
        return ChunkLayout(chunk_size, tuple(
            TensorSpec(name=name, group=0, category=KVCategory.LINEAR_STATE, dtype=dtype, shape=shape,
                       token_dim=None)
            for name, dtype, shape in self.regions
        ))


class MambaStates:
    """Typed views of state slots of a ``MambaPoolHost``; refuses any pool it cannot copy exactly."""

    page_size = 1

    def __init__(self, pool: Any) -> None:
        name = type(pool).__name__
        if name != MAMBA_POOL:
            raise UnsupportedModelError(f"the kvengine HiCache backend stores Mamba state from {MAMBA_POOL} only; "
                                        f"this model's 'mamba' pool is {name}")
        if getattr(pool, "layout", None) not in MAMBA_LAYOUTS or int(getattr(pool, "page_size", 0)) != 1:
            raise UnsupportedModelError(f"{name} with layout {getattr(pool, 'layout', None)!r} (page size "
                                        f"{getattr(pool, 'page_size', None)}) is not supported by the kvengine "
                                        f"HiCache backend; it needs one of {', '.join(MAMBA_LAYOUTS)}")
        if getattr(pool, "slot_state_buffers", ()) or getattr(pool, "slot_state_device_tensors", ()):
            raise UnsupportedModelError(f"{name} carries registered per-slot side states besides its conv/temporal "
                                        "state; the kvengine HiCache backend does not store them, so it refuses "
                                        "the pool rather than restore a partial state")
        buffers = [("temporal", pool.temporal_buffer)] + [(f"conv.{i}", b) for i, b in enumerate(pool.conv_buffer)]
        size = int(pool.size)
        regions, self._buffers = [], []
        for region, buffer in buffers:
            if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous() \
                    or buffer.dim() < 2 or buffer.shape[0] != size:
                raise UnsupportedModelError(f"{name}: {region} is not a contiguous host buffer of {size} slots")
            if buffer.numel() == 0:  # conv-only models have an empty temporal state
                continue
            regions.append((region, buffer.dtype, tuple(int(d) for d in buffer.shape[1:])))
            self._buffers.append(buffer)
        if not regions:
            raise UnsupportedModelError(f"{name} has no state to store")
        # Records hold regions back to back; each must start at a multiple of its item size.
        order = sorted(range(len(regions)), key=lambda i: -regions[i][1].itemsize)
        self._buffers = [self._buffers[i] for i in order]
        try:
            self.geometry = MambaGeometry(tuple(regions[i] for i in order))
            self.geometry.chunk_layout(1)
        except InvalidRequestError as exc:
            raise UnsupportedModelError(f"{name}: its state cannot be stored by the kvengine HiCache backend "
                                        f"({exc})") from None
        self.pool = pool
        self._size = size

    def page_views(self, host_indices: torch.Tensor, num_keys: int) -> list[list[torch.Tensor]]:
        """For each of ``num_keys`` state slots of ``host_indices`` (one slot per key), its regions' views."""
        check_host_indices(host_indices)
        if host_indices.numel() != num_keys:
            raise InvalidRequestError(f"{num_keys} Mamba state keys need {num_keys} host slots, "
                                      f"got {host_indices.numel()}")
        slots = [int(i) for i in host_indices.reshape(-1).tolist()]
        if any(not 0 <= s < self._size for s in slots):
            raise InvalidRequestError(f"Mamba host slot outside the pool's {self._size} slots: {slots}")
        return [[buffer[s] for buffer in self._buffers] for s in slots]
