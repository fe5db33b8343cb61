"""The memory tier of an engine attached to ``kvengine host``: the service's arena, mapped here.

:class:`ServiceMemory` has :class:`~kvengine.core.memory_tier.MemoryTier`'s
surface, so the engine above it is unchanged: pins, two-phase stores and
their lookups are requests to the service; an entry's tensors are views of
the shared arena, read and written in this process with no copy through the
socket.

Faults are misses, never exceptions into the engine and never a hang: a
service that is gone (its socket closed: killed, restarted) or silent past
:data:`TIMEOUT_S` turns lookups into misses and stores into skipped ones
(counted, :attr:`ServiceMemory.outages`), and the next call after
:data:`RETRY_S` reconnects. A new service is a new arena: entries of the old
connection stay readable for whoever holds them (the mapping lives while
their views do) and their unpins and commits are dropped, never sent to the
new service. Only the first connection, when the engine starts, raises: an
engine configured for a service that is not there refuses to start.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvengine.chunks.keys import ChunkKey, NamespaceDigest
from kvengine.chunks.layout import ChunkLayout
from kvengine.core.memory_tier import MemoryEntry, Prepared
from kvengine.errors import CapacityError, ConfigError
from kvengine.events import BlockStored
from kvengine.host import wire
from kvengine.host.arena import SharedArena
from kvengine.host.wire import Op, Status, WireError

logger = logging.getLogger("kvengine.host")

#: A request unanswered this long counts the service as gone (it answers in microseconds).
TIMEOUT_S = 2.0
#: After losing the service, calls answer misses this long before connecting again.
RETRY_S = 0.5


class _Mapping:
    """One connection's view of the service's arena."""

    def __init__(self, arena: SharedArena, generation: int) -> None:
        self.arena = arena
        self.generation = generation
        self._typed: dict[torch.dtype, torch.Tensor] = {torch.uint8: arena.tensor}

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        view = self._typed.get(dtype)
        if view is None:
            view = self._typed[dtype] = self.arena.tensor.view(dtype)
        return view


@dataclass(slots=True, eq=False)
class ServiceEntry(MemoryEntry):
    """A chunk in the service's arena, as one connection (``mapping``) knows it."""

    mapping: _Mapping | None = field(default=None, repr=False)


def _inside(mapping: _Mapping, offset: int, layout: ChunkLayout) -> bool:
    """Whether a chunk slot of ``layout`` at ``offset`` lies in the arena."""
    return offset + layout.nbytes() <= mapping.arena.nbytes


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """The service's memory tier as one client sees it: its tenant's pool (all zero while the service is
    gone)."""

    chunks: int
    used_bytes: int
    capacity_bytes: int
    #: Pins held by this client's connection, and by every connection.
    own_pins: int
    all_pins: int


@dataclass(slots=True)
class _Connection:
    sock: socket.socket
    reader: wire.FrameReader
    mapping: _Mapping


class ServiceMemory:
    """The memory tier of the ``kvengine host`` service listening on the Unix socket ``path``."""

    name = "memory"
    #: The shared arena is not page-locked.
    pinned = False

    def __init__(self, path: str, *, tenant: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        """Connect now, as a client of ``tenant`` (its quota's pool; "" or a tenant without one: the
        shared pool).

        :raises ConfigError: no service answers on ``path``, or it refuses this process.
        """
        self.path = path
        self.tenant = tenant
        self._clock = clock
        self._lock = threading.Lock()  # one request in flight: answers come back in order
        self._layouts: dict[bytes, ChunkLayout] = {}  # fingerprint -> layout (sent again on reconnect)
        #: binding digest -> its chunks' layout and that layout's fingerprint (compared with each pinned chunk's)
        self._bound: dict[NamespaceDigest, tuple[ChunkLayout, bytes]] = {}
        self._generation = 0
        self._retry_at = 0.0
        #: Times the service was lost (each one's calls answered misses until it came back).
        self.outages = 0
        self._conn: _Connection | None = None
        try:
            self._conn = self._connect()
        except (OSError, WireError, CapacityError) as exc:
            raise ConfigError(f"memory.service: cannot attach to the kvengine host service on {path}: "
                              f"{exc} (start it with `kvengine host --socket {path}`)") from None

    # -- the connection ----------------------------------------------------------------------------
    def _connect(self) -> _Connection:
        """A greeted connection with the arena mapped and every known layout sent.

        :raises ConfigError: the service refuses this process. :raises OSError, WireError: it is not there.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(TIMEOUT_S)
            sock.connect(self.path)
            wire.send_frame(sock, Op.HELLO, wire.VERSION_FRAME.pack(wire.VERSION) + self.tenant.encode())
            reader = wire.FrameReader(sock)
            status, payload, fds = reader.read(max_fds=1)
            try:
                if status != Status.OK:
                    raise ConfigError(f"memory.service: the kvengine host service on {self.path} refused this "
                                      f"process: {payload.decode(errors='replace')}")
                arena_bytes, resident = wire.unpack(wire.ARENA, payload)
                if len(fds) != 1:
                    raise WireError("the service sent no arena")
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            self._generation += 1
            arena = SharedArena(fds[0], arena_bytes, populate=bool(resident))  # owns the descriptor from here
            conn = _Connection(sock, reader, _Mapping(arena, self._generation))
            for layout_raw in {wire.layout_json(layout) for layout in self._layouts.values()}:
                self._request(conn, Op.LAYOUT, layout_raw)
            return conn
        except BaseException:
            sock.close()
            raise

    def _request(self, conn: _Connection, op: Op, payload: bytes) -> tuple[int, bytes]:
        wire.send_frame(conn.sock, op, payload)
        if op in wire.ONE_WAY:
            return Status.OK, b""
        status, answer, _ = conn.reader.read()
        return status, answer

    def _call(self, op: Op, payload: bytes) -> tuple[int, bytes, _Mapping] | None:
        """The service's answer and the mapping it refers to; None while the service is gone."""
        with self._lock:
            conn = self._conn
            if conn is None:
                if self._clock() < self._retry_at:
                    return None
                try:
                    conn = self._conn = self._connect()
                    logger.info("kvengine host: attached to %s again", self.path)
                except (OSError, WireError, ConfigError, CapacityError):
                    self._retry_at = self._clock() + RETRY_S
                    return None
            try:
                status, answer = self._request(conn, op, payload)
            except (OSError, WireError) as exc:
                self._lose(conn, exc)
                return None
            return status, answer, conn.mapping

    def _lose(self, conn: _Connection, exc: Exception) -> None:
        logger.warning("kvengine host: lost the service on %s (%s): misses until it is back", self.path, exc)
        conn.sock.close()
        conn.mapping.arena.close()
        self._conn = None
        self._retry_at = self._clock() + RETRY_S
        self.outages += 1

    def _current(self, entry: MemoryEntry) -> bool:
        """Whether ``entry`` belongs to the live connection (else the service that knew it is gone)."""
        conn = self._conn
        return (conn is not None and isinstance(entry, ServiceEntry)
                and entry.mapping is conn.mapping)

    # -- introspection -----------------------------------------------------------------------------
    def service_stats(self) -> ServiceStats:
        answer = self._call(Op.STATS, b"")
        return ServiceStats(*wire.unpack(wire.STATS, answer[1])) if answer else ServiceStats(0, 0, 0, 0, 0)

    @property
    def capacity_bytes(self) -> int:
        return self.service_stats().capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.service_stats().used_bytes

    def __len__(self) -> int:
        return self.service_stats().chunks

    def total_pins(self) -> int:
        """This engine's pins (the service's other clients hold their own)."""
        return self.service_stats().own_pins

    def admit(self, digest: NamespaceDigest, layout: ChunkLayout) -> None:
        """Learn the layout of ``digest``'s chunks and send it to the service.

        :raises CapacityError: its chunks can never be stored (a slab is too small).
        """
        fingerprint = wire.fingerprint_bytes(layout)
        self._bound[digest] = layout, fingerprint
        if fingerprint in self._layouts:
            return
        answer = self._call(Op.LAYOUT, wire.layout_json(layout))
        if answer is not None and answer[0] != Status.OK:
            raise CapacityError(answer[1].decode(errors="replace"))
        self._layouts[fingerprint] = layout

    # -- lookups -----------------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        answer = self._call(Op.CONTAINS, wire.key_bytes(key))
        return answer is not None and answer[1] == b"\x01"

    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryEntry]:
        """Pin the longest resident prefix of ``keys`` whose layout is the one this engine bound."""
        if not keys:
            return []
        answer = self._call(Op.PIN_PREFIX, wire.pack_keys(keys))
        if answer is None:
            return []
        _, records, mapping = answer
        entries: list[MemoryEntry] = []
        for key, i in zip(keys, range(0, len(records), wire.PINNED.size)):
            offset, start, count, fingerprint = wire.PINNED.unpack_from(records, i)
            bound = self._bound.get(key.namespace)
            if bound is None or bound[1] != fingerprint:
                break  # never read bytes as a layout they were not written in
            layout = bound[0]
            if not (0 < count <= layout.chunk_size and _inside(mapping, offset, layout)):
                break  # a broken service: never a view outside the arena
            entries.append(ServiceEntry(key, layout, start, count, offset, committed=True, mapping=mapping))
        unused = keys[len(entries) : len(records) // wire.PINNED.size]
        if unused:
            self._call(Op.UNPIN, wire.pack_keys(unused))
        return entries

    def pin(self, key: ChunkKey) -> MemoryEntry | None:
        entries = self.pin_prefix([key])
        return entries[0] if entries else None

    def unpin(self, entries: Iterable[MemoryEntry]) -> None:
        keys = [e.key for e in entries if self._current(e)]
        if keys:
            self._call(Op.UNPIN, wire.pack_keys(keys))

    # -- two-phase store ---------------------------------------------------------------------------
    def prepare(self, key: ChunkKey, layout: ChunkLayout, token_range: tuple[int, int]) -> MemoryEntry | Prepared:
        fingerprint = wire.fingerprint_bytes(layout)
        if fingerprint not in self._layouts:
            self.admit(key.namespace, layout)
        start, end = token_range
        answer = self._call(Op.PREPARE, wire.PREPARE.pack(wire.key_bytes(key), fingerprint, start, end))
        if answer is None:
            return Prepared.NO_ROOM
        status, payload, mapping = answer
        if status == Status.PRESENT:
            return Prepared.PRESENT
        if status != Status.OK:
            return Prepared.NO_ROOM
        (offset,) = wire.unpack(wire.OFFSET, payload)
        entry = ServiceEntry(key, layout, start, end - start, offset, pins=1, mapping=mapping)
        if not _inside(mapping, offset, layout):  # a broken service: never a view outside the arena
            self.abort(entry)
            return Prepared.NO_ROOM
        return entry

    def commit(self, entry: MemoryEntry, *, keep_pin: bool = False) -> None:
        if self._current(entry):
            self._call(Op.COMMIT, wire.COMMIT.pack(wire.key_bytes(entry.key), keep_pin))
        entry.committed = True
        entry._views = None

    def abort(self, entry: MemoryEntry) -> None:
        if self._current(entry):
            self._call(Op.ABORT, wire.COMMIT.pack(wire.key_bytes(entry.key), False))

    def announce(self, stored: Iterable[tuple[MemoryEntry, BlockStored]]) -> None:
        """No KV events through the service (the configuration refuses them)."""

    # -- data access -------------------------------------------------------------------------------
    def raw(self, entry: MemoryEntry) -> torch.Tensor:
        assert isinstance(entry, ServiceEntry) and entry.mapping is not None
        return entry.mapping.arena.tensor[entry.offset : entry.offset + entry.nbytes]

    def tensors(self, entry: MemoryEntry) -> tuple[torch.Tensor, ...]:
        assert isinstance(entry, ServiceEntry) and entry.mapping is not None
        views = entry._views
        if views is None:
            views = entry._views = entry.layout.views(entry.mapping.typed, entry.offset, entry.num_tokens)
        return views

    def discard(self, key: ChunkKey) -> bool:
        answer = self._call(Op.DISCARD, wire.key_bytes(key))
        return answer is not None and answer[1] == b"\x01"

    def close(self) -> None:
        """Detach: the service releases this engine's pins and unfinished stores when the socket closes."""
        with self._lock:
            conn, self._conn = self._conn, None
            self._retry_at = float("inf")
        if conn is not None:
            conn.sock.close()
            conn.mapping.arena.close()
