"""Worker half of the connector: owns the cache engine, copies pages in and out.

Lifecycle:

* ``register_kv_caches`` derives the chunk layout (:mod:`.layout`), builds
  the :class:`~kvengine.KVEngine` from the connector options, runs the
  device self-check on vLLM's tensors (:mod:`.self_check`: a difference
  refuses to start), binds the model's namespace and starts the lookup
  service (:mod:`.channel`) that answers the scheduler half. ``handshake`` tells vLLM where it listens.
* Each step: ``load`` (``start_load_kv``) begins the loads of the step's
  reservations and queues their copies layer by layer on the
  :class:`~.pipeline.LayerPipeline`; ``wait_layer`` (``wait_for_layer_load``)
  blocks until the layer about to run is in; ``save_layer``
  (``save_kv_layer``) stages the step's complete chunks in the engine and
  queues the finished layer's copy; ``save`` (``wait_for_save``) waits for
  every copy, ends the loads and commits the staged chunks.
* MLA under tensor parallelism: only rank 0 runs a cache engine; the other
  ranks copy in the chunks rank 0 loads, shared by broadcast (:mod:`.replica`).
* Hybrid models (a recurrent-state group, e.g. Qwen3-Next): lookups are cut
  back to the last chunk boundary whose state is stored, loads install that
  state, and a step that ends on a chunk boundary stores the state it
  materialized (:mod:`.state`).
* Prefill/decode disaggregation (:mod:`.handoff`): a producer stores each
  computed prompt's tail and holds its chunks, and serves its memory tier to
  consumers; a consumer's lookups of handed-off prompts offer the tail too,
  and its loads copy it in after the chunks.
* ``shutdown`` stops the service and closes the engine, flushing queued
  disk writes.

Load faults (an expired or missing reservation, a failing copy) are never
raised: they become block ids for ``get_block_ids_with_load_errors`` (sync
loads) or failed request ids (async loads), and vLLM recomputes them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Info

from kvengine.chunks.keys import Namespace
from kvengine.chunks.layout import ChunkLayout
from kvengine.errors import InvalidRequestError
from kvengine.facade import KVEngine
from kvengine.lookups import MISS, LookupOutcome, LookupResult
from kvengine.metrics import serve_registry
from kvengine.transport import ReadScope
from kvengine.trust.provenance import ShadowSampler, compare_kv, settle, worst
from kvengine.types import ModelBinding

from .acceptance import accept_backends, publish_platform, vllm_platform
from .channel import LookupService
from .copy_specs import HandoffSpec, SaveSpec
from .handoff import VIA_MOONCAKE, HandoffServer, PromptTail, PromptTails, Role
from .layout import Chunking, PagedLayout, shares_one_copy
from .metadata import ChannelAddress, StepMetadata
from .options import ConnectorOptions
from .paging import PagedCopier, blocks_in_range
from .pipeline import LayerPipeline, LoadJob, SaveJob
from .replica import LatentBroadcast
from .self_check import publish as publish_self_check
from .self_check import run_self_check
from .state import BoundaryState, BoundaryStates, state_block

logger = logging.getLogger("vllm.kvengine")

#: seconds between a consumer's asks for a prompt handed off through Mooncake that is not all there yet
STORE_POLL_S = 0.05


def build_engine(options: ConnectorOptions) -> KVEngine:
    """The worker's cache engine, with every tier its configuration names (:func:`kvengine.tiers.build_tiers`)."""
    return KVEngine(options.engine)


@dataclass(frozen=True, slots=True)
class _Taken:
    """A held hit, taken for loading: its chunks (None: a prompt tail alone), and what follows them."""

    hit: LookupResult | None
    state: BoundaryState | None = None
    tail: PromptTail | None = None


@dataclass(frozen=True, slots=True)
class _HeldState:
    """A hybrid model's recurrent state at a held reservation's end (a copy), and the prefix it ends."""

    state: BoundaryState
    binding: ModelBinding
    tokens: np.ndarray


class ReservationDesk:
    """The worker's answers to the scheduler (:class:`~.channel.LookupHandler`), and their reservations.

    Holds, per request id, the reservation its last lookup made in the
    engine, until the worker's load takes it (:meth:`take`) or the scheduler
    releases it. One binding per ``cache_salt``: salted requests never share
    chunks with others. Thread-safe: the service thread answers lookups while
    the worker's main thread loads.
    """

    def __init__(self, engine: KVEngine, namespace: Namespace, layout: ChunkLayout,
                 states: BoundaryStates | None = None, broadcast: LatentBroadcast | None = None,
                 tails: PromptTails | None = None, tail_step: int = 0) -> None:
        self.engine = engine
        self.states = states
        #: prompt tails handed off by producers (:mod:`.handoff`), looked up when the scheduler asks
        self.tails = tails
        #: MLA under tensor parallelism: no hit is offered once sharing with the other ranks broke
        self._broadcast = broadcast
        self._namespace = namespace
        self._layout = layout
        #: hits end at the last whole block stored, not the last whole chunk (:mod:`kvengine.core.tails`)
        self._tail_step = tail_step
        self._bindings: dict[str, ModelBinding] = {"": engine.bind(namespace, layout, tail_step=tail_step)}
        #: None: a hit that is a prompt tail alone (no whole chunk before it)
        self._held: dict[str, LookupResult | None] = {}
        #: hybrid models: the recurrent state at each held reservation's end
        self._held_states: dict[str, _HeldState] = {}
        #: handed-off prompts: the tail after each held reservation's end
        self._held_tails: dict[str, PromptTail] = {}
        #: requests whose hit is shadow-checked instead of loaded, and its tokens (asked again: same answer)
        self._shadowed: dict[str, int] = {}
        self._sampler = ShadowSampler(engine.config.shadow)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def binding(self, salt: str) -> ModelBinding:
        with self._lock:
            binding = self._bindings.get(salt)
        if binding is None:
            binding = self.engine.bind(self._namespace.with_updates(cache_salt=salt), self._layout,
                                       tail_step=self._tail_step)
            with self._lock:
                self._bindings[salt] = binding
        return binding

    def lookup(self, request_id: str, salt: str, tokens: bytes, max_tokens: int,
               producer: str | None = None, computed: int = 0) -> LookupResult:
        """``producer``: a handed-off prompt (:mod:`.handoff`), read from the producer that computed it first,
        its partial last chunk too, up to ``max_tokens``. ``computed``: the tokens vLLM holds already (its
        prefix cache): the chunks wholly before them are neither pinned nor read."""
        with self._lock:
            shadowed = self._shadowed.get(request_id)
        if shadowed is not None:
            return LookupResult(LookupOutcome.SHADOWED, shadowed)
        ids = np.frombuffer(tokens, dtype="<u4")
        binding = self.binding(salt)
        tails = self.tails if producer is not None else None
        start = self._from_token(producer, computed)
        chunk = self._layout.chunk_size
        # A prompt handed off through Mooncake may still be on its way there (the producer's writes follow its
        # step): asked again until all of it is there or fetch_timeout ends. A producer serving its own memory
        # stored the prompt before vLLM finished it: its answer stands at once.
        until = time.monotonic() + tails.fetch_timeout if tails is not None and producer == VIA_MOONCAKE else None
        while True:
            reads = self._handoff_reads(producer, until)
            found = self.engine.lookup(binding, request_id, ids, max_tokens=max_tokens, reads=reads, from_token=start)
            res: LookupResult | None = found
            state = held_tail = None
            whole = found.tokens == max_tokens // chunk * chunk  # the chunks before a tail are all held
            if tails is not None and whole and max_tokens % chunk:
                held_tail = tails.find(binding, ids, max_tokens, reads)
            if self.states is not None and tails is not None and whole and (held_tail is not None or
                                                                            not max_tokens % chunk):
                state = self.states.at(binding, ids, max_tokens, reads)  # a handed-off prompt's, at its end
            if self.states is not None and state is None:
                held_tail = None  # no state at its end: resume at a chunk boundary with one, if any
                if found.loadable:
                    res, state = self._resumable(binding, request_id, ids, found, start)
            matched = held_tail.end if held_tail is not None else res.tokens if res is not None else 0
            if until is None or matched == max_tokens or time.monotonic() + STORE_POLL_S >= until:
                break
            if res is not None:
                self.engine.release(res)
            time.sleep(STORE_POLL_S)
        return self._answer(binding, request_id, res, None if state is None else _HeldState(state, binding, ids),
                            held_tail)

    def _handoff_reads(self, producer: str | None, until: float | None) -> ReadScope | None:
        """How a handed-off prompt is read (None: not one), within what is left until ``until``."""
        if producer is None or self.tails is None:
            return None
        return self.tails.reads(producer, None if until is None else max(until - time.monotonic(), STORE_POLL_S))

    def lookup_now(self, request_id: str, salt: str, tokens: bytes, max_tokens: int,
                   producer: str | None = None, computed: int = 0) -> LookupResult | None:
        """:meth:`lookup` where memory alone answers it, in the calling thread; None: call :meth:`lookup`.

        Hybrid models (recurrent state to find), prompt tails and salts not bound yet always take
        :meth:`lookup`.
        """
        with self._lock:
            shadowed = self._shadowed.get(request_id)
            binding = self._bindings.get(salt)
        if shadowed is not None:
            return LookupResult(LookupOutcome.SHADOWED, shadowed)
        if binding is None or self.states is not None or producer is not None:
            return None
        res = self.engine.lookup_resident(binding, request_id, np.frombuffer(tokens, dtype="<u4"),
                                          max_tokens=max_tokens, from_token=self._from_token(producer, computed))
        return None if res is None else self._answer(binding, request_id, res, None)

    def _from_token(self, producer: str | None, computed: int) -> int:
        """Where a lookup starts: at vLLM's own hit, except for a handed-off prompt (read whole from its
        producer) and MLA pages shared by ranks (the other ranks mirror this one's chunks counted from 0)."""
        return 0 if producer is not None or self._broadcast is not None else computed

    def _answer(self, binding: ModelBinding, request_id: str, res: LookupResult | None,
                state: _HeldState | None, tail: PromptTail | None = None) -> LookupResult:
        """Hold the engine's answer ``res`` (and a handed-off prompt's ``tail`` after it) for the request's
        load (or sample it for a shadow check) and say what it offers."""
        if res is not None and not res.loadable and tail is not None:
            self.engine.release(res)  # a tail alone: no chunk to hold
            res = None
        if (res is None or not res.loadable) and tail is None or \
                (self._broadcast is not None and self._broadcast.broken):
            if res is not None:
                self.engine.release(res)
            with self._lock:
                self._held.pop(request_id, None)
                self._held_states.pop(request_id, None)
                self._held_tails.pop(request_id, None)
            return MISS
        if tail is not None:
            with self._lock:
                self._held[request_id] = res
                self._held_tails[request_id] = tail
                if state is not None:  # a hybrid model's, at the tail's end
                    self._held_states[request_id] = state
            return LookupResult(LookupOutcome.HIT, tail.end)
        assert res is not None
        with self._lock:
            self._held_tails.pop(request_id, None)
            held = self._held.get(request_id)
        # asked again: the engine renewed the same reservation, already counted
        known = held is not None and held.reservation is res.reservation
        if not known and self._sampler.pick(binding):
            self.engine.release(res)
            with self._lock:
                self._held.pop(request_id, None)
                self._held_states.pop(request_id, None)
                self._shadowed[request_id] = res.tokens
            return LookupResult(LookupOutcome.SHADOWED, res.tokens)
        with self._lock:
            self._held[request_id] = res
            if state is not None:
                self._held_states[request_id] = state
        return res

    def _resumable(self, binding: ModelBinding, request_id: str, ids: np.ndarray, res: LookupResult,
                   start: int) -> tuple[LookupResult | None, BoundaryState | None]:
        """Cut a hybrid model's hit back to the last boundary whose recurrent state is stored
        (None: no such boundary, ``res`` released)."""
        assert self.states is not None
        while True:
            n, state = self.states.find(binding, ids, res.tokens)
            if n == res.tokens:
                return res, state
            self.engine.release(res)
            if n == 0:
                return None, None
            res = self.engine.lookup(binding, request_id, ids, max_tokens=n, from_token=start)
            if res.tokens == n:
                return res, state
            # chunks were evicted meanwhile: look again below what is still there

    def release(self, request_id: str) -> None:
        with self._lock:
            res = self._held.pop(request_id, None)
            self._held_states.pop(request_id, None)
            self._held_tails.pop(request_id, None)
            self._shadowed.pop(request_id, None)
        if res is not None:
            self.engine.release(res)

    def take(self, request_id: str, end: int | None = None) -> _Taken | None:
        """The request's hit, now the caller's to load (or None: never made, released, replaced): its
        reservation, a hybrid model's recurrent state at ``end`` (default: the reservation's end), and a
        handed-off prompt's tail.

        Under tensor parallelism vLLM is offered the least hit over the ranks, which may end before this
        rank's: the state at that earlier boundary is looked up then (None if this rank has none there:
        the load fails and every rank recomputes)."""
        with self._lock:
            known = request_id in self._held
            res = self._held.pop(request_id, None)
            held = self._held_states.pop(request_id, None)
            tail = self._held_tails.pop(request_id, None)
        if not known:
            return None
        if tail is not None:
            if end is not None and end != tail.end:
                return _Taken(res)  # only a whole handed-off prompt is loaded
            return _Taken(res, None if held is None else held.state, tail)
        assert res is not None
        if held is None or end is None or end == res.tokens:
            return _Taken(res, None if held is None else held.state)
        assert self.states is not None
        n, state = self.states.find(held.binding, held.tokens, end)
        return _Taken(res, state if n == end else None)

    def release_all(self) -> None:
        with self._lock:
            held, self._held, self._held_states, self._held_tails = list(self._held.values()), {}, {}, {}
        for res in held:
            if res is not None:
                self.engine.release(res)

    def stats(self) -> dict[str, float]:
        m = self.engine.metrics
        return {
            "reservations_held": float(len(self._held)),
            "reservations_active": m.value("kvengine_reservations_active"),
            "pinned_chunks": float(self.engine.pinned_chunks()),
            "hit_tokens": m.value("kvengine_hit_tokens_total"),
            "loaded_tokens": m.value("kvengine_loaded_tokens_total"),
            "load_failed_tokens": m.value("kvengine_load_failed_tokens_total"),
        }


class WorkerSide:
    def __init__(self, *, vllm_config: object, kv_cache_config: object, options: ConnectorOptions,
                 chunking: Chunking, asynchronous: bool, role: Role = Role.BOTH) -> None:
        self._role = role
        self._chunking = chunking
        self._tail_step = chunking.tail_step
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._options = options
        self._plans = chunking.plans
        self._async = asynchronous
        self.engine: KVEngine | None = None
        self.layout: PagedLayout | None = None
        self.desk: ReservationDesk | None = None
        self._copier: PagedCopier | None = None
        self._pipeline: LayerPipeline | None = None
        self._stage_of: dict[str, int] = {}
        #: MLA under tensor parallelism: a rank other than 0 (no engine; copies in what rank 0 shares)
        self._follower = False
        self._stop_metrics: Callable[[], None] | None = None  # a follower's own metrics server
        self._service: LookupService | None = None
        self._error_blocks: set[int] = set()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        #: a producer's prompt tails, holds and server for consumers (:mod:`.handoff`); a consumer's tails
        self._tails: PromptTails | None = None
        self._handoff: HandoffServer | None = None

    # -- start-up -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from .identity import namespace_for
        from .layout import check_kernels, derive_layout, spec_fingerprint

        vc = self._vllm_config
        check_kernels(self._plans, vc.compilation_config.enabled_custom_ops)  # type: ignore[attr-defined]
        kv_layout = getattr(self._kv_cache_config, "kv_cache_layout", None) or vc.cache_config.kv_cache_layout  # type: ignore[attr-defined]
        self.layout = derive_layout(
            self._chunking, kv_caches, _layer_backends(vc, self._plans), str(kv_layout),
            num_blocks=self._kv_cache_config.num_blocks,  # type: ignore[attr-defined]
            fingerprint=spec_fingerprint(self._kv_cache_config),
            conv_state_layout=_conv_state_layout() if self._chunking.state_group is not None else None,
        )
        self._copier = PagedCopier(self.layout, kv_caches)
        self._stage_of = {name: i for name in kv_caches if (i := self.layout.tensor_index(name)) is not None}
        forward_order = list(dict.fromkeys(self._stage_of.values()))  # kv_caches lists layers in forward order
        forward_order += [i for i in range(len(self.layout.tensors)) if i not in forward_order]
        namespace = namespace_for(vc, layout_id=self.layout.layout_id, spec_fingerprint=self.layout.spec_fingerprint,
                                  explicit_fingerprint=self._options.model_fingerprint)
        device = next(iter(kv_caches.values())).device.type
        platform = vllm_platform(self.layout, namespace, device)
        acceptance = accept_backends(self.layout, platform, namespace, self._options.verification)
        broadcast = None
        if shares_one_copy(self._plans, namespace.world_size):
            broadcast = LatentBroadcast.create(namespace.rank, self.layout.chunk)
            self._follower = not broadcast.is_source
        self._pipeline = LayerPipeline(self._copier, forward_order, broadcast)
        options = self._options.for_rank(namespace.rank, namespace.world_size, handoff=self._role is not Role.BOTH)
        num_blocks = self._kv_cache_config.num_blocks  # type: ignore[attr-defined]
        if self._follower:  # its own tensors and local copy path (no tier codecs: it stores nothing)
            check = run_self_check(self.layout, kv_caches, self._copier, forward_order, num_blocks=num_blocks)
            registry = CollectorRegistry(auto_describe=True)
            self._step_metrics(registry)
            publish_self_check(check, registry)
            if options.engine.metrics_port is not None:
                self._stop_metrics = serve_registry(registry, options.engine.metrics_port, options.engine.metrics_host)
            logger.info("kvengine: rank %d of %d loads the MLA chunks rank 0 shares (no cache engine here)",
                        namespace.rank, namespace.world_size)
            return
        self.engine = build_engine(options)
        try:
            # the lower tiers' codecs, as the engine built them (what a load from them decodes with)
            check = run_self_check(self.layout, kv_caches, self._copier, forward_order, num_blocks=num_blocks,
                                   codecs=self.engine.tier_codecs)
            states = BoundaryStates(self.engine, self.layout, kv_caches) if self.layout.states else None
            if self._role is not Role.BOTH:
                self._tails = PromptTails(self.engine, self.layout, self._copier, options.handoff.fetch_timeout,
                                          rank=namespace.rank)
            self.desk = ReservationDesk(self.engine, namespace, self.layout.chunk, states, broadcast, self._tails,
                                        self._tail_step)
            self._metrics()
            publish_platform(self.engine.metrics.registry, platform, namespace, acceptance)
            self._step_metrics(self.engine.metrics.registry)
            if self._role is Role.PRODUCER and options.handoff.listen is not None:  # else through Mooncake
                self._handoff = HandoffServer.start(self.engine, options.handoff, self._m_handoffs)
            publish_self_check(check, self.engine.metrics.registry)
            self._service = LookupService(self.desk)
            self._service.start()
        except BaseException:
            if self._handoff is not None:
                self._handoff.stop()
            self.engine.close(flush=False)
            raise
        logger.info("kvengine: worker cache engine ready (chunk %d tokens, %.1f KiB, %d tensors, layout %s)",
                    self.layout.chunk.chunk_size, self.layout.chunk.nbytes() / 1024, len(self.layout.tensors),
                    self.layout.layout_id)

    def handshake(self) -> ChannelAddress | None:
        if self._service is None:
            return None
        assert self.desk is not None
        return ChannelAddress(self._service.path, self._service.authkey, os.getpid(),
                              namespace=self.desk.binding("").digest.hex(),
                              handoff=self._handoff_address())

    def _handoff_address(self) -> str:
        """Where consumers load this producer's prompts from ("" where this is no producer)."""
        if self._handoff is not None:
            return self._handoff.address
        return VIA_MOONCAKE if self._role is Role.PRODUCER else ""

    def _metrics(self) -> None:
        assert self.engine is not None and self.desk is not None
        r, desk = self.engine.metrics.registry, self.desk
        assert self.layout is not None
        # What vLLM chose at start-up (it varies by model, dtype and platform), for operators and tests.
        Gauge("kvengine_vllm_chunk_tokens", "Tokens per kvengine chunk (chunk_size, resolved)",
              registry=r).set(self.layout.chunk.chunk_size)
        Gauge("kvengine_vllm_tail_step_tokens", "Hits end at a whole multiple of this many tokens past the last "
              "whole chunk (tails; 0: whole chunks only)", registry=r).set(self._tail_step)
        # A KV-aware router hashes prompts as this instance does (docs/kv_events.md): the seed of the chain.
        Info("kvengine_vllm_namespace", "The namespace digest this instance's chunk hashes start from (the "
             "same for every instance of one model, dtype, layout and tensor split)",
             registry=r).info({"digest": desk.binding("").digest.hex()})
        blocks = Gauge("kvengine_vllm_block_tokens", "Block size vLLM chose per KV cache group", ["group", "kind"],
                       registry=r)
        for plan in self.layout.groups:
            blocks.labels(group=str(plan.group_id), kind=plan.kind.value).set(plan.block_size)
        Gauge("kvengine_vllm_reservations_held", "Reservations the worker holds for the scheduler",
              registry=r).set_function(lambda: len(desk))
        Gauge("kvengine_vllm_pinned_chunks", "Pins on memory-tier chunks (reservations and queued writes)",
              registry=r).set_function(self.engine.pinned_chunks)

    def _step_metrics(self, r: CollectorRegistry) -> None:
        """The per-step counters, in the engine's registry (or, on a rank without one, a registry of their own)."""
        self._m_loads = Counter("kvengine_vllm_loads", "Loads into vLLM blocks", ["outcome"], registry=r)
        self._m_error_blocks = Counter("kvengine_vllm_load_error_blocks", "Blocks reported to vLLM for recompute",
                                       registry=r)
        self._m_store_skips = Counter("kvengine_vllm_store_skips", "Stores stopped early", ["reason"], registry=r)
        self._m_layer_waits = Counter("kvengine_vllm_layer_load_waits",
                                      "wait_for_layer_load calls that met a layer being loaded", registry=r)
        self._m_save_stages = Counter("kvengine_vllm_save_stages",
                                      "Layer copies into staged chunks, queued by save_kv_layer (layer) or "
                                      "left for wait_for_save (step_end)", ["via"], registry=r)
        self._m_handoffs = Counter("kvengine_vllm_handoffs",
                                   "Prefill/decode handoffs: prompt tails stored (producer) and loaded (consumer), "
                                   "holds ended by a consumer's fetch or by their lease", ["event"], registry=r)
        self._m_shared_tokens = Counter("kvengine_vllm_shared_load_tokens",
                                        "MLA under tensor parallelism: tokens loaded through rank 0's broadcast "
                                        "(sent by rank 0, copied in by the others)", registry=r)

    # -- per step ----------------------------------------------------------------------------
    def load(self, meta: StepMetadata) -> None:
        """Begin the step's loads; the pipeline copies them in layer by layer."""
        assert self._pipeline is not None
        if self._follower:
            if meta.loads:
                self._pipeline.begin_loads([LoadJob.mirrored(spec, meta.null_block_id) for spec in meta.loads])
            return
        assert self.engine is not None and self.desk is not None
        jobs = []
        for spec in meta.loads:
            taken = self.desk.take(spec.request_id, spec.end)
            if taken is None:
                logger.warning("kvengine: no reservation for %s (lease expired?); it is recomputed", spec.request_id)
                taken = _Taken(None)
            hit = taken.hit
            views = self.engine.begin_load(hit) if hit is not None else ()
            jobs.append(LoadJob(spec, hit, views, meta.null_block_id, taken.state, tail=taken.tail))
        if jobs:
            self._pipeline.begin_loads(jobs)

    def wait_layer(self, layer_name: str) -> None:
        assert self._pipeline is not None
        if self._pipeline.wait_layer(self._stage_of.get(layer_name)):
            self._m_layer_waits.inc()

    def save_layer(self, layer_name: str, meta: StepMetadata) -> None:
        """The forward finished ``layer_name``: queue its copy into the step's staged chunks."""
        assert self._pipeline is not None
        if meta.saves and not self._follower:
            self._begin_saves(meta)
            if self._pipeline.save_layer(self._stage_of.get(layer_name)):
                self._m_save_stages.labels(via="layer").inc()

    def save(self, meta: StepMetadata) -> None:
        """End of the step's forward: finish loads, copy what is left of the saves, commit them."""
        assert self._pipeline is not None
        self._end_loads()
        if self._follower:
            return  # rank 0 stores the one copy
        assert self.engine is not None
        if meta.saves:
            self._begin_saves(meta)
        jobs, late = self._pipeline.end_saves()
        self._m_save_stages.labels(via="step_end").inc(late)
        for job in jobs:
            try:
                self.engine.commit_store(job.staged, job.filled)
            except Exception as exc:  # e.g. the engine is closing: the chunks are simply not cached
                logger.warning("kvengine: store of %s not committed: %s", job.spec.request_id, exc)
        for spec in meta.saves:
            if spec.state_at_end:
                self._save_state(spec, meta.null_block_id)
            if spec.verify is not None:
                self._verify(spec, meta.null_block_id)
        for handoff in meta.handoffs:
            if handoff.state_block is not None:
                self._save_state(handoff, meta.null_block_id)
            self._hand_off(handoff, meta.null_block_id)

    def _hand_off(self, spec: HandoffSpec, null: int) -> None:
        """A producer computed a prompt: store its tail, hold its chunks for the consumer (:mod:`.handoff`)."""
        assert self.desk is not None
        if self._tails is None:
            return
        ids = np.frombuffer(spec.tokens, dtype="<u4")
        binding = self.desk.binding(spec.salt)
        try:
            if self._handoff is not None:
                states = self.desk.states
                self._handoff.share(binding, self._tails.binding(binding),
                                    *(() if states is None else (states.binding(binding),)))
            if len(ids) % self._tails.chunk_size:
                if not self._tails.save(binding, ids, len(ids), spec.block_ids, null):
                    self._m_store_skips.labels(reason="handoff_tail").inc()
                    return
                self._m_handoffs.labels(event="tail_stored").inc()
            if self._handoff is not None:  # through Mooncake, its master keeps the records (no hold here)
                self._handoff.holds.hold(self._tails.last_key(binding, ids, len(ids)), binding, spec.request_id,
                                         ids, len(ids) // self._tails.chunk_size * self._tails.chunk_size)
        except Exception as exc:  # the consumer then computes what it cannot load
            logger.warning("kvengine: handoff of %s not stored: %s: %s", spec.request_id, type(exc).__name__, exc)
            self._m_store_skips.labels(reason="handoff_tail").inc()

    def _verify(self, spec: SaveSpec, null: int) -> None:
        """A shadow check: compare the stored chunks of ``spec.verify`` with the pages this step computed.

        Full-attention and MLA pages only: a sliding-window chunk holds zeros where its writer had already
        dropped blocks, which depends on that writer's steps, and recurrent states are compared as
        the tokens they lead to (vLLM's outputs), not here.
        """
        assert self.engine is not None and self.desk is not None and self._copier is not None
        assert spec.verify is not None and self.layout is not None
        lo, hi = spec.verify
        ids = np.frombuffer(spec.tokens, dtype="<u4")[:hi]
        binding = self.desk.binding(spec.salt)
        res = self.engine.lookup(binding, f"{spec.request_id}#shadow", ids, max_tokens=hi)
        results = []
        try:
            views = self.engine.begin_load(res) if res.loadable else ()
            full = [i for i, t in enumerate(self.layout.tensors) if t.kind.every_block]
            for view in views:
                start = view.token_range[0]
                if start < lo or not self._copier.usable_chunks([view.token_range], spec.block_ids, null):
                    continue
                computed = []
                for i in full:
                    out = torch.empty_like(view.tensors[i])
                    self._copier.gather_into(i, start, spec.block_ids, null, out, end=view.token_range[1])
                    computed.append(out)
                results.append(compare_kv([view.tensors[i] for i in full], computed))
        finally:
            self.engine.release(res)  # nothing was loaded into vLLM: not counted as a load
        verdict = worst(results)
        settle(self.engine, binding, "shadow", verdict,
               "a shadow-checked hit differs from the pages vLLM computed for it",
               request=spec.request_id, tokens=f"{lo}-{hi}")
        if verdict is None:
            self._m_store_skips.labels(reason="shadow_unavailable").inc()
            return
        if verdict.within_tolerance:
            logger.info("kvengine: shadow check of %s tokens %d-%d: %s (max relative error %.3g)", spec.request_id,
                        lo, hi, verdict.outcome, verdict.max_relative_error)

    def _save_state(self, spec: SaveSpec | HandoffSpec, null: int) -> None:
        """Store the recurrent state at the end of ``spec``'s tokens: where this step's computed prefix ends
        (a save), or where it began (a hybrid model's handed-off prompt, in the block its spec names; see
        :mod:`.state`). None stored: a hit resumes at an earlier boundary with a state, or is no hit."""
        assert self.layout is not None and self.desk is not None
        group, states = self.layout.state_group, self.desk.states
        if group is None or states is None:
            return
        ids = np.frombuffer(spec.tokens, dtype="<u4")
        block = spec.state_block if isinstance(spec, HandoffSpec) else state_block(group, spec.block_ids, len(ids), null)
        if block is None:
            self._m_store_skips.labels(reason="no_state").inc()
            return
        try:
            if not states.save(self.desk.binding(spec.salt), ids, block):
                self._m_store_skips.labels(reason="no_state").inc()
        except Exception as exc:
            logger.warning("kvengine: state of %s at %d not stored: %s", spec.request_id, len(ids), exc)
            self._m_store_skips.labels(reason="no_state").inc()

    def _begin_saves(self, meta: StepMetadata) -> None:
        """Stage the step's complete chunks in the engine, once per step."""
        assert self.engine is not None and self.desk is not None and self._pipeline is not None
        assert self._copier is not None
        if self._pipeline.saves_begun:
            return
        jobs = []
        for spec in meta.saves:
            try:
                staged = self.engine.begin_store(self.desk.binding(spec.salt), np.frombuffer(spec.tokens, dtype="<u4"))
            except InvalidRequestError as exc:
                self._m_store_skips.labels(reason="invalid").inc()
                logger.warning("kvengine: store of %s refused: %s", spec.request_id, exc)
                continue
            usable = self._copier.usable_chunks([view.token_range for view in staged.chunks], spec.block_ids,
                                                meta.null_block_id)
            if usable < len(staged.chunks):  # an earlier chunk's pages were freed: later ones are unreachable
                self._m_store_skips.labels(reason="missing_page").inc()
            jobs.append(SaveJob(spec, staged, meta.null_block_id, usable))
        self._pipeline.begin_saves(jobs)

    def _install_state(self, job: LoadJob) -> bool:
        """A hybrid model's recurrent state at the hit's end, into the block vLLM resumes from."""
        group = self.layout.state_group if self.layout is not None else None
        if group is None:
            return True
        block = state_block(group, job.spec.block_ids, job.spec.end, job.null_block_id)
        # A synchronous load would also have to fill the step's current state block (vLLM copies the
        # resume block into it before start_load_kv); a hybrid model's loads are always asynchronous.
        if job.state is None or block is None or not job.spec.asynchronous:
            logger.warning("kvengine: no recurrent state to resume %s at %d; recomputed",
                           job.spec.request_id, job.spec.end)
            return False
        assert self.desk is not None and self.desk.states is not None
        self.desk.states.install(job.state, block)
        return True

    def _end_loads(self) -> None:
        """Wait for the step's load copies, end the reservations, record what must be recomputed."""
        assert self._pipeline is not None
        for job in self._pipeline.end_loads():
            ok = self._finish_load(job)
            self._m_loads.labels(outcome="ok" if ok else "failed").inc()

    def _finish_load(self, job: LoadJob) -> bool:
        assert self.layout is not None
        spec = job.spec
        loaded = spec.start
        if job.hit is not None:
            assert self.engine is not None
            loaded = max(loaded, self.engine.finish_load(job.hit, job.loaded).loaded_tokens)
        elif self._follower:  # every chunk before the job's ``loaded``-th came from rank 0 and is in
            loaded = max(loaded, min(spec.end, job.loaded * self.layout.chunk.chunk_size))
        if self._pipeline is not None and self._pipeline.shares_loads:
            self._m_shared_tokens.inc(loaded - spec.start)
        if job.tail is not None and job.tail_loaded and loaded >= job.tail.start and job.loaded == len(job.views):
            loaded = max(loaded, job.tail.end)
            self._m_handoffs.labels(event="tail_loaded").inc()
        if loaded >= spec.end and not self._install_state(job):
            loaded = spec.start  # the pages without their state are no hit: recompute it all
        if loaded >= spec.end:
            if spec.asynchronous:
                self._finished.add(spec.request_id)
            return True
        if spec.asynchronous:
            self._failed.add(spec.request_id)
            self._finished.add(spec.request_id)
        else:
            sizes = {g.group_id: g.block_size for g in self.layout.groups}
            bad = blocks_in_range(spec.block_ids, sizes, [g.group_id for g in self.layout.groups], loaded,
                                  spec.end, job.null_block_id)
            self._error_blocks |= bad
            self._m_error_blocks.inc(len(bad))
        return False

    def take_load_errors(self) -> set[int]:
        if self._pipeline is not None:
            self._end_loads()  # vLLM may ask before wait_for_save (deferred finalize)
        out, self._error_blocks = self._error_blocks, set()
        return out

    def take_finished(self) -> tuple[set[str], set[str]]:
        if self._pipeline is not None:
            self._end_loads()
        finished, failed = self._finished, self._failed
        self._finished, self._failed = set(), set()
        return finished, failed

    def shutdown(self) -> None:
        if self._pipeline is not None:
            self._end_loads()
            for job in self._pipeline.end_saves()[0]:
                self.engine.commit_store(job.staged, 0)  # type: ignore[union-attr]
            self._pipeline.close()
            self._pipeline = None
        if self._service is not None:
            self._service.close()
            self._service = None
        if self._handoff is not None:
            self._handoff.stop()
            self._handoff = None
        if self.desk is not None:
            self.desk.release_all()
        if self.engine is not None:
            self.engine.close(flush=True)  # queued disk writes are completed
            self.engine = None
            logger.info("kvengine: worker cache engine closed")
        if self._stop_metrics is not None:
            self._stop_metrics()
            self._stop_metrics = None


def _conv_state_layout() -> str:
    """vLLM's conv state layout in this process (its CPU platform picks it per ISA unless set)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


def _layer_backends(vllm_config: object, plans: tuple) -> dict[str, str]:
    """Backend name each cached layer declares (from vLLM's static forward context)."""
    context = vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
    out = {}
    for plan in plans:
        for layer in plan.layer_names:
            module = context.get(layer)
            getter = getattr(module, "get_attn_backend", None)
            out[layer] = getter().get_name() if getter is not None else type(module).__name__
    return out
