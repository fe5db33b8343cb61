"""What a peer server serves: stores of chunk records.

:class:`RecordStore` is the small protocol a peer server needs: batched async
``get`` / ``exists`` / ``put`` / ``delete`` over record bytes, faults as
None / False. Every :class:`kvengine.transport.ChunkTransport` is one (so a
``LocalDiskTransport`` can back a server as it is).

* :class:`MemoryRecordStore` -- records in RAM, LRU, never above
  ``capacity_bytes`` (the default store of ``kvengine serve``).
* :class:`EngineStore` -- a running :class:`kvengine.CacheEngine`'s memory
  tier (chunks of the namespaces it was told to share, encoded into records
  on demand, exactly as the engine writes them to its own tiers) in front of
  a backing store that keeps what other nodes put.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from kvengine import CacheEngine
from kvengine.chunks.keys import ChunkKey, NamespaceDigest
from kvengine.chunks.record import seal_record
from kvengine.compression import codec_family
from kvengine.errors import InvalidRequestError
from kvengine.transport import Buffer
from kvengine.types import ModelBinding

#: Batches of more record bytes than this are copied into the store in a worker thread.
_THREAD_COPY_BYTES = 1 << 20


@runtime_checkable
class RecordStore(Protocol):
    """Batched record storage; faults are None / False, never raised."""

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]: ...

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]: ...

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]: ...


class MemoryRecordStore:
    """Records in process memory, least recently used evicted first; thread-safe.

    A record larger than the whole capacity is refused (``put`` -> False).
    ``put`` of a key already stored keeps the stored record (records are
    content-addressed: same key, same chunk). Every record is kept as a
    ``bytes`` of exactly its length, copied from what was put unless it is
    one already: a view would keep alive the buffer it views (a ZeroMQ
    frame and its bookkeeping, a tcp read buffer shared by a whole batch, a
    receive buffer rounded up to 2 MiB), so memory would exceed
    ``capacity_bytes``, which counts record bytes. Large batches are copied
    in a worker thread, off the event loop.
    """

    name = "peer_memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._records: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        with self._lock:
            out: list[Buffer | None] = []
            for key in keys:
                record = self._records.get(key)
                if record is not None:
                    self._records.move_to_end(key)
                out.append(record)
            return out

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._records for k in keys]

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        if sum(len(record) for _, record in items) > _THREAD_COPY_BYTES:
            return await asyncio.to_thread(self._put_all, items)
        return self._put_all(items)

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [self._drop_locked(k) for k in keys]

    async def close(self) -> None:
        with self._lock:
            self._records.clear()
            self.used_bytes = 0

    def _put_all(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return [self._put_one(key, record) for key, record in items]

    def _put_one(self, key: ChunkKey, record: Buffer) -> bool:
        if len(record) > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._records:
                self._records.move_to_end(key)
                return True
        data = record if type(record) is bytes else bytes(record)  # copy outside the lock
        with self._lock:
            while self.used_bytes + len(data) > self.capacity_bytes:
                self._drop_locked(next(iter(self._records)))
            if key not in self._records:
                self._records[key] = data
                self.used_bytes += len(data)
            return True

    def _drop_locked(self, key: ChunkKey) -> bool:
        record = self._records.pop(key, None)
        if record is None:
            return False
        self.used_bytes -= len(record)
        return True


class EngineStore:
    """A :class:`CacheEngine`'s memory tier in front of ``backing``.

    ``get`` / ``exists`` look in the engine's memory first, for namespaces
    passed to :meth:`share` only (a chunk is encoded with the binding's
    codec and verification flag, exactly as the engine's tier writer does),
    then in ``backing``. ``put`` and ``delete`` go to ``backing`` only: the
    memory tier holds what this node computed; what peers send is kept
    apart. Safe to use from another thread's event loop than the engine's
    (memory-tier pins are thread-safe; encoding runs in a worker thread).
    """

    name = "peer_engine"

    def __init__(self, engine: CacheEngine, backing: RecordStore, bindings: Iterable[ModelBinding] = (),
                 *, secret: bytes | None = None) -> None:
        self.engine = engine
        self.backing = backing
        #: the peer group's secret: records encoded from memory are sealed with it (readers require it)
        self._secret = secret
        self._bindings: dict[NamespaceDigest, ModelBinding] = {}
        for binding in bindings:
            self.share(binding)

    def share(self, binding: ModelBinding) -> None:
        """Serve this binding's chunks from the engine's memory tier.

        :raises InvalidRequestError: if the engine's ``peers.codec`` would
            serve this namespace KV of another codec family (e.g. lossy KV
            to exact readers).
        """
        family = codec_family(self.engine.peer_codec)
        if binding.namespace.codec_family != family:
            raise InvalidRequestError(
                f"peers.codec {self.engine.peer_codec.name!r} is of family {family!r} but the namespace "
                f"of model {binding.namespace.model!r} asks for {binding.namespace.codec_family!r}"
            )
        self._bindings[binding.digest] = binding

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        out: list[Buffer | None] = list(await asyncio.to_thread(self._encode_resident, keys))
        missing = [i for i, record in enumerate(out) if record is None]
        if missing:
            for i, record in zip(missing, await self.backing.get([keys[i] for i in missing])):
                out[i] = record
        return out

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        out = [k.namespace in self._bindings and self.engine.holds(k) for k in keys]
        missing = [i for i, ok in enumerate(out) if not ok]
        if missing:
            for i, ok in zip(missing, await self.backing.exists([keys[i] for i in missing])):
                out[i] = ok
        return out

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return await self.backing.put(items)

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self.backing.delete(keys)

    def _encode_resident(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            binding = self._bindings.get(key.namespace)
            record = None if binding is None else self.engine.resident_record(binding, key)
            if record is not None and self._secret is not None:
                record = seal_record(record, self._secret)
            out.append(record)
        return out
