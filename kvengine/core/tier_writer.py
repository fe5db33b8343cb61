"""The tier writer: every chunk committed to memory reaches the lower tiers, per ``write_mode``.

``write_behind``: :meth:`TierWriter.hand_off` queues the chunks and returns
(a full queue makes the caller wait: backpressure, so nothing acknowledged
is dropped for lack of room); up to ``_WRITES_IN_FLIGHT`` writes run at
once. ``write_through``: it returns once every tier took each chunk or
failed it, with how many did not reach every tier. Either way each record
is encoded once per codec, in one encoder thread (at most one core, so a
store's copies keep a core on small machines), and put to every tier of that
codec; a tier's failure is counted, never raised. The entries come with their
pins (:class:`~.pins.Pins`), which the writer releases as each one's writes end.

With KV events on, each entry may come with its BlockStored event (the
memory tier's); every tier its write reaches publishes it again, with that
tier's medium. Entries handed on without one (keyed chunks) publish nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal, TypeVar, cast

from kvengine.buffers import BufferPool
from kvengine.chunks.codecs import Codec, RawCodec
from kvengine.chunks.keys import ChunkKey
from kvengine.chunks.record import RecordFlag, descriptors_for, encode_header
from kvengine.core.memory_tier import HostMemory, MemoryEntry
from kvengine.core.pins import Pins, release_all
from kvengine.core.tier_set import TierSet
from kvengine.errors import InvalidRequestError
from kvengine.events import BlockStored, KVEventPublisher, medium_of
from kvengine.metrics import EngineMetrics
from kvengine.threads import executor
from kvengine.transport import Buffer
from kvengine.types import ModelBinding

_T = TypeVar("_T")

#: Tier writes in flight at once (each encoded just before its put; at most this many record buffers).
_WRITES_IN_FLIGHT = 8

WriteMode = Literal["write_behind", "write_through"]


class TierWriter:
    def __init__(self, memory: HostMemory, tiers: TierSet, metrics: EngineMetrics, *, write_mode: WriteMode,
                 max_pending: int, record_buffers: BufferPool, events: KVEventPublisher | None = None) -> None:
        self.memory = memory
        self.tiers = tiers
        self.metrics = metrics
        self.write_mode = write_mode
        self.max_pending = max_pending
        #: Page-aligned, already-faulted record buffers, recycled (O_DIRECT writes them as is).
        self.record_buffers = record_buffers
        self._raw_codec = RawCodec()
        self.events = events
        self._queue: asyncio.Queue[tuple[ModelBinding, Pins, BlockStored | None]] | None = None  # one entry each
        self._slots: asyncio.Semaphore | None = None
        self._writes: set[asyncio.Future[bool]] = set()  # write-behind tier writes in flight
        self._task: asyncio.Task[None] | None = None
        self._encoder = executor(1, "kvengine-encode")

    def start(self) -> None:
        """Start the background writer on the running loop."""
        self._queue = asyncio.Queue(maxsize=self.max_pending)
        self._slots = asyncio.Semaphore(_WRITES_IN_FLIGHT)
        if self.tiers:
            self._task = asyncio.create_task(self._writer(), name="kvengine-writer")

    async def flush(self) -> None:
        """Wait until every queued write has been attempted."""
        if self._queue is not None and self.tiers:
            await self._queue.join()

    async def close(self, *, flush: bool = True) -> None:
        """Flush queued writes (or drop them, counted), wait for writes in flight, stop."""
        queue = self._queue
        if queue is not None and self.tiers:
            if flush:
                await queue.join()
            else:
                while not queue.empty():
                    _, pins, _ = queue.get_nowait()
                    pins.release()
                    self.metrics.writes_dropped.labels(reason="shutdown").inc()
                    queue.task_done()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._writes:  # never close memory under a write still reading it
            await asyncio.wait(list(self._writes))
        self._encoder.shutdown(wait=False)

    async def hand_off(self, binding: ModelBinding, held: Pins, stored: Sequence[BlockStored] | None = None) -> int:
        """Hand committed entries and their pins (``held``, emptied: the writer releases them) to the lower
        tiers per write_mode, with each one's BlockStored event when KV events are on (``stored``, in order).

        ``write_through``: returns once every write ended, with how many entries did not reach every
        tier. ``write_behind``: returns once every entry is queued (0); a full queue makes the caller
        wait for room (backpressure), so nothing acknowledged is ever dropped for lack of it.
        """
        assert self._queue is not None and self._slots is not None, "engine not started"
        events: Sequence[BlockStored | None] = [None] * len(held) if stored is None else stored
        each = held.split()
        if self.write_mode == "write_through":
            written = await asyncio.gather(*(self.write_through(binding, p, s) for p, s in zip(each, events)))
            return written.count(False)
        for i, pins in enumerate(each):
            if self._queue.full():
                self.metrics.write_waits.inc()
                self.metrics.log_once("backpressure", "kvengine: tier writes fall behind; stores wait for them")
            try:
                await self._queue.put((binding, pins, events[i]))
            except BaseException:  # cancelled while waiting: these were never queued
                release_all(each[i:])
                raise
        return 0

    async def _writer(self) -> None:
        """Write queued entries, up to ``_WRITES_IN_FLIGHT`` at once: a record starts as soon as one ends,
        so the devices never wait for the slowest record of a group."""
        assert self._queue is not None and self._slots is not None
        queue, slots = self._queue, self._slots

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
                binding, pins, stored = await queue.get()
            except BaseException:
                slots.release()
                raise
            task = asyncio.ensure_future(self._write_entry(binding, pins, stored))
            self._writes.add(task)
            task.add_done_callback(done)

    async def write_through(self, binding: ModelBinding, pins: Pins, stored: BlockStored | None = None) -> bool:
        """Write the one entry of ``pins`` to the tiers now (its pin released after); whether all took it."""
        assert self._slots is not None, "engine not started"
        try:
            async with self._slots:
                return await self._write_entry(binding, pins, stored)
        finally:
            pins.release()  # also when cancelled before its write started

    async def _write_entry(self, binding: ModelBinding, pins: Pins, stored: BlockStored | None) -> bool:
        """Encode the one entry of ``pins`` once per codec, put it to every tier of that codec; release its
        pin. True if every tier took it (a failure is counted, never raised). Each tier that took it
        publishes ``stored`` with its medium (KV events on)."""
        complete = True
        entry = pins[0]
        try:
            for codec, tiers in self.tiers.by_codec.items():
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
                results = await asyncio.gather(*(self._timed(
                    t.name,
                    t.put_parts([(record.key, parts)]) if gathers  # type: ignore[attr-defined]
                    else t.put([(record.key, cast(Buffer, record.joined))]))  # joined: some tier needs it
                    for t, gathers in tiers), return_exceptions=True)  # none still reads the slot
                for (transport, _), result in zip(tiers, results):
                    if isinstance(result, BaseException):  # a transport bug: counted as a failed put
                        self.metrics.log_once(f"put:{transport.name}", "kvengine: %s put raised %s: %s",
                                              transport.name, type(result).__name__, result)
                    elif result[0]:
                        model = binding.namespace.model
                        self.metrics.stored_bytes.labels(tier=transport.name, model=model).inc(record.nbytes)
                        self.metrics.stored_chunks.labels(tier=transport.name, model=model).inc()
                        if stored is not None and self.events is not None:
                            self.events.publish(replace(stored, medium=medium_of(transport.name)))
                        continue
                    complete = False
                    self.metrics.writes_dropped.labels(reason=f"{transport.name}_failed").inc()
                del record  # its buffers go back to the pool
        finally:
            pins.release()
        return complete

    async def _timed(self, tier: str, put: Awaitable[_T]) -> _T:
        """``await put``, its duration observed in ``kvengine_tier_write_seconds{tier}``."""
        started = time.perf_counter()
        try:
            return await put
        finally:
            self.metrics.tier_write_seconds.labels(tier=tier).observe(time.perf_counter() - started)

    def _encode(self, binding: ModelBinding, entry: MemoryEntry, codec: Codec, *, joined: bool) -> _EncodedRecord:
        """A pinned entry's record as header + payload, the payload where it lies for the raw codec (blocking).

        With ``joined``, also the whole record in a recycled page-aligned buffer:
        one copy and no page faults.
        """
        header, payload = self.record_parts(binding, entry, codec)
        body = memoryview(payload).cast("B")
        record = None
        if joined:
            record = self.record_buffers.take(len(header) + body.nbytes)
            record[: len(header)] = header
            record[len(header) :] = body
        return _EncodedRecord(entry.key, header, body, record)

    def record_parts(
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
