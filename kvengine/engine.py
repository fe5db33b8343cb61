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

Cache faults (corrupt records, dead tiers, no room) become counted misses.
Caller mistakes (bad tokens, tensors that do not match the layout) raise
:class:`InvalidRequestError` and leave the pool as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar, cast

import numpy as np
import torch

from .allocator import SlabAllocator
from .buffers import BufferPool
from .codecs import Codec, CodecRegistry, RawCodec
from .compression import codec_family, default_codecs
from .config import EngineConfig
from .copies import copy_all
from .errors import ConfigError, IntegrityError, InvalidRequestError
from .eviction import make_policy
from .hashing import TokenInput, prefix_hashes
from .keys import ChunkKey, Namespace
from .layout import ChunkLayout
from .memory_tier import MemoryEntry, MemoryTier, Prepared
from .metrics import EngineMetrics, TierStatsCollector
from .quarantine import Quarantine
from .record import RecordFlag, RecordHeader, descriptors_for, encode_header, unpack_record
from .reservations import Reservation, ReservationState, ReservationTable
from .staging import StagedStore
from .tiers import Tier
from .transport import Buffer, ChunkTransport, ReadsInPlace, read_scope, reads_in_place, writes_gathered
from .types import ChunkSink, ChunkSource, ChunkView, LoadResult, ModelBinding, StoreResult

T_ = TypeVar("T_")

#: A load (begin_load) or staged store (begin_store) still unfinished after this many leases is
#: abandoned: its pins are dropped (counted). Generous: a step's copies take milliseconds, but a
#: CPU prefill of a long prompt can hold a load across a forward of tens of seconds.
ABANDON_AFTER_LEASES = 10

logger = logging.getLogger("kvengine")

#: Tier writes in flight at once (each encoded just before its put; at most this many record buffers).
_WRITES_IN_FLIGHT = 8
#: Promotion reads this many records at a time, the next window while admitting this one.
_READ_WINDOW = 4
#: Promotion through a transport with placed reads keeps this many reads in flight, each
#: straight into its memory slot (no read buffers), admitted in order as they complete.
_READ_AHEAD = 8
#: Longest a placed read waits for the previous record's placement (its header read), so that
#: slots are taken in prompt order; past it, it goes ahead (order only matters when memory is short).
_PLACE_WAIT_S = 2.0
#: Idle record buffers kept for tier writes (at most capacity / 4).
_RECORD_POOL_BYTES = 256 * 2**20


class AdmitRejected(enum.Enum):
    """Why a lower-tier record was not admitted into memory."""

    CORRUPT = "corrupt"  # a lower-tier record failed verification; delete it
    NO_ROOM = "no_room"  # a verified record found no room in memory; keep it


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
        self.metrics = metrics or EngineMetrics()
        self.codecs = codecs or default_codecs()
        #: (transport, codec) per lower tier; a bare transport writes with disk.codec.
        self._tiers = tuple(self._tier_codec(t, config) for t in transports)
        self.transports = tuple(t for t, _ in self._tiers)
        if self.transports:
            self.metrics.registry.register(TierStatsCollector(self.transports))
        families = {codec_family(c) for _, c in self._tiers}
        if len(families) > 1:
            # One namespace is served by every tier, so the tiers must decode to the same KV.
            raise ConfigError(
                "the lower tiers' codecs decode to different KV (families "
                f"{sorted(families)}); use one lossy codec everywhere or lossless codecs only"
            )
        self._lower_family = families.pop() if families else None
        #: The codec of records this engine serves to peers from memory (see EngineStore).
        self.peer_codec = self._codec(config.peers.codec, "peers.codec")
        self._clock = clock
        self._raw_codec = RawCodec()
        #: Page-aligned, already-faulted record buffers for tier writes, recycled (O_DIRECT writes them as is).
        self._record_buffers = BufferPool(min(_RECORD_POOL_BYTES, int(config.memory.capacity_bytes) // 4))
        allocator = SlabAllocator(
            int(config.memory.capacity_bytes),
            config.memory.effective_slab_bytes(),
            pin_memory=_cuda_available(),
            prefault=config.memory.prefault,
        )
        self.memory = MemoryTier(allocator, make_policy(config.memory.eviction), on_evict=self._on_evict)
        self.reservations = ReservationTable()
        #: Namespaces whose stored KV failed a provenance check: never served (persisted with the disk tier).
        self.quarantine = Quarantine(config.disk.path)
        self._roots: dict[bytes, str] = {}  # binding digest -> its namespace root (bound in this engine)
        self.metrics.quarantined.set_function(lambda: len(self.quarantine))
        self._write_queue: asyncio.Queue[tuple[ModelBinding, MemoryEntry]] | None = None
        self._write_slots: asyncio.Semaphore | None = None
        self._writes: set[asyncio.Future[bool]] = set()  # write-behind tier writes in flight
        #: begin_store results not committed yet, to the time after which they count as abandoned
        self._staged: dict[StagedStore, float] = {}
        #: One thread encodes (checksums, compresses) for every tier write: at most one core, whatever
        #: the number of writes in flight, so a store's copies are left a core on small machines.
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="kvengine-encode")
        #: codec -> its tiers, each with whether it takes records as parts (:class:`WritesGathered`)
        self._tiers_by_codec: dict[Codec, list[tuple[ChunkTransport, bool]]] = {}
        for transport, codec in self._tiers:  # each record is encoded once per codec, not once per tier
            self._tiers_by_codec.setdefault(codec, []).append((transport, writes_gathered(transport)))
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._memory_stored_bytes = self.metrics.stored_bytes.labels(tier="memory")
        self._memory_stored_chunks = self.metrics.stored_chunks.labels(tier="memory")
        self._memory_loaded_bytes = self.metrics.loaded_bytes.labels(tier="memory")
        self._memory_evictions = self.metrics.evictions.labels(tier="memory")

    def _tier_codec(self, tier: ChunkTransport | Tier, config: EngineConfig) -> tuple[ChunkTransport, Codec]:
        if isinstance(tier, Tier):
            return tier.transport, self._codec(tier.codec, tier.setting)
        return tier, self._codec(config.disk.codec, "disk.codec")

    def _codec(self, name: str, setting: str) -> Codec:
        try:
            return self.codecs.by_name(name)
        except ValueError as exc:
            raise ConfigError(f"{setting}: {exc}") from None

    # -- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        """Start background tasks (lease reaper, tier writer) on the running loop."""
        self._write_queue = asyncio.Queue(maxsize=self.config.max_pending_writes)
        self._write_slots = asyncio.Semaphore(_WRITES_IN_FLIGHT)
        self._tasks.append(asyncio.create_task(self._reaper(), name="kvengine-reaper"))
        if self.transports:
            self._tasks.append(asyncio.create_task(self._writer(), name="kvengine-writer"))

    async def flush(self) -> None:
        """Wait until every queued tier write has been attempted."""
        if self._write_queue is not None and self.transports:
            await self._write_queue.join()

    async def close(self, *, flush: bool = True) -> None:
        """Stop; flush queued tier writes (or drop them, counted) and close transports."""
        if self._closed:
            return
        self._closed = True
        queue = self._write_queue
        if queue is not None and self.transports:
            if flush:
                await queue.join()
            else:
                while not queue.empty():
                    _, entry = queue.get_nowait()
                    self.memory.unpin([entry])
                    self.metrics.writes_dropped.labels(reason="shutdown").inc()
                    queue.task_done()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._writes:  # never close memory under a write still reading it
            await asyncio.wait(list(self._writes))
        self._encoder.shutdown(wait=False)
        for res in self.reservations.all():
            self._end(res)
        for transport in self.transports:
            await transport.close()
        self.memory.close()

    # -- binding -------------------------------------------------------------
    def bind(self, namespace: Namespace, layout: ChunkLayout) -> ModelBinding:
        """Validate a model's chunk layout against this engine; raise if it can never work."""
        if layout.chunk_size != self.config.chunk_size:
            raise InvalidRequestError(
                f"layout chunk_size {layout.chunk_size} differs from the engine's chunk_size "
                f"{self.config.chunk_size}"
            )
        self.memory.check_fits(layout.nbytes())
        family = self._lower_family
        if family is not None and namespace.codec_family != family:
            # Lower tiers hold what the codec decodes to: a lossy tier must never answer a
            # reader that asked for exact KV, so the namespace has to say what it gets.
            names = sorted({c.name for _, c in self._tiers})
            raise InvalidRequestError(
                f"the lower tiers store chunks with codec {', '.join(names)} (family {family!r}) "
                f"but the namespace asks for codec_family={namespace.codec_family!r}; bind with "
                f"Namespace(..., codec_family={family!r}) or configure lossless tier codecs"
            )
        if not namespace.verified:
            logger.warning(
                "kvengine: model %r bound WITHOUT attach verification (debug override); "
                "its chunks live in a separate namespace and are never served to verified readers",
                namespace.model,
            )
        binding = ModelBinding.create(namespace, layout)
        self._roots[binding.digest] = binding.root
        self.quarantine.note_binding(namespace, binding.digest)
        if self.is_quarantined(binding):
            logger.error("kvengine: model %r is bound to a QUARANTINED namespace (root %s): nothing is served or "
                         "stored for it until an operator purges it", namespace.model, binding.root)
        return binding

    def is_quarantined(self, binding: ModelBinding) -> bool:
        return binding.root in self.quarantine

    def quarantine_namespace(self, binding: ModelBinding, reason: str, **details: str) -> None:
        """Never serve or store ``binding``'s namespace root again (see :mod:`.quarantine`)."""
        self.quarantine.add(binding.namespace, reason, details)
        for res in [r for r in self.reservations.all() if self._roots.get(r.namespace) == binding.root]:
            self._end(res)  # what was promised under it (any salt) is withdrawn: loads of it now fail
        self.metrics.reservations_active.set(len(self.reservations))

    # -- lookup ----------------------------------------------------------------
    async def lookup(
        self, binding: ModelBinding, request_id: str, tokens: TokenInput, *, max_tokens: int | None = None
    ) -> Reservation:
        """Reserve the longest cached chunk prefix of ``tokens`` (at most ``max_tokens``).

        Idempotent per ``request_id``: the same question returns the same
        reservation with a renewed lease, pinning and counting nothing again.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if max_tokens is not None and max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be >= 0, got {max_tokens}")
        hashes = prefix_hashes(tokens, binding.chunk_size, binding.digest, max_tokens=max_tokens,
                               partial=self.config.store_partial_chunks)
        if self.is_quarantined(binding):
            self.metrics.quarantine_refusals.labels(op="lookup").inc()
            hashes = []
        query = (max_tokens, *hashes)
        now = self._clock()
        existing = self.reservations.get(binding.digest, request_id)
        if existing is not None and existing.query == query and existing.state is ReservationState.RESERVED:
            existing.expires_at = now + self.config.lease_seconds
            return existing
        if existing is not None:
            self._end(existing)
        keys = [ChunkKey(binding.digest, h) for h in hashes]
        entries = self.memory.pin_prefix(keys)
        if len(entries) < len(keys) and self.transports:
            with read_scope():  # one deadline for all of this lookup's reads from lower tiers
                entries += await self._promote(binding, keys[len(entries) :], len(entries))
        res = Reservation(
            owner=self.reservations,
            request_id=request_id,
            namespace=binding.digest,
            matched_tokens=entries[-1].token_range[1] if entries else 0,
            keys=tuple(e.key for e in entries),
            expires_at=now + self.config.lease_seconds,
            query=query,
            entries=entries,
        )
        replaced = self.reservations.put(res)
        if replaced is not None:  # a concurrent lookup of the same request won the race
            self._end(replaced)
        self.metrics.lookups.inc()
        self.metrics.lookup_tokens.inc(len(tokens) if max_tokens is None else min(len(tokens), max_tokens))
        self.metrics.hit_tokens.inc(res.matched_tokens)
        self.metrics.reservations_active.set(len(self.reservations))
        return res

    async def _promote(self, binding: ModelBinding, keys: list[ChunkKey], first_chunk: int) -> list[MemoryEntry]:
        """Bring the longest available prefix of ``keys`` from lower tiers into memory, pinned.

        ``keys[0]`` is chunk number ``first_chunk`` of the request; each record
        must cover exactly that chunk's token positions.
        """
        promoted: list[MemoryEntry] = []
        for transport in self.transports:
            want = keys[len(promoted) :]
            if not want:
                break
            present = await self.guarded(transport, "exists", transport.exists(want), [False] * len(want))
            run = next((i for i, ok in enumerate(present) if not ok), len(want))
            if run == 0:
                continue
            if reads_in_place(transport):
                got = await self._promote_placed(binding, transport, want[:run], first_chunk + len(promoted))
                promoted += got
                if len(got) < run:
                    return promoted
                continue
            # A few records at a time, the next window read while this one is admitted: read
            # buffers are recycled (no page faults) and at most 2 windows of records exist at once.
            windows = [want[i : min(i + _READ_WINDOW, run)] for i in range(0, run, _READ_WINDOW)]
            pending: asyncio.Future[list[Buffer | None]] | None = asyncio.ensure_future(transport.get(windows[0]))
            try:
                for k, window in enumerate(windows):
                    assert pending is not None
                    try:
                        blobs = await pending
                    except Exception as exc:  # a tier that fails a read is a miss from there on
                        pending = None
                        self.tier_fault(transport, "get", exc)
                        return promoted
                    pending = asyncio.ensure_future(transport.get(windows[k + 1])) if k + 1 < len(windows) else None
                    for key, blob in zip(window, blobs):
                        if blob is None:
                            return promoted
                        start = (first_chunk + len(promoted)) * binding.chunk_size
                        entry = await asyncio.to_thread(self.admit_record, binding, key, blob, start, transport.name)
                        if entry is AdmitRejected.CORRUPT:
                            await self.guarded(transport, "delete", transport.delete([key]), None)
                        if not isinstance(entry, MemoryEntry):
                            return promoted
                        promoted.append(entry)
                    del blobs  # this window's read buffers go back to the transport's pool
            finally:
                if pending is not None:  # stopped early: let the read in flight finish, drop it
                    with contextlib.suppress(Exception):
                        await pending
        return promoted

    def admit_record(
        self, binding: ModelBinding, key: ChunkKey, blob: object, start: int, tier: str
    ) -> MemoryEntry | AdmitRejected:
        """Verify a record covering tokens from ``start`` and copy it into memory, pinned.

        Or say why not (corrupt records are counted; the caller deletes them).
        Blocking: run it in a worker thread.
        """
        try:
            header, payload = unpack_record(blob, expect_key=key)  # type: ignore[arg-type]
            self._check_promoted(binding, header, start)
        except IntegrityError as exc:
            self.metrics.integrity_failure(exc.reason, f"{tier}: {exc}")
            return AdmitRejected.CORRUPT
        except Exception as exc:
            self.metrics.integrity_failure("decode_error", f"{tier}: {type(exc).__name__}: {exc}")
            return AdmitRejected.CORRUPT
        return self._admit_payload(binding, key, header, payload, tier)

    @staticmethod
    def _check_promoted(binding: ModelBinding, header: RecordHeader, start: int) -> None:
        """Raise IntegrityError unless a (verified) header is the chunk of ``binding`` starting at ``start``."""
        n = header.token_end - header.token_start
        if header.token_start != start or not 0 < n <= binding.chunk_size:
            raise IntegrityError("wrong_position", f"record covers tokens {header.token_start}:"
                                 f"{header.token_end}, expected a chunk starting at {start}")
        if header.tensors != descriptors_for(binding.layout, n):
            raise IntegrityError("layout_mismatch", "record tensors do not match the model's layout")
        if bool(header.flags & RecordFlag.UNVERIFIED) == binding.namespace.verified:
            raise IntegrityError("verification_flag", "record's verification flag differs from the reader's")

    def _admit_payload(
        self, binding: ModelBinding, key: ChunkKey, header: RecordHeader, payload: memoryview, tier: str
    ) -> MemoryEntry | AdmitRejected:
        """Decode a verified record's payload into a new memory entry, pinned (blocking)."""
        try:
            raw = self.codecs.by_id(header.codec_id).decode(payload, header.tensors)
            if len(raw) != header.raw_length:
                raise IntegrityError("codec_length", f"decoded {len(raw)} B, header says {header.raw_length}")
        except IntegrityError as exc:
            self.metrics.integrity_failure(exc.reason, f"{tier}: {exc}")
            return AdmitRejected.CORRUPT
        except Exception as exc:  # a codec library failing on garbage is still a miss
            self.metrics.integrity_failure("decode_error", f"{tier}: {type(exc).__name__}: {exc}")
            return AdmitRejected.CORRUPT
        entry = self.memory.prepare(key, binding.layout, (header.token_start, header.token_end))
        if isinstance(entry, Prepared):
            # Present already (a concurrent promotion) or no room: pin what is there, if anything.
            return self.memory.pin(key) or AdmitRejected.NO_ROOM
        self.memory.raw(entry).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
        self.memory.commit(entry, keep_pin=True)
        self.metrics.loaded_bytes.labels(tier=tier).inc(header.raw_length)
        return entry

    async def _promote_placed(
        self, binding: ModelBinding, transport: ReadsInPlace, keys: list[ChunkKey], first_chunk: int
    ) -> list[MemoryEntry]:
        """The longest prefix of ``keys`` (all present in ``transport``) read straight into memory, pinned.

        For :class:`~kvengine.transport.ReadsInPlace` transports (see also
        :class:`_PlacedRead`): up to ``_READ_AHEAD`` reads in flight, no window
        barrier and no read buffers; each header is checked before a slot is
        taken, the payload checksum is verified once (by the transport, over
        the slot), and records are admitted in order.
        """
        reads: list[_PlacedRead] = []
        for i, key in enumerate(keys):
            reads.append(_PlacedRead(self, binding, key, (first_chunk + i) * binding.chunk_size, transport.name,
                                     reads[-1] if reads else None))
        inflight: deque[tuple[_PlacedRead, asyncio.Future[RecordHeader | None]]] = deque()
        promoted: list[MemoryEntry] = []

        def launch() -> None:
            read = reads[len(promoted) + len(inflight)]
            inflight.append((read, asyncio.ensure_future(transport.get_into(read.key, read.place))))

        try:
            while len(inflight) < min(_READ_AHEAD, len(reads)):
                launch()
            while inflight:
                read, pending = inflight.popleft()
                entry = await self._settle(transport, read, pending)
                if not isinstance(entry, MemoryEntry):
                    break
                promoted.append(entry)
                if len(promoted) + len(inflight) < len(reads):
                    launch()
        finally:
            for read, _ in inflight:
                read.placed.set()
            for read, pending in inflight:  # stopped early: let reads in flight finish, drop their slots
                with contextlib.suppress(Exception):
                    await pending
                read.discard()
        return promoted

    async def promote_placed(self, binding: ModelBinding, transport: ReadsInPlace, key: ChunkKey,
                             start: int) -> MemoryEntry | AdmitRejected | None:
        """One record read straight into a new memory slot, pinned (None: a miss); a corrupt record is
        deleted from ``transport``. Used for keyed chunks."""
        read = _PlacedRead(self, binding, key, start, transport.name, None)
        return await self._settle(transport, read, transport.get_into(key, read.place))

    async def _settle(self, transport: ReadsInPlace, read: _PlacedRead,
                      pending: Awaitable[RecordHeader | None]) -> MemoryEntry | AdmitRejected | None:
        """Wait for a placed read and admit it; a corrupt record is deleted from ``transport``; a read
        that fails is a miss (counted)."""
        try:
            header = await pending
        except Exception as exc:
            read.discard()
            self.tier_fault(transport, "get", exc)
            return None
        except BaseException:
            read.discard()
            raise
        finally:
            read.placed.set()  # also when the transport never asked for a place (a miss)
        entry = await read.admit(header)
        if entry is AdmitRejected.CORRUPT:
            await self.guarded(transport, "delete", transport.delete([read.key]), None)
        return entry

    def tier_fault(self, transport: ChunkTransport, op: str, exc: BaseException) -> None:
        """Count a tier's failed call (a miss or a lost write for the caller, never an exception)."""
        self.metrics.tier_errors.labels(tier=transport.name, op=op).inc()
        self.metrics.log_once(f"tier:{transport.name}:{op}", "kvengine: tier %s failed a %s (%s: %s); served as a "
                              "miss", transport.name, op, type(exc).__name__, exc)

    async def guarded(self, transport: ChunkTransport, op: str, call: Awaitable[T_], default: T_) -> T_:
        """Await a tier call; a failure is counted (:meth:`tier_fault`) and answered with ``default``."""
        try:
            return await call
        except Exception as exc:
            self.tier_fault(transport, op, exc)
            return default

    # -- load / release ------------------------------------------------------------
    async def load(self, res: Reservation, sink: ChunkSink) -> LoadResult:
        """Give every reserved chunk, in order, to ``sink``; the reservation ends.

        Loading stops at the first chunk the sink fails on; that chunk and all
        later ones are reported failed so the caller recomputes them. An
        expired or already ended reservation loads nothing.
        """
        views = await self.begin_load(res)
        loaded = 0
        try:
            if views:
                loaded = await asyncio.to_thread(self._run_sink, views, sink)
        finally:
            result = await self.finish_load(res, loaded)
        return result

    async def begin_load(self, res: Reservation) -> tuple[ChunkView, ...]:
        """Start a load the caller copies itself (e.g. layer by layer): views of every reserved chunk.

        The views stay valid, and the chunks pinned, until :meth:`finish_load`,
        which must follow. Empty when the reservation expired or ended (the
        load then fails whole).
        """
        self._check_owner(res)
        now = self._clock()
        if not self.reservations.begin_load(res, now):
            self.metrics.load_failed_tokens.inc(res.matched_tokens)
            return ()
        res.expires_at = now + self.config.lease_seconds * ABANDON_AFTER_LEASES
        return tuple(ChunkView(i, e.key, e.token_range, self.memory.tensors(e), e.layout)
                     for i, e in enumerate(res.entries))

    async def finish_load(self, res: Reservation, loaded_chunks: int) -> LoadResult:
        """End a load: the first ``loaded_chunks`` chunks reached the caller, the rest failed (recompute).

        Counted once; a reservation that was not loading (its ``begin_load``
        failed, or it was finished before) reports nothing loaded.
        """
        self._check_owner(res)
        loading = res.state is ReservationState.LOADING
        loaded_chunks = max(0, min(loaded_chunks, res.num_chunks)) if loading else 0
        tokens = res.entries[loaded_chunks - 1].token_range[1] if loaded_chunks else 0
        if loading and self._end(res):
            self.metrics.loaded_tokens.inc(tokens)
            self.metrics.load_failed_tokens.inc(res.matched_tokens - tokens)
            self._memory_loaded_bytes.inc(sum(e.nbytes for e in res.entries[:loaded_chunks]))
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

    async def release(self, res: Reservation) -> None:
        """End a reservation without loading (request not scheduled, aborted, finished)."""
        self._check_owner(res)
        self._end(res)

    def _check_owner(self, res: Reservation) -> None:
        """Its pins are another engine's: loading or ending it here would corrupt both engines' memory."""
        if res.owner is not self.reservations:
            raise InvalidRequestError(f"reservation of request {res.request_id!r} was made by another engine; "
                                      "load or release it through the engine that looked it up")

    def _end(self, res: Reservation) -> bool:
        if not self.reservations.end(res):
            return False
        self.memory.unpin(res.entries)
        self.metrics.reservations_active.set(len(self.reservations))
        return True

    async def reclaim_expired(self) -> int:
        """End reservations whose lease ran out, loads and staged stores left unfinished for
        ``ABANDON_AFTER_LEASES`` leases; returns how many reservations (all counted in metrics)."""
        now = self._clock()
        count = 0
        for res in self.reservations.expired(now):
            loading = res.state is ReservationState.LOADING
            if self._end(res):
                if loading:  # its finish_load, if it ever comes, reports nothing loaded: recomputed
                    self.metrics.abandoned.labels(op="load").inc()
                else:
                    count += 1
        for staged, deadline in list(self._staged.items()):
            if deadline < now and not staged.committed:
                self._staged.pop(staged, None)
                self._commit_slots(staged, staged.published)  # what was never committed is dropped
                self.metrics.abandoned.labels(op="store").inc()
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
            await self.reclaim_expired()
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
        hashes = prefix_hashes(tokens, binding.chunk_size, binding.digest, partial=self.config.store_partial_chunks)
        if not (self.transports and self.config.write_mode == "write_through"):
            # Write-behind: tier writes start after the copies. Overlapping them was measured to make the
            # data durable ~10% sooner but this call ~35% slower (2 cores, one memory bus), and this
            # call's latency is what a write-behind caller waits for.
            result, held, error = await asyncio.to_thread(self._copy_in, binding, hashes, len(tokens), source)
            if held:
                result = replace(result, tier_failures=await self.write_lower_tiers(binding, held))
            if error is not None:
                raise error
            return result
        # Write-through: the caller waits for the tiers anyway, so each chunk's writes start as soon as
        # it is copied, overlapping the rest of the copies.
        loop = asyncio.get_running_loop()
        writes: list[asyncio.Future[bool]] = []

        def start_write(entry: MemoryEntry) -> None:
            writes.append(asyncio.ensure_future(self._write_through(binding, entry)))

        def hand_off(entry: MemoryEntry) -> None:
            loop.call_soon_threadsafe(start_write, entry)

        try:
            result, _, error = await asyncio.to_thread(self._copy_in, binding, hashes, len(tokens), source, hand_off)
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
        hashes = prefix_hashes(tokens, binding.chunk_size, binding.digest, partial=self.config.store_partial_chunks)
        staged = self._prepare_slots(binding, hashes, len(tokens))
        if staged.entries:  # pinned until committed: abandoned ones are dropped by the reaper
            self._staged[staged] = self._clock() + self.config.lease_seconds * ABANDON_AFTER_LEASES
        return staged

    async def commit_store(self, staged: StagedStore, filled_chunks: int) -> StoreResult:
        """Publish the first ``filled_chunks`` staged chunks (fully written) and drop the rest.

        :raises InvalidRequestError: if ``staged`` was already committed (or abandoned and dropped).
        """
        self._staged.pop(staged, None)
        result, held = self._commit_slots(staged, filled_chunks)
        if held:
            result = replace(result, tier_failures=await self.write_lower_tiers(staged.binding, held))
        return result

    def _copy_in(
        self, binding: ModelBinding, hashes: list, total: int, source: ChunkSource,
        hand_off: Callable[[MemoryEntry], object] | None = None,
    ) -> tuple[StoreResult, list[MemoryEntry], BaseException | None]:
        """Copy new chunks into memory: the result, the new entries (pinned for the lower tiers), and
        what ``source`` raised, if it did (the chunks copied before it are committed all the same).

        With ``hand_off``, each chunk is committed as soon as it is copied and
        passed (pinned) to ``hand_off`` instead of being returned.
        """
        staged = self._prepare_slots(binding, hashes, total)
        filled = 0
        try:
            for view, entry in zip(staged.chunks, staged.entries):
                tensors = source(view.index, *view.token_range)
                if tensors is None:  # the source has no more: the store ends here
                    break
                binding.layout.check(tensors, view.token_range[1] - view.token_range[0])
                copy_all(view.tensors, tensors)
                filled += 1
                if hand_off is not None:
                    self.memory.commit(entry, keep_pin=True)
                    staged.published = filled
                    hand_off(entry)
        except BaseException as exc:  # raised to the caller once the copied chunks are handed on
            return (*self._commit_slots(staged, filled), exc)
        return (*self._commit_slots(staged, filled), None)

    def _prepare_slots(self, binding: ModelBinding, hashes: list, total: int) -> StagedStore:
        """Slots for the new chunks, pinned for the writer.

        The new entries stay pinned until committed and handed on, so that a
        prompt larger than memory never evicts its own head (which would make
        every later chunk unreachable); the tail that does not fit is rejected instead.
        """
        layout, size = binding.layout, binding.chunk_size
        present = rejected = 0
        entries: list[MemoryEntry] = []
        views: list[ChunkView] = []
        if self.is_quarantined(binding):  # nothing more is added to KV that failed a provenance check
            self.metrics.quarantine_refusals.labels(op="store").inc()
            return StagedStore(binding, (), 0, len(hashes), ())
        for i, h in enumerate(hashes):
            token_range = (i * size, min((i + 1) * size, total))
            key = ChunkKey(binding.digest, h)
            entry = self.memory.prepare(key, layout, token_range)
            if entry is Prepared.PRESENT:
                present += 1
                continue
            if entry is Prepared.NO_ROOM:
                rejected = len(hashes) - i
                self.metrics.store_rejected.labels(reason="no_room").inc(rejected)
                self.metrics.log_once("no_room", "kvengine: no room in memory (pinned or in use); "
                                      "the rest of a store is skipped")
                break
            entries.append(entry)
            views.append(ChunkView(i, key, token_range, self.memory.tensors(entry), layout))
        return StagedStore(binding, tuple(views), present, rejected, tuple(entries))

    def _commit_slots(self, staged: StagedStore, filled: int) -> tuple[StoreResult, list[MemoryEntry]]:
        """Commit the filled prefix (pins kept when lower tiers will take them), abort the rest."""
        if staged.committed:
            raise InvalidRequestError("this staged store was already committed")
        staged.committed = True
        filled = max(staged.published, min(filled, len(staged.entries)))
        held = list(staged.entries[staged.published : filled])  # not handed on yet
        for entry in held:
            self.memory.commit(entry, keep_pin=True)
        for entry in staged.entries[filled:]:
            self.memory.abort(entry)
        self._memory_stored_bytes.inc(sum(e.nbytes for e in staged.entries[:filled]))
        self._memory_stored_chunks.inc(filled)
        unused = len(staged.entries) - filled
        result = StoreResult(filled, staged.present_chunks, staged.rejected_chunks + unused)
        if not self.transports:  # otherwise the pins pass to the tier writer
            self.memory.unpin(held)
            held = []
        return result, held

    # -- lower tiers ------------------------------------------------------------------
    async def write_lower_tiers(self, binding: ModelBinding, entries: list[MemoryEntry]) -> int:
        """Hand committed entries (pinned once each; the pins pass on) to the lower tiers per write_mode.

        ``write_through``: returns once every write ended, with how many entries did not reach every
        tier. ``write_behind``: returns once every entry is queued (0); a full queue makes the caller
        wait for room (backpressure), so nothing acknowledged is ever dropped for lack of it.
        """
        assert self._write_queue is not None and self._write_slots is not None, "engine not started"
        if self.config.write_mode == "write_through":
            written = await asyncio.gather(*(self._write_through(binding, e) for e in entries))
            return written.count(False)
        for i, entry in enumerate(entries):
            if self._write_queue.full():
                self.metrics.write_waits.inc()
                self.metrics.log_once("backpressure", "kvengine: tier writes fall behind; stores wait for them")
            try:
                await self._write_queue.put((binding, entry))
            except BaseException:  # cancelled while waiting: these were never queued
                self.memory.unpin(entries[i:])
                raise
        return 0

    async def _writer(self) -> None:
        """Write queued entries, up to ``_WRITES_IN_FLIGHT`` at once: a record starts as soon as one ends,
        so the devices never wait for the slowest record of a group."""
        assert self._write_queue is not None and self._write_slots is not None
        queue, slots = self._write_queue, self._write_slots

        def done(task: asyncio.Future[bool]) -> None:
            self._writes.discard(task)
            slots.release()
            queue.task_done()
            if not task.cancelled() and task.exception() is not None:  # the chunk stays in memory
                exc = task.exception()
                self.metrics.log_once("writer", "kvengine: tier write failed: %s: %s", type(exc).__name__, exc)

        while True:
            await slots.acquire()  # before taking an entry: a cancelled writer holds none
            try:
                binding, entry = await queue.get()
            except BaseException:
                slots.release()
                raise
            task = asyncio.ensure_future(self._write_entry(binding, entry))
            self._writes.add(task)
            task.add_done_callback(done)

    async def _write_through(self, binding: ModelBinding, entry: MemoryEntry) -> bool:
        assert self._write_slots is not None, "engine not started"
        async with self._write_slots:
            return await self._write_entry(binding, entry)

    async def _write_entry(self, binding: ModelBinding, entry: MemoryEntry) -> bool:
        """Encode a pinned entry once per codec, put it to every tier of that codec; unpin. True if
        every tier took it (a failure is counted, never raised)."""
        complete = True
        try:
            for codec, tiers in self._tiers_by_codec.items():
                joined = not all(gathers for _, gathers in tiers)  # some tier needs whole records
                try:
                    record = await asyncio.get_running_loop().run_in_executor(
                        self._encoder, partial(self._encode, binding, entry, codec, joined=joined))
                except Exception as exc:
                    complete = False
                    self.metrics.writes_dropped.labels(reason="encode_failed").inc(len(tiers))
                    self.metrics.log_once(f"encode:{codec.name}", "kvengine: encoding a record with %s failed "
                                          "(%s: %s)", codec.name, type(exc).__name__, exc)
                    continue
                parts = (record.header, record.payload)
                results = await asyncio.gather(*(
                    t.put_parts([(record.key, parts)]) if gathers  # type: ignore[attr-defined]
                    else t.put([(record.key, cast(Buffer, record.joined))])  # joined: some tier needs it
                    for t, gathers in tiers), return_exceptions=True)  # none still reads the slot
                for (transport, _), result in zip(tiers, results):
                    if isinstance(result, BaseException):  # a transport bug: counted as a failed put
                        self.metrics.log_once(f"put:{transport.name}", "kvengine: %s put raised %s: %s",
                                              transport.name, type(result).__name__, result)
                    elif result[0]:
                        self.metrics.stored_bytes.labels(tier=transport.name).inc(record.nbytes)
                        self.metrics.stored_chunks.labels(tier=transport.name).inc()
                        continue
                    complete = False
                    self.metrics.writes_dropped.labels(reason=f"{transport.name}_failed").inc()
                del record  # its buffers go back to the pool
        finally:
            self.memory.unpin([entry])
        return complete

    def holds(self, key: ChunkKey) -> bool:
        """Whether the memory tier holds ``key`` now (a later read may still miss: it can be evicted)."""
        return self.memory.contains(key)

    def resident_record(self, binding: ModelBinding, key: ChunkKey) -> bytes | None:
        """The record of chunk ``key`` of ``binding`` if memory holds it, encoded as this engine sends
        records to peers (:attr:`peer_codec`); None otherwise. Blocking: run it in a worker thread."""
        entry = self.memory.pin(key)
        if entry is None:
            return None
        try:
            header, payload = self._record_parts(binding, entry, self.peer_codec)
            return b"".join((header, payload))  # one copy
        finally:
            self.memory.unpin([entry])

    def _encode(self, binding: ModelBinding, entry: MemoryEntry, codec: Codec, *, joined: bool) -> _EncodedRecord:
        """A pinned entry's record as header + payload, the payload where it lies for the raw codec (blocking).

        With ``joined``, also the whole record in a recycled page-aligned buffer:
        one copy and no page faults.
        """
        header, payload = self._record_parts(binding, entry, codec)
        body = memoryview(payload).cast("B")
        record = None
        if joined:
            record = self._record_buffers.take(len(header) + body.nbytes)
            record[: len(header)] = header
            record[len(header) :] = body
        return _EncodedRecord(entry.key, header, body, record)

    def _record_parts(
        self, binding: ModelBinding, entry: MemoryEntry, codec: Codec
    ) -> tuple[bytes, bytes | memoryview]:
        """Header and ``codec``-encoded payload of a pinned entry's record (blocking)."""
        raw = memoryview(self.memory.raw(entry).numpy().data)
        tensors = descriptors_for(binding.layout, entry.num_tokens)
        try:
            payload = codec.encode(raw, tensors)
        except InvalidRequestError as exc:  # e.g. NaN/inf under a quantizing codec
            if not codec.lossless:
                raise  # raw bytes would be exact, i.e. not what this lossy namespace promises
            self.metrics.log_once("encode", "kvengine: codec %s refused a chunk (%s); stored raw", codec.name, exc)
            codec, payload = self._raw_codec, raw
        flags = RecordFlag.NONE if binding.namespace.verified else RecordFlag.UNVERIFIED
        header = encode_header(entry.key, entry.token_range, tensors, codec_id=codec.codec_id,
                               raw_length=entry.nbytes, payload=payload, flags=flags)
        return header, payload

    def _on_evict(self, entry: MemoryEntry) -> None:
        self._memory_evictions.inc()


class _PlacedRead:
    """One record of a placed promotion: where its payload goes, and what became of it.

    :meth:`place` runs on the transport's I/O thread once the record's header
    is verified: it checks the header against the request and returns the
    destination, i.e. a new memory slot for a raw payload, a recycled buffer
    for an encoded one (decoded in :meth:`admit`), or None to stop the read.
    Slots are taken in prompt order (each placement waits for the previous
    record's), so when memory runs short it is the tail that goes without.
    :meth:`admit` and :meth:`discard` run on the event loop after the read.
    """

    __slots__ = ("engine", "binding", "key", "start", "tier", "prev", "placed", "entry", "scratch", "outcome")

    def __init__(self, engine: CacheEngine, binding: ModelBinding, key: ChunkKey, start: int, tier: str,
                 prev: _PlacedRead | None) -> None:
        self.engine, self.binding, self.key, self.start, self.tier = engine, binding, key, start, tier
        self.prev = prev
        self.placed = threading.Event()  # set once this record's place is settled (or never asked for)
        self.entry: MemoryEntry | None = None
        self.scratch: memoryview | None = None
        self.outcome: IntegrityError | Prepared | None = None  # why place() declined

    def place(self, header: RecordHeader) -> memoryview | None:
        # Reads are submitted in order to a FIFO pool, so the previous one is running or done.
        if self.prev is not None:
            self.prev.placed.wait(_PLACE_WAIT_S)
            self.prev = None
        try:
            return self._place(header)
        finally:
            self.placed.set()

    def _place(self, header: RecordHeader) -> memoryview | None:
        engine = self.engine
        try:
            engine._check_promoted(self.binding, header, self.start)
            if not isinstance(engine.codecs.by_id(header.codec_id), RawCodec):
                self.scratch = engine._record_buffers.take(header.payload_length)
                return self.scratch
            if header.payload_length != header.raw_length:
                raise IntegrityError("codec_length", f"raw payload {header.payload_length} B, "
                                     f"header says {header.raw_length}")
        except IntegrityError as exc:
            self.outcome = exc
            return None
        entry = engine.memory.prepare(self.key, self.binding.layout, (header.token_start, header.token_end))
        if isinstance(entry, Prepared):
            self.outcome = entry
            return None
        self.entry = entry
        return memoryview(engine.memory.raw(entry).numpy().data)

    async def admit(self, header: RecordHeader | None) -> MemoryEntry | AdmitRejected | None:
        """The pinned entry, or why not (None: a miss, or a corrupt record the transport counted and deleted)."""
        engine = self.engine
        if header is None:
            self.discard()
            if isinstance(self.outcome, IntegrityError):
                engine.metrics.integrity_failure(self.outcome.reason, f"{self.tier}: {self.outcome}")
                return AdmitRejected.CORRUPT
            if isinstance(self.outcome, Prepared):  # present already (a concurrent promotion) or no room
                return engine.memory.pin(self.key) or AdmitRejected.NO_ROOM
            return None
        entry, self.entry = self.entry, None
        if entry is None:  # an encoded payload, read into scratch
            assert self.scratch is not None
            payload, self.scratch = self.scratch[: header.payload_length], None
            return await asyncio.to_thread(engine._admit_payload, self.binding, self.key, header, payload, self.tier)
        engine.memory.commit(entry, keep_pin=True)
        engine.metrics.loaded_bytes.labels(tier=self.tier).inc(header.raw_length)
        return entry

    def discard(self) -> None:
        if self.entry is not None:
            self.engine.memory.abort(self.entry)
            self.entry = None
        self.scratch = None


@dataclass(frozen=True, slots=True)
class _EncodedRecord:
    """A record ready for the tiers: its parts, and the whole record for transports that need one."""

    key: ChunkKey
    header: bytes
    payload: memoryview  # a memory slot (raw codec: no copy) or the codec's output
    joined: memoryview | None

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload.nbytes


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


__all__ = ["AdmitRejected", "CacheEngine"]
