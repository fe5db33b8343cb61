"""The worker's device self-check at start: known pages through the real copy path, compared byte for byte.

At ``register_kv_caches`` vLLM has allocated its KV tensors (zero-filled) and
handed out no block yet (block 0 is its null block), so any other block is
free. :func:`run_self_check` then, on those real tensors:

1. *pattern*: fills the pages of a synthetic two-chunk request with values
   that encode (tensor, token, head, element) -- small integers, exact in
   every float KV dtype, so a transposed, shifted or swapped page shows --
   in *source* blocks (consecutive ids from 1; every group gets its own ids,
   since vLLM's groups overlay one allocation);
2. *save*: the worker's :class:`~.pipeline.LayerPipeline` save stages copy
   them into the staged slots of a private, memory-only
   :class:`~kvengine.KVEngine` (the same store code and host arena, pinned
   where CUDA is), committed;
3. *stored chunk*: each chunk the engine then serves must hold the pattern in
   chunk order (page ``j`` = tokens ``j * kernel_tokens ...``), which checks
   the gather against vLLM's logical ``[blocks, heads, tokens, content]`` view;
4. *codecs*: each lossless codec the configured lower tiers write with must
   decode its encoding of every chunk to the same bytes;
5. *load*: the pipeline's load stages scatter the chunks into *target*
   blocks (ids in reverse, so the index path runs), compared with the pattern;
6. hybrid models: one recurrent state per state layer is stored, found and
   installed into another block the same way (:class:`~.state.BoundaryStates`).

Every block used is zeroed again and the private engine closed: nothing is
left in the user's tiers (they are never written) and no reservation or pin
remains. A difference raises :class:`SelfCheckError` naming the layer, the
layout and the first differing offset: the worker refuses to start.

Under tensor parallelism each rank checks its own tensors and its local copy
path only (MLA's shared loads, :mod:`.replica`, are not used: no rank waits
for another).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Gauge

from kvengine.chunks.codecs import Codec
from kvengine.chunks.keys import Namespace
from kvengine.chunks.record import descriptors_for
from kvengine.config import EngineConfig
from kvengine.errors import UnsupportedModelError
from kvengine.facade import KVEngine
from kvengine.types import ChunkView, ModelBinding

from .copy_specs import LoadSpec, SaveSpec
from .layout import BlockIds, GroupKind, PagedLayout, PagedTensor
from .paging import PagedCopier
from .pipeline import LayerPipeline, LoadJob, SaveJob
from .state import BoundaryStates

logger = logging.getLogger("vllm.kvengine")

#: Chunks of the synthetic request: two, so the second starts at a non-zero token (page offsets).
CHECK_CHUNKS = 2
#: vLLM's null block (``BlockPool`` takes block 0 first): never written.
NULL_BLOCK = 0
#: The pattern's modulus and coefficients: ``(37 L + 11 t + 29 h + 3 e + 7) mod 241 - 120`` for tensor ``L``,
#: token ``t``, head ``h`` and element ``e``. 241 is prime and above every coefficient, so swapping any two
#: of those indices (or two tensors) changes the value wherever they differ; |value| <= 120 is exact in
#: float16, bfloat16 and float32.
_MODULUS, _TENSOR, _TOKEN, _HEAD, _ELEMENT, _OFFSET = 241, 37, 11, 29, 3, 7


class SelfCheckError(UnsupportedModelError):
    """The device self-check found the copy path wrong for this platform: the worker refuses to start."""


class SelfCheckOutcome(enum.Enum):
    PASSED = "passed"
    SKIPPED = "skipped"  # too few KV blocks for the synthetic request


@dataclass(frozen=True, slots=True, kw_only=True)
class SelfCheckReport:
    """What one self-check did, and what it cost."""

    outcome: SelfCheckOutcome
    #: page tensors (layers, one per shared cache) and recurrent-state tensors checked
    page_tensors: int = 0
    state_tensors: int = 0
    #: the lower tiers' codecs whose round trip was checked (raw is the identity and is not listed)
    codecs: tuple[str, ...] = ()
    #: bytes of the chunks stored and loaded
    chunk_bytes: int = 0
    seconds: float = 0.0
    #: SKIPPED: why
    reason: str = ""


@dataclass(frozen=True, slots=True)
class _Blocks:
    """The synthetic request's block ids per group: where the pattern is written, and where it is loaded."""

    source: BlockIds
    target: BlockIds
    used: int  # highest block id used + 1


def _plan_blocks(layout: PagedLayout, num_blocks: int) -> _Blocks | None:
    """Disjoint block ids per group for the source and target of the synthetic request (None: too few)."""
    tokens = CHECK_CHUNKS * layout.chunk.chunk_size
    counts = {g.group_id: (1 if g.kind is GroupKind.STATE else tokens // g.block_size) for g in layout.groups}
    groups = max(counts) + 1
    next_id = NULL_BLOCK + 1
    source: list[tuple[int, ...]] = [()] * groups
    target: list[tuple[int, ...]] = [()] * groups
    for ids in (source, target):
        for g, n in counts.items():
            ids[g] = tuple(range(next_id, next_id + n))
            next_id += n
    if next_id > num_blocks:
        return None
    # the target in reverse: non-consecutive ids take the copier's index path (the source takes slices)
    return _Blocks(tuple(source), tuple(tuple(reversed(ids)) for ids in target), next_id)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its item size: compared, they compare bytes (NaN and -0 included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first element whose bytes differ (None: equal)."""
    differs = _bits(got) != _bits(want.to(got.device))
    if not bool(differs.any()):
        return None
    return tuple(int(i) for i in differs.nonzero()[0])


class _Pages:
    """One paged tensor's pattern and where its pages of the synthetic request lie."""

    def __init__(self, index: int, t: PagedTensor, cache: torch.Tensor, block_size: int, chunk_size: int) -> None:
        self.index, self.t, self.cache = index, t, cache
        self.block_size = block_size
        self.kernel_tokens = block_size // t.kernel_ratio
        pages = CHECK_CHUNKS * chunk_size // self.kernel_tokens
        _, heads, kt, content = cache.shape

        def term(coefficient: int, n: int, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
            return ((np.arange(n, dtype=np.int64) * coefficient + offset) % _MODULUS).astype(np.int16).reshape(shape)

        # Built in numpy (each term reduced first: the sum of three stays below 2**15), off torch's thread
        # pool, which a start-up shared with other threads can stall.
        code = (term(_TOKEN, pages * kt, (pages, 1, kt, 1), _TENSOR * index + _OFFSET)
                + term(_HEAD, heads, (1, heads, 1, 1))) + term(_ELEMENT, content, (1, 1, 1, content))
        code %= _MODULUS
        code -= _MODULUS // 2
        #: the pattern, one page per kernel page of the request, in token order
        self.pattern = torch.from_numpy(code).to(device=cache.device, dtype=cache.dtype)

    def page_ids(self, block_ids: BlockIds) -> torch.Tensor:
        """The cache pages of the request's tokens, in token order (an oracle apart from :mod:`.paging`)."""
        blocks = block_ids[self.t.group_id]
        ids = [blocks[pos // self.block_size] * self.t.kernel_ratio + (pos % self.block_size) // self.kernel_tokens
               for pos in range(0, self.pattern.shape[0] * self.kernel_tokens, self.kernel_tokens)]
        return torch.tensor(ids, dtype=torch.long, device=self.cache.device)

    def span(self, block_ids: BlockIds) -> slice:
        """The cache pages of the blocks in ``block_ids`` of this tensor's group (consecutive ids, any order)."""
        blocks = block_ids[self.t.group_id]
        return slice(min(blocks) * self.t.kernel_ratio, (max(blocks) + 1) * self.t.kernel_ratio)

    def where(self, page: int, token: int, block_ids: BlockIds) -> str:
        """Page ``page``'s token ``token`` of the request, said as block, token and position."""
        pos = page * self.kernel_tokens + token
        block = block_ids[self.t.group_id][pos // self.block_size]
        return f"block {block}, token {pos % self.block_size} of the block (position {pos} of the request)"


def run_self_check(layout: PagedLayout, kv_caches: Mapping[str, torch.Tensor], copier: PagedCopier,
                   forward_order: Sequence[int], *, num_blocks: int, codecs: Sequence[Codec] = ()) -> SelfCheckReport:
    """Round-trip known pages through ``copier`` and a private engine, compare byte for byte (module docs).

    ``kv_caches`` are vLLM's registered tensors (the pattern is written and compared through them),
    ``copier`` the worker's copier over them, ``forward_order`` the worker's stage order, ``codecs`` the
    codecs the worker's lower tiers write with.

    :raises SelfCheckError: naming the layer, the layout and the first differing offset.
    """
    started = time.perf_counter()
    blocks = _plan_blocks(layout, num_blocks)
    if blocks is None:
        reason = (f"vLLM allocated {num_blocks} KV blocks, fewer than the synthetic request of "
                  f"{CHECK_CHUNKS} chunks needs")
        logger.warning("kvengine: device self-check skipped: %s", reason)
        return SelfCheckReport(outcome=SelfCheckOutcome.SKIPPED, reason=reason)
    sizes = {g.group_id: g.block_size for g in layout.groups}
    pages = [_Pages(i, t, kv_caches[t.layer], sizes[t.group_id], layout.chunk.chunk_size)
             for i, t in enumerate(layout.tensors)]
    checked = tuple(c for c in codecs if c.codec_id != 0)
    engine = KVEngine(_private_config(layout), transports=[])
    pipeline: LayerPipeline | None = None
    try:
        pipeline = LayerPipeline(copier, forward_order)
        for p in pages:  # the source ids are consecutive and ascending: the pattern is their pages in order
            p.cache[p.span(blocks.source)] = p.pattern
        binding = engine.bind(Namespace(model="kvengine-device-self-check", layout_id=layout.layout_id),
                              layout.chunk)
        tokens = np.arange(CHECK_CHUNKS * layout.chunk.chunk_size, dtype="<u4")
        _save(engine, binding, pipeline, copier, forward_order, tokens, blocks, layout)
        _load(engine, binding, pipeline, forward_order, tokens, blocks, layout, pages, checked)
        states = _check_states(engine, binding, layout, kv_caches, tokens, blocks)
    finally:
        if pipeline is not None:
            pipeline.close()
        engine.close(flush=False)
        for p in pages:
            p.cache[p.span(blocks.source)] = 0
            p.cache[p.span(blocks.target)] = 0
        for s in layout.states:
            cache = kv_caches[s.layer]
            for ids in (blocks.source, blocks.target):
                cache[list(ids[s.group_id])] = 0
    report = SelfCheckReport(outcome=SelfCheckOutcome.PASSED, page_tensors=len(pages), state_tensors=states,
                             codecs=tuple(c.name for c in checked),
                             chunk_bytes=CHECK_CHUNKS * layout.chunk.nbytes(), seconds=time.perf_counter() - started)
    logger.info("kvengine: device self-check passed in %.1f ms: %d page tensors and %d state tensors of layout %s, "
                "%d chunks (%.1f KiB) stored and loaded, codecs %s", report.seconds * 1000, report.page_tensors,
                report.state_tensors, layout.layout_id, CHECK_CHUNKS, report.chunk_bytes / 1024,
                ", ".join(report.codecs) or "raw")
    return report


def _private_config(layout: PagedLayout) -> EngineConfig:
    """A memory-only engine just large enough for the synthetic request (and its recurrent states)."""
    slab = -(-max(layout.chunk.nbytes(), sum(s.nbytes for s in layout.states), 1024) // 4096) * 4096
    return EngineConfig.model_validate({"chunk_size": layout.chunk.chunk_size,
                                        "memory": {"capacity_bytes": slab * (CHECK_CHUNKS + 1), "slab_bytes": slab}})


def _failed(layout: PagedLayout, layer: str, what: str) -> SelfCheckError:
    return SelfCheckError(f"kvengine vLLM connector: device self-check failed for layer {layer!r} (layout "
                          f"{layout.layout_id}): {what}; the copy path between vLLM's KV cache and kvengine is "
                          "wrong on this platform, refusing to start (see docs/vllm.md, 'Device self-check')")


def _save(engine: KVEngine, binding: ModelBinding, pipeline: LayerPipeline, copier: PagedCopier,
          forward_order: Sequence[int], tokens: np.ndarray, blocks: _Blocks, layout: PagedLayout) -> None:
    """Store the source blocks' chunks through the pipeline's save stages, as ``save_kv_layer`` does."""
    staged = engine.begin_store(binding, tokens)
    usable = copier.usable_chunks([v.token_range for v in staged.chunks], blocks.source, NULL_BLOCK)
    spec = SaveSpec(request_id="self-check", salt="", tokens=tokens.tobytes(), block_ids=blocks.source)
    pipeline.begin_saves([SaveJob(spec, staged, NULL_BLOCK, usable)])
    for stage in forward_order:  # as the forward finishes each layer
        pipeline.save_layer(stage)
    (job,), _ = pipeline.end_saves()
    stored = engine.commit_store(job.staged, job.filled).stored_chunks
    if stored != CHECK_CHUNKS:
        raise _failed(layout, layout.tensors[0].layer, f"{stored} of {CHECK_CHUNKS} chunks were stored (a save "
                                                       "copy failed: see the warning before)")


def _load(engine: KVEngine, binding: ModelBinding, pipeline: LayerPipeline, forward_order: Sequence[int],
          tokens: np.ndarray, blocks: _Blocks, layout: PagedLayout, pages: Sequence[_Pages],
          codecs: Sequence[Codec]) -> None:
    """Check the stored chunks (and their codec round trips), load them into the target blocks, check those."""
    res = engine.lookup(binding, "self-check", tokens)
    loaded = 0
    try:
        views = engine.begin_load(res)
        if len(views) != CHECK_CHUNKS:
            raise _failed(layout, layout.tensors[0].layer, f"{len(views)} of {CHECK_CHUNKS} stored chunks were found")
        for view in views:
            for p in pages:
                per_chunk = p.t.pages
                want = p.pattern[view.index * per_chunk:(view.index + 1) * per_chunk]
                if (at := _first_difference(view.tensors[p.index], want)) is not None:
                    page, head, token, element = at
                    raise _failed(layout, p.t.layer, f"the stored chunk {view.index} differs from the pages of "
                                  f"{p.where(view.index * per_chunk + page, token, blocks.source)}, head {head}, "
                                  f"element {element}")
            for codec in codecs:
                _check_codec(codec, view, layout, pages, blocks)
        spec = LoadSpec(request_id="self-check", salt="", start=0, end=res.tokens, block_ids=blocks.target,
                        asynchronous=False)
        pipeline.begin_loads([LoadJob(spec, res, views, NULL_BLOCK)])
        for stage in forward_order:  # as the forward reaches each layer
            pipeline.wait_layer(stage)
        (job,) = pipeline.end_loads()
        loaded = job.loaded
    finally:
        engine.finish_load(res, loaded)
    if loaded != CHECK_CHUNKS:
        raise _failed(layout, layout.tensors[0].layer, f"{loaded} of {CHECK_CHUNKS} chunks were loaded (a load "
                                                       "copy failed: see the warning before)")
    for p in pages:
        if (at := _first_difference(p.cache.index_select(0, p.page_ids(blocks.target)), p.pattern)) is not None:
            page, head, token, element = at
            raise _failed(layout, p.t.layer, f"the loaded pages differ from the stored ones at "
                                             f"{p.where(page, token, blocks.target)}, head {head}, element {element}")


def _check_codec(codec: Codec, view: ChunkView, layout: PagedLayout, pages: Sequence[_Pages],
                 blocks: _Blocks) -> None:
    """``codec`` (a lower tier's) must give back a chunk's bytes exactly. The connector refuses lossy codecs at
    start-up (``options.py``); one reaching here is refused too, never skipped."""
    raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in view.tensors)
    descriptors = descriptors_for(layout.chunk, view.token_range[1] - view.token_range[0])
    if not codec.lossless:
        raise _failed(layout, layout.tensors[0].layer, f"codec {codec.name} is lossy: the connector serves exact "
                                                       "KV only")
    back = bytes(codec.decode(memoryview(bytes(codec.encode(memoryview(raw), descriptors))), descriptors))
    if back == raw:
        return
    if len(back) != len(raw):
        raise _failed(layout, layout.tensors[0].layer, f"codec {codec.name} decoded a chunk of {len(raw)} B to "
                                                       f"{len(back)} B")
    offset = int(np.flatnonzero(np.frombuffer(back, np.uint8) != np.frombuffer(raw, np.uint8))[0])
    start = 0
    for p, tensor in zip(pages, view.tensors):
        size = tensor.numel() * tensor.element_size()
        if offset < start + size:
            page, head, token, element = np.unravel_index((offset - start) // tensor.element_size(), tensor.shape)
            where = p.where(view.index * p.t.pages + int(page), int(token), blocks.source)
            raise _failed(layout, p.t.layer, f"codec {codec.name} does not give back the stored chunk "
                                             f"{view.index}: first at {where}, head {head}, element {element}")
        start += size
    raise AssertionError("a differing byte beyond the chunk's tensors")


def _check_states(engine: KVEngine, binding: ModelBinding, layout: PagedLayout, kv_caches: Mapping[str, torch.Tensor],
                  tokens: np.ndarray, blocks: _Blocks) -> int:
    """A hybrid model's recurrent state at the first chunk's end: stored from a source block, found,
    installed into a target block, compared; how many state tensors were checked."""
    group = layout.state_group
    if group is None or not layout.states:
        return 0
    states = BoundaryStates(engine, layout, kv_caches)
    src, dst = blocks.source[group.group_id][0], blocks.target[group.group_id][0]
    chunk = layout.chunk.chunk_size
    views = [(s, kv_caches[s.layer][src].view(-1)[: s.nbytes].view(torch.uint8)) for s in layout.states]
    for i, (s, view) in enumerate(views):
        view.copy_((torch.arange(s.nbytes, device=view.device) * _TOKEN + i * _TENSOR + _OFFSET) % _MODULUS)
    if not states.save(binding, tokens[:chunk], src):
        raise _failed(layout, layout.states[0].layer, "the recurrent state was not stored")
    found, state = states.find(binding, tokens[:chunk], chunk)
    if found != chunk or state is None:
        raise _failed(layout, layout.states[0].layer, "the stored recurrent state was not found")
    states.install(state, dst)
    for s, view in views:
        got = kv_caches[s.layer][dst].view(-1)[: s.nbytes].view(torch.uint8)
        if (at := _first_difference(got, view)) is not None:
            raise _failed(layout, s.layer, f"the installed recurrent state of block {dst} differs from block "
                                           f"{src}'s at byte {at[0]}")
    return len(views)


def publish(report: SelfCheckReport, registry: CollectorRegistry) -> None:
    """The check's outcome and cost as gauges, for operators and tests."""
    Gauge("kvengine_vllm_self_check_seconds", "Duration of the device self-check at start",
          registry=registry).set(report.seconds)
    tensors = Gauge("kvengine_vllm_self_check_tensors", "Tensors the device self-check compared", ["kind"],
                    registry=registry)
    tensors.labels(kind="pages").set(report.page_tensors)
    tensors.labels(kind="states").set(report.state_tensors)
    Gauge("kvengine_vllm_self_check_skipped", "1 if the device self-check was skipped (too few KV blocks)",
          registry=registry).set(report.outcome is SelfCheckOutcome.SKIPPED)
