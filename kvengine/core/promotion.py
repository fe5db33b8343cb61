"""Promotion: bringing chunks from the lower tiers into memory, verified, in prompt order, pinned.

:meth:`Promoter.promote` serves a lookup: the longest prefix of the asked
chunks that some tier holds, each record verified (integrity, its key, its
token position, the model's layout, the verification flag) before its bytes
are admitted. A record that fails is counted and discarded where it was
read, and the tier's next copy, if it holds several, is tried in its place
(one rule for every path: :meth:`Promoter._discard`); a chunk with no good
copy is a miss. A tier that fails a call is a counted miss
(:class:`TierSet`); nothing here raises for a cache fault. The chunks come
back pinned (:class:`~.pins.Pins`), for the caller's reservation.

Two read paths: windows of whole records (any transport), or, for
:class:`~kvengine.transport.ReadsInPlace` transports, reads straight into
the memory slots (:class:`_PlacedRead`).

Concurrent promotions of one chunk are single-flight (:class:`_InFlight`):
the second waits for the first and pins what it admitted. Without that, the
second would find the first's slot taken but not yet committed and miss, so
two requests sharing a prefix, looked up at once, were told different hit
lengths depending on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import numpy as np

from kvengine.buffers import BufferPool
from kvengine.chunks.codecs import CodecRegistry, RawCodec
from kvengine.chunks.keys import ChunkKey
from kvengine.chunks.record import RecordFlag, RecordHeader, TensorDescriptor, descriptors_for, unpack_record
from kvengine.core.memory_tier import HostMemory, MemoryEntry, Prepared
from kvengine.core.pins import Pins
from kvengine.core.tier_set import TierSet
from kvengine.errors import IntegrityError
from kvengine.metrics import EngineMetrics
from kvengine.transport import Buffer, ChunkTransport, ReadsInPlace, reads_in_place, rejects_copies
from kvengine.types import ModelBinding

_T = TypeVar("_T")

#: Promotion reads this many records at a time, the next window while admitting this one.
_READ_WINDOW = 4
#: Promotion through a transport with placed reads keeps this many reads in flight, each
#: straight into its memory slot (no read buffers), admitted in order as they complete.
_READ_AHEAD = 8


class AdmitRejected(enum.Enum):
    """Why a lower-tier record was not admitted into memory."""

    CORRUPT = "corrupt"  # a lower-tier record failed verification; delete it
    NO_ROOM = "no_room"  # a verified record found no room in memory; keep it


def same_layout(recorded: tuple[TensorDescriptor, ...], expected: tuple[TensorDescriptor, ...]) -> bool:
    """Whether a record's descriptors are the layout's. Records written before format version 3 carry no
    token dims (every ``token_dim`` None): those match on everything else."""
    if recorded == expected:
        return True
    if any(t.token_dim is not None for t in recorded):
        return False
    return recorded == tuple(dataclasses.replace(t, token_dim=None) for t in expected)


def check_position(binding: ModelBinding, header: RecordHeader, start: int, end: int | None = None) -> None:
    """Raise IntegrityError unless a (verified) header is the chunk of ``binding`` starting at ``start``
    (and ending at ``end``, when known): bytes that verify are not usable at another position, in another
    layout, or for another kind of reader."""
    n = header.token_end - header.token_start
    if header.token_start != start or not 0 < n <= binding.chunk_size or end not in (None, header.token_end):
        raise IntegrityError("wrong_position", f"record covers tokens {header.token_start}:"
                             f"{header.token_end}, expected a chunk starting at {start}")
    if not same_layout(header.tensors, descriptors_for(binding.layout, n)):
        raise IntegrityError("layout_mismatch", "record tensors do not match the model's layout")
    if bool(header.flags & RecordFlag.UNVERIFIED) == binding.namespace.verified:
        raise IntegrityError("verification_flag", "record's verification flag differs from the reader's")


class _InFlight:
    """The chunks some promotion is bringing into memory right now, and a future per chunk that is done
    when that promotion has admitted it or given up. Event-loop only.

    No cycle of waits is possible: a promotion holds a claim only while it reads and admits that chunk,
    never while it waits for another promotion's claim, except in the placed path, which claims its
    whole run at once before it waits for anything (so it only ever waits for earlier claims).
    """

    __slots__ = ("_futures",)

    def __init__(self) -> None:
        self._futures: dict[ChunkKey, asyncio.Future[None]] = {}

    def claim(self, key: ChunkKey) -> asyncio.Future[None] | None:
        """None: the caller now promotes ``key`` and must :meth:`settle` it; else the promotion to wait for."""
        other = self._futures.get(key)
        if other is None:
            self._futures[key] = asyncio.get_running_loop().create_future()
        return other

    def settle(self, key: ChunkKey) -> None:
        """The caller's promotion of ``key`` is over (admitted or not); idempotent."""
        future = self._futures.pop(key, None)
        if future is not None and not future.done():
            future.set_result(None)


class Promoter:
    """Reads records from a :class:`TierSet` into the memory tier."""

    def __init__(self, memory: HostMemory, tiers: TierSet, codecs: CodecRegistry, metrics: EngineMetrics,
                 scratch: BufferPool) -> None:
        self.memory = memory
        self.tiers = tiers
        self.codecs = codecs
        self.metrics = metrics
        #: Buffers for encoded payloads read in place (decoded into their slot afterwards).
        self.scratch = scratch
        self._inflight = _InFlight()

    async def promote(self, binding: ModelBinding, keys: list[ChunkKey], first_chunk: int,
                      total_tokens: int, sources: dict[str, int] | None = None) -> Pins:
        """Bring the longest available prefix of ``keys`` from lower tiers into memory, pinned.

        ``keys[0]`` is chunk number ``first_chunk`` of a request of ``total_tokens``
        tokens; each record must cover exactly that chunk's token positions.
        ``sources``, when given, receives the number of chunks each tier delivered.
        """
        promoted = Pins(self.memory)
        try:
            for transport in self.tiers.transports:
                want = keys[len(promoted) :]
                if not want:
                    break
                started, before = time.perf_counter(), len(promoted)
                try:
                    complete = await self._promote_from(binding, transport, want, first_chunk + len(promoted),
                                                        total_tokens, promoted)
                finally:
                    self.metrics.tier_read_seconds.labels(tier=transport.name).observe(time.perf_counter() - started)
                    if sources is not None and len(promoted) > before:
                        sources[transport.name] = sources.get(transport.name, 0) + len(promoted) - before
                if not complete:
                    break
        except BaseException:  # cancelled: the caller never gets these pins
            promoted.release()
            raise
        return promoted

    async def held_below(self, keys: list[ChunkKey]) -> list[bool]:
        """Per key, whether a lower tier says it holds it (probably: a True may still miss on ``get``); one
        ``exists`` per tier for all of them, each asked only for what the tiers above it lack."""
        held = [False] * len(keys)
        for transport in self.tiers.transports:
            rest = [i for i, h in enumerate(held) if not h]
            if not rest:
                break
            present = await self.tiers.guarded(transport, "exists", transport.exists([keys[i] for i in rest]),
                                               [False] * len(rest))
            for i, ok in zip(rest, present):
                held[i] = bool(ok)
        return held

    async def _promote_from(self, binding: ModelBinding, transport: ChunkTransport, want: list[ChunkKey],
                            first_chunk: int, total_tokens: int, promoted: Pins) -> bool:
        """Append to ``promoted`` the longest prefix of ``want`` that ``transport`` holds (pinned); whether the
        next tier may be asked for the rest (False: this one held some of it but failed to deliver)."""
        present = await self.tiers.guarded(transport, "exists", transport.exists(want), [False] * len(want))
        run = next((i for i, ok in enumerate(present) if not ok), len(want))
        if run == 0:
            return True
        if reads_in_place(transport):
            got = await self._promote_placed(binding, transport, want[:run], first_chunk, total_tokens)
            complete = len(got) == run
            promoted.add(got)
            return complete
        # A few records at a time, the next window read while this one is admitted: read
        # buffers are recycled (no page faults) and at most 2 windows of records exist at once.
        windows = [want[i : min(i + _READ_WINDOW, run)] for i in range(0, run, _READ_WINDOW)]
        pending: asyncio.Future[list[Buffer | None]] | None = asyncio.ensure_future(transport.get(windows[0]))
        first = len(promoted)
        try:
            for k, window in enumerate(windows):
                assert pending is not None
                try:
                    blobs = await pending
                except Exception as exc:  # a tier that fails a read is a miss from there on
                    pending = None
                    self.tiers.fault(transport, "get", exc)
                    return False
                pending = asyncio.ensure_future(transport.get(windows[k + 1])) if k + 1 < len(windows) else None
                for key, blob in zip(window, blobs):
                    if blob is None:
                        return False
                    start = (first_chunk + len(promoted) - first) * binding.chunk_size
                    admitted = await self.admit(binding, transport, key, blob, start)
                    if not isinstance(admitted, Pins):
                        return False
                    promoted.add(admitted)
                del blobs  # this window's read buffers go back to the transport's pool
        finally:
            if pending is not None:  # stopped early: let the read in flight finish, drop it
                with contextlib.suppress(Exception):
                    await pending
        return True

    async def admit(self, binding: ModelBinding, transport: ChunkTransport, key: ChunkKey, blob: Buffer,
                    start: int) -> Pins | AdmitRejected:
        """:meth:`admit_record` off the loop, single-flight per chunk; a copy that fails is discarded where
        it was read and the tier's next copy, if any, admitted instead (:meth:`_discard`)."""
        async def admit() -> Pins | AdmitRejected:
            copy: Buffer | None = blob
            while True:  # ends: a tier offers each of its copies at most once (RejectsCopies)
                admitted = await asyncio.to_thread(self.admit_record, binding, key, copy, start, transport.name)
                if admitted is not AdmitRejected.CORRUPT:
                    return admitted
                copy = await self._discard(transport, key, copy)
                if copy is None:
                    return admitted

        return await self._once(key, admit)

    async def _discard(self, transport: ChunkTransport, key: ChunkKey, copy: Buffer | None) -> Buffer | None:
        """Remove a copy of ``key`` that failed verification where it was read; the tier's next copy, or None.

        The one rule for every rejection: a tier holding several copies
        (:class:`~kvengine.transport.RejectsCopies`) drops the bad one at its
        source and hands over the next; any other tier holds one copy, deleted.
        ``copy`` is the buffer ``transport.get`` returned (None for a placed
        read, which has none to name the copy by).
        """
        if copy is not None and rejects_copies(transport):
            return await self.tiers.guarded(transport, "reject", transport.reject(key, copy), None)
        await self.tiers.guarded(transport, "delete", transport.delete([key]), None)
        return None

    async def _once(self, key: ChunkKey, promote: Callable[[], Awaitable[_T]]) -> _T | Pins | AdmitRejected:
        """``promote()`` unless another promotion of ``key`` is in flight: then what that one admitted."""
        other = self._inflight.claim(key)
        if other is not None:
            return await self._joined(key, other)
        try:
            return await promote()
        finally:
            self._inflight.settle(key)

    async def _joined(self, key: ChunkKey, other: asyncio.Future[None]) -> Pins | AdmitRejected:
        """Wait for another promotion of ``key`` and pin what it admitted (NO_ROOM: it admitted nothing)."""
        await asyncio.shield(other)  # our cancellation must not cancel the other promotion's future
        return Pins.of(self.memory, key) or AdmitRejected.NO_ROOM

    def admit_record(
        self, binding: ModelBinding, key: ChunkKey, blob: object, start: int, tier: str
    ) -> Pins | AdmitRejected:
        """Verify a record covering tokens from ``start`` and copy it into memory, pinned.

        Or say why not (corrupt records are counted; the caller deletes them).
        Blocking: run it in a worker thread.
        """
        try:
            header, payload = unpack_record(blob, expect_key=key)  # type: ignore[arg-type]
            check_position(binding, header, start)
        except IntegrityError as exc:
            self.metrics.integrity_failure(exc.reason, f"{tier}: {exc}", tier=tier)
            return AdmitRejected.CORRUPT
        except Exception as exc:
            self.metrics.integrity_failure("decode_error", f"{tier}: {type(exc).__name__}: {exc}", tier=tier)
            return AdmitRejected.CORRUPT
        return self.admit_payload(binding, key, header, payload, tier)

    def admit_payload(
        self, binding: ModelBinding, key: ChunkKey, header: RecordHeader, payload: memoryview, tier: str,
        slot: MemoryEntry | None = None,
    ) -> Pins | AdmitRejected:
        """Decode a verified record's payload into ``slot`` (prepared for it; aborted if the payload is
        bad) or else a new memory entry; the entry comes back committed and pinned (blocking)."""
        try:
            raw = self.codecs.by_id(header.codec_id).decode(payload, header.tensors)
            if len(raw) != header.raw_length or (slot is not None and len(raw) != slot.nbytes):
                raise IntegrityError("codec_length", f"decoded {len(raw)} B, header says {header.raw_length}")
        except Exception as exc:  # a codec library failing on garbage is still a miss
            if slot is not None:
                self.memory.abort(slot)
            reason = exc.reason if isinstance(exc, IntegrityError) else "decode_error"
            self.metrics.integrity_failure(reason, f"{tier}: {type(exc).__name__}: {exc}", tier=tier)
            return AdmitRejected.CORRUPT
        if slot is None:
            prepared = self.memory.prepare(key, binding.layout, (header.token_start, header.token_end))
            if isinstance(prepared, Prepared):
                # Present already (a concurrent promotion) or no room: pin what is there, if anything.
                return Pins.of(self.memory, key) or AdmitRejected.NO_ROOM
            slot = prepared
        self.memory.raw(slot).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
        self.metrics.loaded_bytes.labels(tier=tier).inc(header.raw_length)
        return Pins.commit(self.memory, (slot,))

    async def _promote_placed(self, binding: ModelBinding, transport: ReadsInPlace, keys: list[ChunkKey],
                              first_chunk: int, total_tokens: int) -> Pins:
        """The longest prefix of ``keys`` (all present in ``transport``) read straight into memory, pinned.

        For :class:`~kvengine.transport.ReadsInPlace` transports (see also
        :class:`_PlacedRead`): the memory slots are taken first, in prompt
        order (so when memory runs short it is the tail that goes without),
        then up to ``_READ_AHEAD`` reads run at once, each straight into its
        slot: no read buffers, no window barrier. Each header is checked
        before its payload is read, the payload checksum is verified once (by
        the transport, over the slot), and records are admitted in order.
        """
        size = binding.chunk_size
        # Per chunk: already in memory (pinned), its read (claimed), or another promotion's claim to wait for.
        # Taken in one pass with no await, so this promotion's claims all precede any wait of its own.
        items: list[Pins | _PlacedRead | asyncio.Future[None]] = []
        for i, key in enumerate(keys):
            other = self._inflight.claim(key)
            if other is not None:
                items.append(other)
                continue
            start = (first_chunk + i) * size
            tokens = (start, min(start + size, total_tokens))
            slot = self.memory.prepare(key, binding.layout, tokens)
            if isinstance(slot, MemoryEntry):
                items.append(_PlacedRead(self, binding, key, tokens, transport.name, slot))
                continue
            self._inflight.settle(key)
            # A store brought it (or is bringing it: then nothing is pinned), or there is no room.
            resident = Pins.of(self.memory, key) if slot is Prepared.PRESENT else None
            if not resident:
                break
            items.append(resident)
        inflight: deque[tuple[_PlacedRead, asyncio.Future[RecordHeader | None]]] = deque()
        launched = 0
        promoted = Pins(self.memory)

        def launch() -> None:
            nonlocal launched
            while launched < len(items) and len(inflight) < _READ_AHEAD:
                item = items[launched]
                launched += 1
                if isinstance(item, _PlacedRead):
                    inflight.append((item, asyncio.ensure_future(transport.get_into(item.key, item.place))))

        try:
            launch()
            for i, item in enumerate(items):
                if isinstance(item, _PlacedRead):
                    read, pending = inflight.popleft()
                    got = await self._settle(transport, read, pending)
                    self._inflight.settle(read.key)
                elif isinstance(item, asyncio.Future):
                    got = await self._joined(keys[i], item)
                else:
                    got = item
                if not isinstance(got, Pins):
                    break
                promoted.add(got)
                launch()
        except BaseException:  # cancelled: the caller never gets these pins
            promoted.release()
            raise
        finally:
            for _, pending in inflight:  # stopped early: let reads in flight finish
                with contextlib.suppress(Exception):
                    await pending
            for item in items[len(promoted):]:  # and give back every slot, claim and pin not promoted
                if isinstance(item, _PlacedRead):
                    item.discard()
                    self._inflight.settle(item.key)
                elif isinstance(item, Pins):
                    item.release()
        return promoted

    async def promote_each(self, binding: ModelBinding,
                           keys: Sequence[ChunkKey]) -> list[Pins | AdmitRejected | BaseException | None]:
        """Keyed chunks (no prefix, no positions): each of ``keys`` from the first lower tier holding it into
        memory, pinned. Per key: its entry; why its record was refused (a corrupt one is discarded where it
        was read); the fault of the last tier that failed to read it; or None where no tier holds it. A key
        is asked of the next tier where the ones before hold no record of it or failed to read it."""
        results: list[Pins | AdmitRejected | None] = [None] * len(keys)
        faults: dict[int, BaseException] = {}
        for transport in self.tiers.transports:
            todo = [i for i, r in enumerate(results) if r is None]
            if not todo:
                break
            present = await self.tiers.guarded(transport, "exists", transport.exists([keys[i] for i in todo]),
                                               [False] * len(todo))
            todo = [i for i, hit in zip(todo, present) if hit]
            if not todo:
                continue
            found = [keys[i] for i in todo]
            got: Sequence[Pins | AdmitRejected | BaseException | None]
            if reads_in_place(transport):  # straight into new slots, concurrently (the transport bounds its I/O)
                got = await asyncio.gather(*(self.promote_one(binding, transport, key, 0) for key in found),
                                           return_exceptions=True)
            else:  # through the transport's own buffers
                misses: list[Buffer | None] = [None] * len(found)
                blobs = await self.tiers.guarded(transport, "get", transport.get(found), misses)
                admits = [self.admit(binding, transport, key, blob, 0) for key, blob in zip(found, blobs)
                          if blob is not None]
                admitted = iter(await asyncio.gather(*admits))
                got = [None if blob is None else next(admitted) for blob in blobs]
            for i, result in zip(todo, got):
                if isinstance(result, BaseException):  # a fault is a miss here: the next tier may hold a copy
                    faults[i] = result
                else:
                    results[i] = result
        return [faults.get(i) if r is None else r for i, r in enumerate(results)]

    async def promote_one(self, binding: ModelBinding, transport: ReadsInPlace, key: ChunkKey,
                          start: int) -> Pins | AdmitRejected | None:
        """One record read straight into a new memory slot, pinned (None: a miss); a corrupt record is
        discarded (:meth:`_discard`). Used for keyed chunks."""
        read = _PlacedRead(self, binding, key, (start, None), transport.name, None)
        return await self._once(key, lambda: self._settle(transport, read, transport.get_into(key, read.place)))

    async def _settle(self, transport: ReadsInPlace, read: _PlacedRead,
                      pending: Awaitable[RecordHeader | None]) -> Pins | AdmitRejected | None:
        """Wait for a placed read and admit it; a corrupt record is discarded (:meth:`_discard`); a read
        that fails is a miss (counted)."""
        try:
            header = await pending
        except Exception as exc:
            read.discard()
            self.tiers.fault(transport, "get", exc)
            return None
        except BaseException:
            read.discard()
            raise
        admitted = await read.admit(header)
        if admitted is AdmitRejected.CORRUPT:
            await self._discard(transport, read.key, None)
        return admitted


class _PlacedRead:
    """One record read in place: where its payload goes, and what became of it.

    :meth:`place` runs on the transport's I/O thread once the record's header
    is verified: it checks the header against the request and returns the
    destination, i.e. the memory slot taken for it (``slot``; without one, a
    slot is taken now) for a raw payload, or a recycled buffer for an encoded
    one (decoded into the slot in :meth:`admit`), or None to stop the read.
    :meth:`admit` and :meth:`discard` run on the event loop after the read.
    """

    __slots__ = ("promoter", "binding", "key", "tokens", "tier", "entry", "scratch", "outcome")

    def __init__(self, promoter: Promoter, binding: ModelBinding, key: ChunkKey, tokens: tuple[int, int | None],
                 tier: str, slot: MemoryEntry | None) -> None:
        self.promoter, self.binding, self.key, self.tokens, self.tier = promoter, binding, key, tokens, tier
        self.entry = slot  # uncommitted until admitted
        self.scratch: memoryview | None = None
        self.outcome: IntegrityError | Prepared | None = None  # why place() declined

    def place(self, header: RecordHeader) -> memoryview | None:
        promoter = self.promoter
        try:
            check_position(self.binding, header, *self.tokens)
            if not isinstance(promoter.codecs.by_id(header.codec_id), RawCodec):
                self.scratch = promoter.scratch.take(header.payload_length)
                return self.scratch
            if header.payload_length != header.raw_length:
                raise IntegrityError("codec_length", f"raw payload {header.payload_length} B, "
                                     f"header says {header.raw_length}")
        except IntegrityError as exc:
            self.outcome = exc
            return None
        if self.entry is None:
            entry = promoter.memory.prepare(self.key, self.binding.layout, (header.token_start, header.token_end))
            if isinstance(entry, Prepared):
                self.outcome = entry
                return None
            self.entry = entry
        return memoryview(promoter.memory.raw(self.entry).numpy().data)

    async def admit(self, header: RecordHeader | None) -> Pins | AdmitRejected | None:
        """The entry, pinned, or why not (None: a miss, or a corrupt record the transport counted and deleted)."""
        promoter = self.promoter
        if header is None:
            self.discard()
            if isinstance(self.outcome, IntegrityError):
                promoter.metrics.integrity_failure(self.outcome.reason, f"{self.tier}: {self.outcome}",
                                                   tier=self.tier)
                return AdmitRejected.CORRUPT
            if isinstance(self.outcome, Prepared):  # present already (a concurrent promotion) or no room
                return Pins.of(promoter.memory, self.key) or AdmitRejected.NO_ROOM
            return None
        entry, self.entry = self.entry, None
        if self.scratch is not None:  # an encoded payload: decode it into the slot
            payload, self.scratch = self.scratch[: header.payload_length], None
            return await asyncio.to_thread(promoter.admit_payload, self.binding, self.key, header, payload,
                                           self.tier, entry)
        assert entry is not None
        promoter.metrics.loaded_bytes.labels(tier=self.tier).inc(header.raw_length)
        return Pins.commit(promoter.memory, (entry,))

    def discard(self) -> None:
        if self.entry is not None:
            self.promoter.memory.abort(self.entry)
            self.entry = None
        self.scratch = None
