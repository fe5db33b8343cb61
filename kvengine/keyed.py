"""Keyed chunks: put / get / exists by the caller's own chunk keys.

For inference engines that hash their own pages (SGLang's HiCache page
hashes, for one) and only need a store, not prefix hashing. Everything else
is the engine's: the memory tier, the lower tiers (write-behind or
write-through), the record format and its verification, the metrics.

* :func:`keyed_namespace` – mark a namespace as keyed by a named key scheme.
* :func:`keyed_chunk_key` – ``ChunkHash = xxh3_128(binding.digest || key)``.
* :meth:`KeyedStore.exists` – which keys are stored (memory, then lower tiers).
* :meth:`KeyedStore.put` – copy new chunks into memory; lower tiers follow.
* :meth:`KeyedStore.get` – hand stored chunks to a sink, promoting from lower
  tiers into memory on the way.
* :class:`SyncKeyedStore` – the same, blocking, over a :class:`KVEngine`.

Keys are opaque bytes; the caller guarantees that one key always names the
same bytes under one binding (for SGLang: the page hash chain). A binding
used for keyed chunks must come from :func:`keyed_namespace`, so keyed
chunks can never meet token-hashed chunks (the hash formulas could collide
for equal inputs, the namespaces cannot).

Every keyed chunk is a full chunk whose record covers tokens
``[0, chunk_size)``: the key already encodes the position.

Batches are independent per key, except that :meth:`KeyedStore.put` stops
at the first key that finds no room (the rest is reported ``NO_ROOM``).
Cache faults (corrupt records, dead tiers, no room) are counted outcomes,
never exceptions; caller mistakes (tensors not matching the layout, a
binding without a key scheme) raise :class:`InvalidRequestError`.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import xxhash

from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace
from kvengine.core.caller_mode import in_callers_mode
from kvengine.core.copies import copy_all
from kvengine.core.engine import CacheEngine
from kvengine.core.pins import Pins, release_all
from kvengine.core.promotion import AdmitRejected
from kvengine.errors import InvalidRequestError
from kvengine.transport import ReadScope, read_scope
from kvengine.types import ChunkView, ModelBinding

if TYPE_CHECKING:
    from kvengine.facade import KVEngine


KEYED_PREFIX = "keyed:"

#: ``source(index)`` returns the tensors of the batch's ``index``-th chunk, in layout order.
KeyedSource = Callable[[int], Sequence[torch.Tensor]]
#: ``sink(index, tensors)`` copies a stored chunk out (views valid only during the call).
KeyedSink = Callable[[int, tuple[torch.Tensor, ...]], None]


class PutOutcome(enum.Enum):
    STORED = "stored"  # copied into memory; lower tiers follow per the write mode
    PRESENT = "present"  # already in memory: nothing copied
    NO_ROOM = "no_room"  # memory is full of pinned chunks (counted)
    REFUSED = "refused"  # the namespace is quarantined (counted)

    @property
    def ok(self) -> bool:
        return self in (PutOutcome.STORED, PutOutcome.PRESENT)


class GetOutcome(enum.Enum):
    HIT = "hit"  # the sink got the chunk
    MISS = "miss"  # stored nowhere
    CORRUPT = "corrupt"  # a lower tier held a record that failed verification (counted, deleted)
    NO_ROOM = "no_room"  # found below, but memory had no room to promote it (counted)
    SINK_FAILED = "sink_failed"  # the sink raised (logged once)

    @property
    def ok(self) -> bool:
        return self is GetOutcome.HIT


def keyed_namespace(namespace: Namespace, scheme: str) -> Namespace:
    """``namespace`` marked as keyed by ``scheme`` (e.g. ``"sglang-page-sha256"``)."""
    if not scheme or any(k.startswith(KEYED_PREFIX) for k in namespace.extra_keys):
        raise InvalidRequestError("keyed_namespace needs a non-empty scheme and an unkeyed namespace")
    return namespace.with_updates(extra_keys=(*namespace.extra_keys, KEYED_PREFIX + scheme))


def key_scheme(binding: ModelBinding) -> str | None:
    """The binding's key scheme, or None for a token-hashed binding."""
    for extra in binding.namespace.extra_keys:
        if extra.startswith(KEYED_PREFIX):
            return extra[len(KEYED_PREFIX):]
    return None


def keyed_chunk_key(binding: ModelBinding, key: bytes) -> ChunkKey:
    """The engine's address of the caller's ``key`` under ``binding``."""
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) == 0:
        raise InvalidRequestError(f"a chunk key must be non-empty bytes, got {type(key).__name__}")
    return ChunkKey(binding.digest, ChunkHash(xxhash.xxh3_128_digest(bytes(binding.digest) + bytes(key))))


class KeyedStore:
    """Keyed put / get / exists over a started :class:`CacheEngine` (async, its loop only)."""

    def __init__(self, engine: CacheEngine, binding: ModelBinding) -> None:
        if key_scheme(binding) is None:
            raise InvalidRequestError("KeyedStore needs a binding whose namespace comes from keyed_namespace()")
        self.engine = engine
        self.binding = binding
        self._full = (0, binding.chunk_size)
        metrics = engine.metrics
        self._loaded_bytes = metrics.loaded_bytes.labels(tier="memory")

    def chunk_keys(self, keys: Sequence[bytes]) -> list[ChunkKey]:
        return [keyed_chunk_key(self.binding, k) for k in keys]

    # -- exists -------------------------------------------------------------------
    def _refused(self, op: str, n: int) -> bool:
        """A quarantined namespace answers nothing and takes nothing (counted)."""
        if not self.engine.is_quarantined(self.binding):
            return False
        self.engine.metrics.quarantine_refusals.labels(op=f"keyed_{op}").inc(n)
        return True

    async def exists(self, keys: Sequence[bytes], *, verify: bool = False) -> list[bool]:
        """Whether each key is stored in memory or (probably) in a lower tier.

        With ``verify``, a chunk found only below memory counts only once it has
        been read, verified and promoted into memory (unpinned), so the answer
        is what a ``get`` right after it can deliver: for schedulers that size
        work by it.
        """
        if self._refused("exists", len(keys)):
            return [False] * len(keys)
        if verify or self.engine.memory.lower_tiers:  # the host service's tiers answer by promoting
            return [o is GetOutcome.HIT for o in await self._fetch(self.chunk_keys(keys), None)]
        ckeys = self.chunk_keys(keys)
        found = [self.engine.holds(k) for k in ckeys]
        for transport in self.engine.transports:
            todo = [i for i, hit in enumerate(found) if not hit]
            if not todo:
                break
            present = await self.engine.tiers.guarded(transport, "exists", transport.exists([ckeys[i] for i in todo]),
                                                [False] * len(todo))
            for i, hit in zip(todo, present):
                found[i] = hit
        return found

    # -- put ----------------------------------------------------------------------
    async def put(self, keys: Sequence[bytes], source: KeyedSource) -> list[PutOutcome]:
        """Store the chunks of ``keys`` that memory does not hold yet.

        ``source(i)`` is called only for chunks that will be stored. Lower
        tiers receive the new chunks per the engine's write mode.

        :raises InvalidRequestError: ``source`` returned tensors that do not
            match the layout (nothing of that chunk is stored).
        """
        if self._refused("put", len(keys)):
            return [PutOutcome.REFUSED] * len(keys)
        ckeys = self.chunk_keys(keys)
        outcomes, held, error = await asyncio.to_thread(self._copy_in, ckeys, source)
        if held:  # the committed ones reach the tiers, also when the source failed part-way
            await self.engine.writer.hand_off(self.binding, held)
        if error is not None:
            raise error
        return outcomes

    def _copy_in(self, ckeys: list[ChunkKey], source: KeyedSource
                 ) -> tuple[list[PutOutcome], Pins, BaseException | None]:
        """Copy the new chunks into memory (blocking, through the engine's stager): each key's outcome,
        the committed entries' pins to hand on, and what ``source`` raised, if it did."""
        stager, layout = self.engine.stager, self.binding.layout
        staged = stager.prepare(self.binding, ckeys, [self._full] * len(ckeys))

        def fill(view: ChunkView) -> bool:
            tensors = source(view.index)
            layout.check(tensors)
            copy_all(view.tensors, tensors)
            return True

        filled, error = stager.fill(staged, fill)
        _, held = stager.commit(staged, filled)
        outcomes = [PutOutcome.PRESENT] * len(ckeys)
        for view in staged.chunks[:filled]:
            outcomes[view.index] = PutOutcome.STORED
        for i in range(len(ckeys) - staged.rejected_chunks, len(ckeys)):
            outcomes[i] = PutOutcome.NO_ROOM
        return outcomes, held, error

    # -- get ----------------------------------------------------------------------
    async def get(self, keys: Sequence[bytes], sink: KeyedSink, *, reads: ReadScope | None = None) -> list[GetOutcome]:
        """Give each stored chunk to ``sink``; chunks found below memory are promoted into it (read as
        ``reads`` says where given, else within the tiers' own deadlines and placement)."""
        if self._refused("get", len(keys)):
            return [GetOutcome.MISS] * len(keys)
        return await self._fetch(self.chunk_keys(keys), sink, reads)

    async def _fetch(self, ckeys: list[ChunkKey], sink: KeyedSink | None,
                     reads: ReadScope | None = None) -> list[GetOutcome]:
        """Pin what memory holds, promote the rest from lower tiers, hand every hit to ``sink`` (if any)."""
        memory = self.engine.memory
        found = [Pins.of(memory, k) for k in ckeys]  # per key: its entry, pinned, or none
        outcomes = [GetOutcome.HIT if pins else GetOutcome.MISS for pins in found]
        try:
            missing = GetOutcome.MISS in outcomes
            if self.engine.transports and missing:
                with read_scope(reads):
                    await self._promote(ckeys, found, outcomes)
            elif memory.lower_tiers and missing:
                await self._promote_below(ckeys, found, outcomes)
            if sink is not None:
                await asyncio.to_thread(self._copy_out, found, outcomes, sink)
        finally:
            release_all(found)
        return outcomes

    async def _promote(self, ckeys: list[ChunkKey], found: list[Pins], outcomes: list[GetOutcome]) -> None:
        todo = [i for i, o in enumerate(outcomes) if o is GetOutcome.MISS]
        results = await self.engine.promoter.promote_each(self.binding, [ckeys[i] for i in todo])
        for i, result in zip(todo, results):
            if isinstance(result, Pins):
                found[i], outcomes[i] = result, GetOutcome.HIT
            elif result is AdmitRejected.CORRUPT:
                outcomes[i] = GetOutcome.CORRUPT
            elif result is AdmitRejected.NO_ROOM:
                outcomes[i] = GetOutcome.NO_ROOM
                self.engine.metrics.log_once("keyed_promote_no_room", "kvengine: no room in memory to promote "
                                             "keyed chunks from a lower tier; served as misses")
            elif isinstance(result, BaseException):  # a transport fault is a miss
                self.engine.metrics.log_once("keyed_promote_error", "kvengine: keyed promotion failed (%s: %s); "
                                             "served as a miss", type(result).__name__, result)

    async def _promote_below(self, ckeys: list[ChunkKey], found: list[Pins], outcomes: list[GetOutcome]) -> None:
        """The misses, promoted by the host service's own lower tiers (which count what they refuse), pinned."""
        memory = self.engine.memory
        todo = [i for i, o in enumerate(outcomes) if o is GetOutcome.MISS]
        resident = await asyncio.to_thread(memory.promote_each, self.binding, [ckeys[i] for i in todo])
        for i, ok in zip(todo, resident):
            pins = Pins.of(memory, ckeys[i]) if ok else None
            if pins:
                found[i], outcomes[i] = pins, GetOutcome.HIT

    def _copy_out(self, found: list[Pins], outcomes: list[GetOutcome], sink: KeyedSink) -> None:
        memory = self.engine.memory
        nbytes = 0
        for i, pins in enumerate(found):
            if not pins:
                continue
            entry = pins[0]
            try:
                sink(i, memory.tensors(entry))
            except Exception as exc:
                outcomes[i] = GetOutcome.SINK_FAILED
                self.engine.metrics.log_once("keyed_sink_error", "kvengine: keyed get sink failed (%s: %s); "
                                             "served as a miss", type(exc).__name__, exc)
                continue
            nbytes += entry.nbytes
        self._loaded_bytes.inc(nbytes)


class SyncKeyedStore:
    """Blocking :class:`KeyedStore` over a :class:`KVEngine`; callable from any thread but the engine's loop."""

    def __init__(self, kv: KVEngine, binding: ModelBinding) -> None:
        self.kv = kv
        # the facade's engine (what kvengine.facade.engine_of returns; this layer is below the facade)
        self.store = KeyedStore(kv._core, binding)

    @property
    def binding(self) -> ModelBinding:
        return self.store.binding

    def exists(self, keys: Sequence[bytes], *, verify: bool = False) -> list[bool]:
        return self.kv.run(self.store.exists(keys, verify=verify))

    def put(self, keys: Sequence[bytes], source: KeyedSource) -> list[PutOutcome]:
        return self.kv.run(self.store.put(keys, in_callers_mode(source)))

    def get(self, keys: Sequence[bytes], sink: KeyedSink, *, reads: ReadScope | None = None) -> list[GetOutcome]:
        return self.kv.run(self.store.get(keys, in_callers_mode(sink), reads=reads))


__all__ = [
    "GetOutcome", "KeyedSink", "KeyedSource", "KeyedStore", "PutOutcome", "SyncKeyedStore", "key_scheme",
    "keyed_chunk_key", "keyed_namespace",
]
