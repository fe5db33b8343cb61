"""What a peer server serves: stores of chunk records.

:class:`RecordStore` is the small protocol a peer server needs: batched async
``get`` / ``exists`` / ``put`` / ``delete`` over record bytes, faults as
None / False. Every :class:`kvengine.transport.ChunkTransport` is one (so a
``LocalDiskTransport`` can back a server as it is).

* :class:`MemoryRecordStore` -- records in RAM, LRU, never above
  ``capacity_bytes`` (the default store of ``kvengine serve``).

A running engine's memory tier as a record store is :class:`kvengine.sharing.EngineStore`, above the
transports.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvengine.chunks.keys import ChunkKey
from kvengine.transport import Buffer

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
