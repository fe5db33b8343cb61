"""The asyncio cache engine.

Primitives (all ``async``; CPU copies run in worker threads, never on the loop):

* :meth:`CacheEngine.bind` – validate a model's namespace and chunk layout.
* :meth:`CacheEngine.lookup` – reserve the longest cached prefix of a request
  (memory first, then lower tiers, promoted into memory and pinned).
* :meth:`CacheEngine.load` – hand the reserved chunks to a sink; report what failed.
* :meth:`CacheEngine.release` – end a reservation without loading.
* :meth:`CacheEngine.store` – copy new full chunks into memory; lower tiers
  are filled write-behind (or write-through) from there.
* :meth:`CacheEngine.reclaim_expired` – end reservations whose lease ran out.

The engine holds lookup, reservations and the copy-in of stores; its parts
do the rest: :class:`~kvengine.core.tier_set.TierSet` (the lower tiers and their
codecs), :class:`~kvengine.core.promotion.Promoter` (lower tiers -> memory,
verified) and :class:`~kvengine.core.tier_writer.TierWriter` (memory -> lower
tiers, per ``write_mode``), over one :class:`~kvengine.core.memory_tier.MemoryTier`.

With ``events.endpoint`` set, the engine publishes KV events for routers
(:mod:`kvengine.events`): it announces each chunk a store or a promotion
brings into memory (:meth:`MemoryTier.announce`, where the prompt's tokens
are in hand) and hands the event on to the tier writer, which republishes it
per lower tier written; the memory tier publishes removals. Off, nothing of
it runs: the publisher is None and no event is built.

Cache faults (corrupt records, dead tiers, no room) become counted misses.
Caller mistakes (bad tokens, tensors that do not match the layout) raise
:class:`InvalidRequestError` and leave the pool as it was. After :meth:`close`
every primitive raises :class:`EngineClosedError` (``close`` itself is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from kvengine.buffers import BufferPool
from kvengine.chunks.codecs import CodecRegistry
from kvengine.chunks.hashing import TokenInput, check_max_tokens, check_token_count, prefix_hashes, token_bytes
from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace
from kvengine.chunks.layout import ChunkLayout
from kvengine.compression import default_codecs
from kvengine.config import EngineConfig, MemoryConfig
from kvengine.core import tails
from kvengine.core.allocator import SlabAllocator
from kvengine.core.copies import copy_all
from kvengine.core.eviction import make_policy
from kvengine.core.memory_tier import HostMemory, MemoryEntry, MemoryTier
from kvengine.core.pins import Pins
from kvengine.core.promotion import Promoter
from kvengine.core.reservations import Reservation, ReservationState, ReservationTable
from kvengine.core.stager import Stager
from kvengine.core.staging import StagedStore
from kvengine.core.tier_set import TierSet, resolve_codec
from kvengine.core.tier_writer import TierWriter
from kvengine.errors import CLOSED_MESSAGE, CapacityError, ConfigError, EngineClosedError, InvalidRequestError
from kvengine.events import MEDIUM_MEMORY, AllBlocksCleared, BlockStored, KVEventPublisher
from kvengine.host.client import ServiceMemory
from kvengine.lookups import LookupResult
from kvengine.metrics import EngineMetrics
from kvengine.tiers import Tier
from kvengine.transport import ChunkTransport, ReadScope, read_scope
from kvengine.trust.quarantine import Quarantine
from kvengine.types import ChunkSink, ChunkSource, ChunkView, LoadResult, ModelBinding, StoreResult

#: A load (begin_load) or staged store (begin_store) still unfinished after this many leases is
#: abandoned: its pins are dropped (counted). Generous: a step's copies take milliseconds, but a
#: CPU prefill of a long prompt can hold a load across a forward of tens of seconds.
ABANDON_AFTER_LEASES = 10

logger = logging.getLogger("kvengine")

#: Idle record buffers kept (at most capacity / 4).
_RECORD_POOL_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class _Question:
    """A lookup not answered by a live reservation: what it asks for, and when."""

    query: tuple[object, ...]  # the reservation's identity for idempotency (cap, first chunk and chunk chain)
    hashes: list[ChunkHash]  # every chunk's, from the first (the chain)
    keys: list[ChunkKey]  # from chunk number ``first`` on
    first: int  # the first chunk asked about (the caller holds every token before it)
    asked: int  # tokens asked about (the cap applied)
    asked_at: float


@dataclass(frozen=True, slots=True)
class _Tail:
    """A tail (:mod:`.tails`) a lookup found, pinned: of chunk number ``chunk``."""

    chunk: int
    pins: Pins  # its entry's pin, until a hit ends with it (moved to the hit's pins)
    entry: MemoryEntry

    @classmethod
    def of(cls, chunk: int, pins: Pins) -> _Tail:
        return cls(chunk, pins, pins[0])


class CacheEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        transports: Sequence[ChunkTransport | Tier] = (),
        codecs: CodecRegistry | None = None,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        if config.log_level is not None:  # kvengine's loggers only; handlers are the application's
            logging.getLogger("kvengine").setLevel(config.log_level.upper())
        self.metrics = metrics or EngineMetrics()
        self.codecs = codecs or default_codecs()
        self.tiers = TierSet(transports, self.codecs, default_codec=config.disk.codec, metrics=self.metrics)
        #: The codec of records this engine serves to peers from memory (see EngineStore).
        self.peer_codec = resolve_codec(self.codecs, config.peers.codec, "peers.codec")
        self._clock = clock
        #: KV events for routers (None: off). Started and closed with the engine.
        self.events = KVEventPublisher.from_config(config.events)
        self.memory = self._memory_tier(config.memory)
        if self.memory.lower_tiers and self.tiers:
            self.memory.close()
            raise ConfigError(f"the kvengine host service on {config.memory.service} owns the lower tiers "
                              f"(kvengine host --config); this engine configures its own too ({self.tiers.describe()}): "
                              "remove them from this engine's configuration")
        self.metrics.watch_memory(self.memory)
        #: Page-aligned record buffers, recycled: records written to tiers, encoded payloads read in place.
        record_buffers = BufferPool(min(_RECORD_POOL_BYTES, int(config.memory.capacity_bytes) // 4))
        self.promoter = Promoter(self.memory, self.tiers, self.codecs, self.metrics, record_buffers)
        self.writer = TierWriter(self.memory, self.tiers, self.metrics, write_mode=config.write_mode,
                                 max_pending=config.max_pending_writes, record_buffers=record_buffers,
                                 events=self.events)
        self.reservations = ReservationTable()
        #: Namespaces whose stored KV failed a provenance check: never served (persisted with the disk tier).
        self.quarantine = Quarantine(config.disk.path)
        self._roots: dict[bytes, str] = {}  # binding digest -> its namespace root (bound in this engine)
        self.metrics.quarantined.set_function(lambda: len(self.quarantine))
        self.stager = Stager(self.memory, self.metrics, hands_on=bool(self.tiers))
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        #: Staged stores not committed yet -> their chunks' events (KV events on only).
        self._staged_events: dict[StagedStore, _StoreEvents] = {}
        self._memory_loaded_bytes = self.metrics.loaded_bytes.labels(tier="memory")
        self._memory_evictions = self.metrics.evictions.labels(tier="memory")

    def _memory_tier(self, config: MemoryConfig) -> HostMemory:
        """An arena of this process, or the host service's (``memory.service``)."""
        if config.service is not None:
            return ServiceMemory(config.service, tenant=config.tenant)
        try:
            allocator = SlabAllocator(int(config.capacity_bytes), config.effective_slab_bytes(),
                                      pin_memory=_cuda_available(), prefault=config.prefault)
        except CapacityError as exc:  # the arena cannot be had on this machine: the setting is what is wrong
            raise ConfigError(f"memory.capacity_bytes: {exc}") from None
        return MemoryTier(allocator, make_policy(config.eviction), on_evict=self._on_evict, events=self.events)

    @property
    def transports(self) -> tuple[ChunkTransport, ...]:
        """The lower tiers' transports, in lookup order."""
        return self.tiers.transports

    @property
    def has_lower_tiers(self) -> bool:
        """Whether a lookup short in memory may find more below it: this engine's tiers, or the host
        service's."""
        return bool(self.tiers) or self.memory.lower_tiers

    # -- lifecycle ---------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called (every primitive then raises :class:`EngineClosedError`)."""
        return self._closed

    def check_open(self) -> None:
        """Raise :class:`EngineClosedError` once :meth:`close` has been called."""
        if self._closed:
            raise EngineClosedError(CLOSED_MESSAGE)

    async def start(self) -> None:
        """Start background tasks (lease reaper, tier writer, KV event publisher) on the running loop."""
        if self.events is not None:
            self.events.start()  # first: it raises ConfigError for an endpoint it cannot open
        self.writer.start()
        self._tasks.append(asyncio.create_task(self._reaper(), name="kvengine-reaper"))
        logger.info("kvengine: started: %s", self.describe())

    def describe(self) -> str:
        """The effective settings in one line (the start-up log line)."""
        cfg = self.config
        metrics = f"{cfg.metrics_host}:{cfg.metrics_port}" if cfg.metrics_port is not None else "off"
        return (f"chunk {cfg.chunk_size} tokens; memory {cfg.memory.capacity_bytes.human_readable()} "
                f"({cfg.memory.eviction}); lower tiers: {self.tiers.describe()}; {cfg.write_mode}; lease {cfg.lease_seconds:g} s; "
                f"shadow checks {'on' if cfg.shadow.enabled else 'off'}; metrics {metrics}; "
                f"KV events {self.events.endpoint if self.events is not None else 'off'}")

    async def flush(self) -> None:
        """Wait until every queued tier write has been attempted."""
        self.check_open()
        await self.writer.flush()

    async def close(self, *, flush: bool = True) -> None:
        """Stop; flush queued tier writes (or drop them, counted) and close transports."""
        if self._closed:
            return
        self._closed = True
        await self.writer.close(flush=flush)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for res in self.reservations.all():
            self._end(res)
        await self.tiers.close()
        self.memory.close()
        if self.events is not None:
            self.events.publish(AllBlocksCleared())
            await asyncio.to_thread(self.events.close)

    # -- binding -------------------------------------------------------------
    def bind(self, namespace: Namespace, layout: ChunkLayout, *, tail_step: int = 0) -> ModelBinding:
        """Validate a model's chunk layout against this engine; raise if it can never work.

        ``tail_step``: store and find tails (:mod:`.tails`) of this many tokens' steps (an inference engine's
        block size); 0: whole chunks only.
        """
        self.check_open()
        if layout.chunk_size != self.config.chunk_size:
            raise InvalidRequestError(
                f"layout chunk_size {layout.chunk_size} differs from the engine's chunk_size "
                f"{self.config.chunk_size}"
            )
        tail_step = check_token_count(tail_step, "tail_step")
        if tail_step and (tail_step >= layout.chunk_size or layout.chunk_size % tail_step):
            raise InvalidRequestError(f"tail_step {tail_step} must be a divisor of chunk_size {layout.chunk_size} "
                                      "smaller than it (or 0: whole chunks only)")
        binding = ModelBinding.create(namespace, layout, tail_step)
        self.memory.admit(binding)
        self.tiers.check_namespace(namespace)
        if not namespace.verified:
            logger.warning(
                "kvengine: model %r bound WITHOUT attach verification (debug override); "
                "its chunks live in a separate namespace and are never served to verified readers",
                namespace.model,
            )
        self._roots[binding.digest] = binding.root
        self.metrics.seed_model(namespace.model)  # its per-model series, at 0 from now on
        self.quarantine.note_binding(namespace, binding.digest)
        if self.is_quarantined(binding):
            logger.error("kvengine: model %r is bound to a QUARANTINED namespace (root %s): nothing is served or "
                         "stored for it until an operator purges it", namespace.model, binding.root)
        return binding

    def is_quarantined(self, binding: ModelBinding) -> bool:
        self.check_open()
        return binding.root in self.quarantine

    def quarantine_namespace(self, binding: ModelBinding, reason: str, **details: str) -> None:
        """Never serve or store ``binding``'s namespace root again (see :mod:`.quarantine`)."""
        self.check_open()
        self.quarantine.add(binding.namespace, reason, details)
        for res in [r for r in self.reservations.all() if self._roots.get(r.namespace) == binding.root]:
            self._end(res)  # what was promised under it (any salt) is withdrawn: loads of it now fail
        self.metrics.reservations_active.set(len(self.reservations))

    # -- lookup ----------------------------------------------------------------
    async def lookup(
        self, binding: ModelBinding, request_id: str, tokens: TokenInput, *, max_tokens: int | None = None,
        reads: ReadScope | None = None, from_token: int = 0,
    ) -> LookupResult:
        """Reserve the longest cached chunk prefix of ``tokens`` (at most ``max_tokens``), and with the binding's
        ``tail_step`` the longest stored tail after it (:mod:`.tails`): a HIT of the tokens it reaches, or a
        MISS, with the reservation behind it that :meth:`load` or :meth:`release` ends.

        Idempotent per ``request_id``: the same question returns the same
        reservation with a renewed lease, pinning and counting nothing again.
        ``reads``: what the caller knows of the reads from lower tiers (their time, a peer holding
        them: :class:`~kvengine.transport.ReadScope`; None: the tiers' own deadlines and placement).
        ``from_token``: the caller holds the KV of every token before it (an inference engine's own prefix
        cache): chunks wholly before it are neither pinned nor read, the reservation starts at the chunk
        holding it (``Reservation.first_token``), and the hit's ``tokens`` still count from token 0.
        """
        self.check_open()
        started = time.perf_counter()
        question = self._question(binding, request_id, tokens, max_tokens, from_token)
        if isinstance(question, Reservation):
            return LookupResult.of(question)
        held = Pins.prefix(self.memory, question.keys)
        sources = {"memory": len(held)}
        promoted: list[MemoryEntry] = []
        tail: _Tail | None = None
        below = len(held) < len(question.keys) and bool(self.transports or self.memory.lower_tiers)
        try:
            with read_scope(reads):  # one deadline for all of this lookup's reads from lower tiers
                if below:
                    got = await self._promote(binding, question.keys[len(held) :], question.first + len(held),
                                              question.asked, sources)
                    promoted += got
                    held.add(got)
                chunk, candidates = self._tail_candidates(binding, question, tokens, len(held))
                tail = self._memory_tail(chunk, candidates)
                if tail is None and candidates and self.has_lower_tiers:
                    tail = await self._promote_tail(binding, chunk, candidates, sources)
                    promoted += [tail.entry] if tail is not None else []
        except BaseException:  # cancelled: nothing stays pinned for a reservation never made
            held.release()
            if tail is not None:
                tail.pins.release()
            raise
        read_bytes = sum(e.nbytes for e in promoted)
        self._end_with(binding, held, tail)
        if promoted and self.memory.publishes_events:
            hashes = question.hashes if tail is None else [*question.hashes[: tail.chunk], tail.entry.key.chunk_hash]
            self.memory.announce(_StoreEvents(binding, hashes, token_bytes(tokens)).pairs(promoted))
        return LookupResult.of(self._reserve(binding, request_id, question, held, started, sources, read_bytes))

    async def _promote(self, binding: ModelBinding, keys: list[ChunkKey], first_chunk: int, total_tokens: int,
                       sources: dict[str, int]) -> Pins:
        """The longest prefix of ``keys`` (chunk ``first_chunk`` on, of a prompt of ``total_tokens``) lower tiers
        hold, read into memory and pinned: this engine's tiers, or the host service's (it promotes, this
        engine pins)."""
        if self.transports:
            return await self.promoter.promote(binding, keys, first_chunk, total_tokens, sources)
        count, nbytes = await asyncio.to_thread(self.memory.promote, binding, keys, first_chunk, total_tokens)
        self.metrics.loaded_bytes.labels(tier="host").inc(nbytes)
        promoted = Pins.prefix(self.memory, keys[:count])
        sources["host"] = sources.get("host", 0) + len(promoted)
        return promoted

    @staticmethod
    def _tail_candidates(binding: ModelBinding, question: _Question, tokens: TokenInput,
                         matched: int) -> tuple[int, list[tuple[int, ChunkKey]]]:
        """The chunk after the ``matched`` chunks from ``question.first``, and its tails a hit may end with,
        longest first (none without a tail step)."""
        chunk = question.first + matched
        return chunk, tails.candidates(binding, tokens, question.hashes, chunk, question.asked)

    def _memory_tail(self, chunk: int, candidates: list[tuple[int, ChunkKey]]) -> _Tail | None:
        """The longest of chunk ``chunk``'s ``candidates`` memory holds, pinned."""
        for _end, key in candidates:
            pins = Pins.of(self.memory, key)
            if pins:
                return _Tail.of(chunk, pins)
        return None

    def _end_with(self, binding: ModelBinding, held: Pins, tail: _Tail | None) -> None:
        """A hit's whole chunks ``held``, then its tail if one was found (counted)."""
        if tail is not None:
            held.add(tail.pins)
            self.metrics.tail_hit_tokens.labels(model=binding.namespace.model).inc(tail.entry.num_tokens)

    async def _promote_tail(self, binding: ModelBinding, chunk: int, candidates: list[tuple[int, ChunkKey]],
                            sources: dict[str, int]) -> _Tail | None:
        """The longest of chunk ``chunk``'s ``candidates`` lower tiers hold, read into memory and pinned.

        This engine's tiers are asked which candidates they hold all at once (a chunk has up to
        ``chunk_size / tail_step - 1`` of them: 15 with 16-token blocks), then only those are read."""
        if self.transports:
            held = await self.promoter.held_below([key for _, key in candidates])
            candidates = [c for c, ok in zip(candidates, held) if ok]
        for end, key in candidates:
            got = await self._promote(binding, [key], chunk, end, sources)
            if got:
                return _Tail.of(chunk, got)
        return None

    def lookup_resident(
        self, binding: ModelBinding, request_id: str, tokens: TokenInput, *, max_tokens: int | None = None,
        from_token: int = 0,
    ) -> LookupResult | None:
        """:meth:`lookup`'s answer where memory alone decides it (every asked chunk resident, or no lower
        tier to ask); None where it does not (call :meth:`lookup`).

        Synchronous and thread-safe (it touches only the memory tier and the
        reservation table, both locked), so a scheduler's channel can answer a
        warm request without a hop to the engine's loop.
        """
        self.check_open()
        started = time.perf_counter()
        question = self._question(binding, request_id, tokens, max_tokens, from_token)
        if isinstance(question, Reservation):
            return LookupResult.of(question)
        held = Pins.prefix(self.memory, question.keys)
        if len(held) < len(question.keys) and self.has_lower_tiers:
            held.release()
            return None
        chunk, candidates = self._tail_candidates(binding, question, tokens, len(held))
        tail = self._memory_tail(chunk, candidates)
        if tail is None and candidates and self.has_lower_tiers:  # a tail below: the engine's loop reads it
            held.release()
            return None
        self._end_with(binding, held, tail)
        return LookupResult.of(self._reserve(binding, request_id, question, held, started, {"memory": len(held)}))

    def _question(self, binding: ModelBinding, request_id: str, tokens: TokenInput,
                  max_tokens: int | None, from_token: int) -> Reservation | _Question:
        """The lookup's chunk keys, or the request's live reservation for the same question (lease renewed)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        from_token = check_token_count(from_token, "from_token")
        max_tokens = check_max_tokens(max_tokens)
        hashes = prefix_hashes(tokens, binding.chunk_size, binding.digest, max_tokens=max_tokens,
                               partial=self.config.store_partial_chunks)
        if self.is_quarantined(binding):
            self.metrics.quarantine_refusals.labels(op="lookup").inc()
            hashes = []
        first = min(from_token // binding.chunk_size, len(hashes))
        query = (max_tokens, first, *hashes)
        now = self._clock()
        renewed, existing = self.reservations.renew(binding.digest, request_id, query,
                                                    now + self.config.lease_seconds)
        if renewed:
            assert existing is not None
            return existing
        if existing is not None:
            self._end(existing)
        asked = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        return _Question(query, hashes, [ChunkKey(binding.digest, h) for h in hashes[first:]], first, asked, now)

    def _reserve(self, binding: ModelBinding, request_id: str, question: _Question, held: Pins,
                 started: float, sources: dict[str, int], read_bytes: int = 0) -> Reservation:
        """The reservation of ``held`` (its pins are the reservation's until it ends)."""
        first_token = question.first * binding.chunk_size
        entries = tuple(held.entries)
        res = Reservation(
            owner=self.reservations,
            request_id=request_id,
            namespace=binding.digest,
            matched_tokens=entries[-1].token_range[1] if entries else 0,
            keys=tuple(e.key for e in entries),
            expires_at=question.asked_at + self.config.lease_seconds,
            query=question.query,
            entries=entries,
            pins=held,
            model=binding.namespace.model,
            first_token=first_token,
            read_bytes=read_bytes,
        )
        replaced = self.reservations.put(res)
        if replaced is not None:  # a concurrent lookup of the same request won the race
            self._end(replaced)
        model = res.model
        self.metrics.lookups.labels(model=model).inc()
        self.metrics.lookup_tokens.labels(model=model).inc(max(0, question.asked - first_token))
        self.metrics.hit_tokens.labels(model=model).inc(res.reserved_tokens)
        self.metrics.reservations_active.set(len(self.reservations))
        self.metrics.lookup_seconds.labels(model=model).observe(time.perf_counter() - started)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kvengine: lookup %s: %d of %d tokens hit, chunks by tier %s", request_id,
                         res.matched_tokens, question.asked, {k: v for k, v in sources.items() if v} or "{}")
        return res

    # -- load / release ------------------------------------------------------------
    async def load(self, found: LookupResult, sink: ChunkSink) -> LoadResult:
        """Give every chunk ``found`` reserved, in order, to ``sink``; its reservation ends.

        Loading stops at the first chunk the sink fails on; that chunk and all
        later ones are reported failed so the caller recomputes them. An
        expired or already ended reservation (or a miss) loads nothing.
        """
        self.check_open()
        res = self._reservation_of(found)
        views = self._begin_load(res)
        loaded = 0
        try:
            if views:
                loaded = await asyncio.to_thread(self._run_sink, views, sink)
        finally:
            result = self._finish_load(res, loaded)  # also where close() ran meanwhile: it reports the load
        return result

    async def begin_load(self, found: LookupResult) -> tuple[ChunkView, ...]:
        """Start a load the caller copies itself (e.g. layer by layer): views of every chunk ``found`` reserved.

        The views stay valid, and the chunks pinned, until :meth:`finish_load`,
        which must follow. Empty when the reservation expired or ended (the
        load then fails whole).
        """
        self.check_open()
        return self._begin_load(self._reservation_of(found))

    def _begin_load(self, res: Reservation) -> tuple[ChunkView, ...]:
        """:meth:`begin_load` of a reservation this engine made."""
        now = self._clock()
        if not self.reservations.begin_load(res, now):
            self.metrics.load_failed_tokens.labels(model=res.model).inc(res.reserved_tokens)
            return ()
        res.expires_at = now + self.config.lease_seconds * ABANDON_AFTER_LEASES
        res.load_started = time.perf_counter()
        return tuple(ChunkView(i, e.key, e.token_range, self.memory.tensors(e), e.layout)
                     for i, e in enumerate(res.entries))

    async def finish_load(self, found: LookupResult, loaded_chunks: int) -> LoadResult:
        """End a load: the first ``loaded_chunks`` chunks reached the caller, the rest failed (recompute).

        Counted once; a reservation that was not loading (its ``begin_load``
        failed, or it was finished before) reports nothing loaded.
        """
        self.check_open()
        return self._finish_load(self._reservation_of(found), loaded_chunks)

    def _finish_load(self, res: Reservation, loaded_chunks: int) -> LoadResult:
        """:meth:`finish_load`, of an engine open or closed."""
        loading = res.state is ReservationState.LOADING
        loaded_chunks = max(0, min(loaded_chunks, res.num_chunks)) if loading else 0
        tokens = res.entries[loaded_chunks - 1].token_range[1] if loaded_chunks else res.load_start
        if loading and self._end(res):
            self.metrics.loaded_tokens.labels(model=res.model).inc(tokens - res.load_start)
            self.metrics.load_failed_tokens.labels(model=res.model).inc(res.matched_tokens - tokens)
            self._memory_loaded_bytes.inc(sum(e.nbytes for e in res.entries[:loaded_chunks]))
            self.metrics.load_seconds.labels(model=res.model).observe(time.perf_counter() - res.load_started)
            logger.debug("kvengine: load %s: %d of %d tokens loaded", res.request_id, tokens, res.matched_tokens)
        return LoadResult(res.matched_tokens, tokens, tuple(range(loaded_chunks, res.num_chunks)))

    def _run_sink(self, views: Sequence[ChunkView], sink: ChunkSink) -> int:
        for view in views:
            try:
                sink(view)
            except Exception as exc:
                self.metrics.log_once(
                    "sink_error", "kvengine: load sink failed on chunk %d (%s: %s); the rest is recomputed",
                    view.index, type(exc).__name__, exc,
                )
                return view.index
        return len(views)

    async def release(self, found: LookupResult) -> None:
        """End ``found``'s reservation without loading (request not scheduled, aborted, finished)."""
        self.release_now(found)

    def release_now(self, found: LookupResult) -> None:
        """:meth:`release`, in the calling thread: synchronous and thread-safe (it touches only the
        reservation table and the memory tier, both locked), so an engine's thread ends a request
        without a hop to the engine's loop."""
        self.check_open()
        self._end(self._reservation_of(found))

    def _reservation_of(self, found: LookupResult) -> Reservation:
        """The reservation behind this engine's answer ``found``. Another engine's pins, or an answer that
        carries none (received from another process, or an integration's own), are refused: loading or ending
        them here would corrupt both engines' memory, or end nothing."""
        res = found.reservation
        if res is None:
            raise InvalidRequestError(f"a {found.outcome.value} lookup result without a reservation (received "
                                      "from another process, or made by an integration): load or release the "
                                      "result the engine's lookup returned")
        if res.owner is not self.reservations:
            raise InvalidRequestError(f"reservation of request {res.request_id!r} was made by another engine; "
                                      "load or release it through the engine that looked it up")
        return res

    def _end(self, res: Reservation) -> bool:
        ended_from = self.reservations.end(res)
        if ended_from is None:
            return False
        self._release_ended(res, ended_from)
        self.metrics.reservations_active.set(len(self.reservations))
        return True

    def _release_ended(self, res: Reservation, ended_from: ReservationState) -> None:
        """Unpin a reservation that just ended (loaded, released, replaced or expired)."""
        if ended_from is ReservationState.RESERVED and res.read_bytes:  # read for a hit never taken
            self.metrics.unused_read_bytes.inc(res.read_bytes)
        if res.pins is not None:
            res.pins.release()

    async def reclaim_expired(self) -> int:
        """End reservations whose lease ran out, loads and staged stores left unfinished for
        ``ABANDON_AFTER_LEASES`` leases; returns how many reservations (all counted in metrics)."""
        self.check_open()
        return self._reclaim_expired()

    def _reclaim_expired(self) -> int:
        """:meth:`reclaim_expired`, for the reaper (which may wake while :meth:`close` runs)."""
        now = self._clock()
        count = 0
        for res, was in self.reservations.end_expired(now):
            self._release_ended(res, was)
            if was is ReservationState.LOADING:  # its finish_load, if it ever comes, reports nothing loaded
                self.metrics.abandoned.labels(op="load").inc()
            else:
                count += 1
        self.metrics.reservations_active.set(len(self.reservations))
        self.stager.reclaim(now)  # staged stores left unfinished: what was never committed is dropped
        if self._staged_events:  # an abandoned staged store commits none of its chunks: nothing to announce
            self._staged_events = {s: e for s, e in self._staged_events.items() if not s.committed}
        if count:
            self.metrics.reservations_reclaimed.inc(count)
            self.metrics.log_once("reclaim", "kvengine: reclaimed reservations never loaded or released "
                                  "within %.1fs (requests not scheduled or aborted?)", self.config.lease_seconds)
        return count

    async def _reaper(self) -> None:
        interval = min(1.0, self.config.lease_seconds / 4)
        ticks = 0
        while True:
            await asyncio.sleep(interval)
            self._reclaim_expired()
            ticks += 1
            if ticks % 10 == 0:  # other processes on the same disk may have quarantined a namespace
                await asyncio.to_thread(self.quarantine.refresh)

    # -- store ------------------------------------------------------------------
    async def store(self, binding: ModelBinding, tokens: TokenInput, source: ChunkSource) -> StoreResult:
        """Copy the chunks of ``tokens`` that are not cached yet into memory.

        ``source`` is called only for chunks that will be stored. Storing stops
        at the first chunk that finds no room (a later chunk is unreachable
        without it), or where ``source`` returns None (it has no more).

        Whatever was copied is committed and reaches the lower tiers in either
        write mode, also when ``source`` raises (the error then reaches the
        caller once the copied chunks are handed on).
        """
        self.check_open()
        with self.metrics.store_seconds.labels(model=binding.namespace.model).time():
            return await self._store(binding, tokens, source)

    def store_resident(self, binding: ModelBinding, tokens: TokenInput, source: ChunkSource) -> StoreResult | None:
        """:meth:`store` where no chunk goes on to a lower tier of this engine (memory is its only tier, or the
        host service's, which hands chunks on itself), in the calling thread; None where chunks would go on
        (call :meth:`store`).

        Blocking (it copies) and thread-safe, as :meth:`store`'s copies already run off the loop in a worker
        thread: a blocking caller's store then costs no hop to the engine's loop and on to a worker thread
        and back (about 270 µs a call, measured: ``docs/benchmarks.md``).
        """
        if self.stager.hands_on:
            return None
        self.check_open()
        with self.metrics.store_seconds.labels(model=binding.namespace.model).time():
            hashes, total, events = self._store_plan(binding, tokens)
            result, _, error = self._copy_in(binding, tokens, hashes, total, source, None, events)
        if error is not None:
            raise error
        return result

    def _store_plan(self, binding: ModelBinding, tokens: TokenInput) -> tuple[list[ChunkHash], int, _StoreEvents | None]:
        """A store's chain hashes, the tokens they cover, and its KV events (None when none are published)."""
        hashes, total = tails.store_hashes(binding, tokens, self.config.store_partial_chunks)
        events = _StoreEvents(binding, hashes, token_bytes(tokens)) if self.memory.publishes_events and hashes else None
        return hashes, total, events

    async def _store(self, binding: ModelBinding, tokens: TokenInput, source: ChunkSource) -> StoreResult:
        """:meth:`store`, unmeasured."""
        hashes, total, events = self._store_plan(binding, tokens)
        if not (self.transports and self.config.write_mode == "write_through"):
            # Write-behind: tier writes start after the copies. Overlapping them was measured to make the
            # data durable ~10% sooner but this call ~35% slower (2 cores, one memory bus), and this
            # call's latency is what a write-behind caller waits for.
            result, held, error = await asyncio.to_thread(self._copy_in, binding, tokens, hashes, total, source,
                                                          None, events)
            if held:
                stored = events.of_all(held.entries) if events is not None else None
                result = replace(result, tier_failures=await self.writer.hand_off(binding, held, stored))
            if error is not None:
                raise error
            return result
        # Write-through: the caller waits for the tiers anyway, so each chunk's writes start as soon as
        # it is copied, overlapping the rest of the copies.
        loop = asyncio.get_running_loop()
        writes: list[asyncio.Future[bool]] = []

        def start_write(pins: Pins, stored: BlockStored | None) -> None:
            writes.append(asyncio.ensure_future(self.writer.write_through(binding, pins, stored)))

        def hand_off(pins: Pins) -> None:
            loop.call_soon_threadsafe(start_write, pins, events.of(pins[0]) if events is not None else None)

        try:
            result, _, error = await asyncio.to_thread(self._copy_in, binding, tokens, hashes, total, source,
                                                       hand_off, events)
        except BaseException:  # cancelled: what was copied is still written before this returns
            if writes:
                await asyncio.wait(writes)
            raise
        # Every start_write ran before this point: the copy thread scheduled them before its result.
        written = await asyncio.gather(*writes)
        if error is not None:
            raise error
        return replace(result, tier_failures=written.count(False))

    async def begin_store(self, binding: ModelBinding, tokens: TokenInput) -> StagedStore:
        """Prepare slots for the chunks of ``tokens`` not cached yet, for the caller to fill.

        Like :meth:`store`, but the caller writes the returned views itself (in
        any order, e.g. layer by layer) and then calls :meth:`commit_store`,
        which must follow. Preparing stops at the first chunk that finds no room.
        """
        self.check_open()
        hashes, total = tails.store_hashes(binding, tokens, self.config.store_partial_chunks)
        staged = self._stage(binding, tokens, hashes, total)
        # pinned until committed: abandoned ones are dropped by the reaper
        self.stager.keep_open(staged, self._clock() + self.config.lease_seconds * ABANDON_AFTER_LEASES)
        if self.memory.publishes_events and staged.entries:  # the tokens, copied: the caller may reuse its buffer
            self._staged_events[staged] = _StoreEvents(binding, hashes, bytes(token_bytes(tokens)))
        return staged

    async def commit_store(self, staged: StagedStore, filled_chunks: int) -> StoreResult:
        """Publish the first ``filled_chunks`` staged chunks (fully written) and drop the rest.

        :raises InvalidRequestError: if ``staged`` was already committed (or abandoned and dropped).
        """
        self.check_open()
        events = self._staged_events.pop(staged, None)
        result, held = self.stager.commit(staged, filled_chunks)
        if events is not None:
            self.memory.announce(events.pairs(staged.entries[: result.stored_chunks]))
        if held:
            stored = events.of_all(held.entries) if events is not None else None
            result = replace(result, tier_failures=await self.writer.hand_off(staged.binding, held, stored))
        return result

    def _copy_in(
        self, binding: ModelBinding, tokens: TokenInput, hashes: list, total: int, source: ChunkSource,
        hand_off: Callable[[Pins], object] | None = None, events: _StoreEvents | None = None,
    ) -> tuple[StoreResult, Pins, BaseException | None]:
        """Copy new chunks into memory (blocking): the result, the new entries' pins (for the lower
        tiers), and what ``source`` raised, if it did (the chunks copied before it are committed all the
        same). With ``hand_off``, each chunk is handed on as soon as it is copied (see :meth:`Stager.fill`).
        With ``events``, the committed chunks are announced."""
        staged = self._stage(binding, tokens, hashes, total)
        filled, error = self.stager.fill(staged, partial(_copy_chunk, binding.layout, source), hand_off)
        result, held = self.stager.commit(staged, filled)
        if events is not None:
            self.memory.announce(events.pairs(staged.entries[: result.stored_chunks]))
        return result, held, error

    def _stage(self, binding: ModelBinding, tokens: TokenInput, hashes: list, total: int) -> StagedStore:
        """Slots for the new chunks (``hashes``) of the first ``total`` of ``tokens`` (none for a quarantined
        namespace), with the tails each supersedes."""
        if self.is_quarantined(binding):  # nothing more is added to KV that failed a provenance check
            self.metrics.quarantine_refusals.labels(op="store").inc()
            return StagedStore(binding, (), 0, len(hashes), ())
        size = binding.chunk_size
        keys = [ChunkKey(binding.digest, h) for h in hashes]
        staged = self.stager.prepare(binding, keys, [(i * size, min((i + 1) * size, total)) for i in range(len(keys))])
        if binding.tail_step and staged.chunks:
            staged.supersedes = tails.superseded(binding, tokens, hashes, staged.chunks)
        return staged

    def holds(self, key: ChunkKey) -> bool:
        """Whether the memory tier holds ``key`` now (a later read may still miss: it can be evicted).

        Answered after :meth:`close` too (False: memory is empty then), as is :meth:`resident_record`:
        they serve other engines (a peer server), whose requests may arrive while this one shuts down."""
        return self.memory.contains(key)

    def resident_record(self, binding: ModelBinding, key: ChunkKey) -> bytes | None:
        """The record of chunk ``key`` of ``binding`` if memory holds it, encoded as this engine sends
        records to peers (:attr:`peer_codec`); None otherwise. Blocking: run it in a worker thread."""
        with Pins.of(self.memory, key) as pins:
            if not pins:
                return None
            header, payload = self.writer.record_parts(binding, pins[0], self.peer_codec)
            return b"".join((header, payload))  # one copy

    def _on_evict(self, entry: MemoryEntry) -> None:
        self._memory_evictions.inc()


class _StoreEvents:
    """The memory tier's BlockStored events of one prompt's chunks (KV events on), each built on first use.

    An event needs the prompt (its chunk hashes, its token ids), which only a store or lookup has in hand;
    a memory entry keeps neither, so this lives only as long as that call.
    """

    __slots__ = ("_binding", "_hashes", "_tokens", "_built")

    def __init__(self, binding: ModelBinding, hashes: Sequence[ChunkHash], tokens: bytes | memoryview) -> None:
        self._binding, self._hashes, self._tokens = binding, hashes, tokens  # tokens: uint32 LE bytes
        self._built: dict[MemoryEntry, BlockStored] = {}

    def of(self, entry: MemoryEntry) -> BlockStored:
        """The event of ``entry``, a chunk of this prompt: its hash, its parent's (the chunk before), its tokens."""
        event = self._built.get(entry)
        if event is None:
            start, end = entry.token_range
            size = self._binding.chunk_size
            i = start // size
            event = self._built[entry] = BlockStored(
                (self._hashes[i],), self._hashes[i - 1] if i else None, bytes(self._tokens[4 * start : 4 * end]),
                size, MEDIUM_MEMORY, self._binding.namespace.adapter_id or None)
        return event

    def of_all(self, entries: Sequence[MemoryEntry]) -> list[BlockStored]:
        return [self.of(entry) for entry in entries]

    def pairs(self, entries: Sequence[MemoryEntry]) -> list[tuple[MemoryEntry, BlockStored]]:
        return [(entry, self.of(entry)) for entry in entries]


def _copy_chunk(layout: ChunkLayout, source: ChunkSource, view: ChunkView) -> bool:
    """Copy one chunk from ``source`` into its slot; False once the source has no more."""
    tensors = source(view.index, *view.token_range)
    if tensors is None:
        return False
    layout.check(tensors, view.token_range[1] - view.token_range[0])
    copy_all(view.tensors, tensors)
    return True


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


__all__ = ["CacheEngine"]
