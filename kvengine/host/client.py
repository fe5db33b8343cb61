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

import contextlib
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
from kvengine.types import ModelBinding

logger = logging.getLogger("kvengine.host")

#: A request unanswered this long counts the service as gone (it answers in microseconds).
TIMEOUT_S = 2.0
#: After losing the service, calls answer misses this long before connecting again.
RETRY_S = 0.5
#: A promotion from the service's lower tiers unanswered this long is a miss (their reads have deadlines
#: of their own, far shorter; this only bounds a service that stopped answering).
PROMOTE_TIMEOUT_S = 30.0
#: Idle connections for promotions kept open (more are opened while more promotions run at once).
MAX_IDLE_PROMOTERS = 4


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


@dataclass(frozen=True, slots=True)
class _Greeting:
    """The service's answer to HELLO."""

    reader: wire.FrameReader
    arena_fd: int
    arena_bytes: int
    prefaulted: bool
    features: wire.Features


class ServiceMemory:
    """The memory tier of the ``kvengine host`` service listening on the Unix socket ``path``."""

    name = "memory"
    #: The shared arena is not page-locked.
    pinned = False
    #: Whether the service owns tiers below its arena (then lookups short in memory ask it to promote).
    lower_tiers = False
    #: Whether the service publishes its arena's KV events (then stores send it each chunk's).
    publishes_events = False

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
        #: binding digest -> the binding and its layout's fingerprint (compared with each pinned chunk's)
        self._bound: dict[NamespaceDigest, tuple[ModelBinding, bytes]] = {}
        #: Connections for promotions (each blocks for the tiers' reads, so they run beside the requests of
        #: the main connection and beside each other): all that are open, and those idle.
        self._promoters: set[socket.socket] = set()
        self._idle_promoters: list[tuple[socket.socket, wire.FrameReader]] = []
        self._promoters_lock = threading.Lock()
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
        sock = self._socket(TIMEOUT_S)
        try:
            hello = self._greet(sock)
            self._generation += 1
            arena = SharedArena(hello.arena_fd, hello.arena_bytes, populate=hello.prefaulted)  # owns the fd now
            conn = _Connection(sock, hello.reader, _Mapping(arena, self._generation))
            self.lower_tiers = bool(hello.features & wire.Features.LOWER_TIERS)
            self.publishes_events = bool(hello.features & wire.Features.EVENTS)
            for layout_raw in {wire.layout_json(layout) for layout in self._layouts.values()}:
                self._request(conn, Op.LAYOUT, layout_raw)
            if self.lower_tiers:
                for binding, _ in list(self._bound.values()):
                    self._request(conn, Op.BIND, _bind_frame(binding))
            return conn
        except BaseException:
            sock.close()
            raise

    def _socket(self, timeout: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        return sock

    def _greet(self, sock: socket.socket) -> _Greeting:
        """Say HELLO on ``sock``: the service's answer, with the arena's descriptor (the caller's to close).

        :raises ConfigError: the service refuses this process. :raises OSError, WireError: it is not there.
        """
        wire.send_frame(sock, Op.HELLO, wire.VERSION_FRAME.pack(wire.VERSION) + self.tenant.encode())
        reader = wire.FrameReader(sock)
        status, payload, fds = reader.read(max_fds=1)
        try:
            if status != Status.OK:
                raise ConfigError(f"memory.service: the kvengine host service on {self.path} refused this "
                                  f"process: {payload.decode(errors='replace')}")
            arena_bytes, prefaulted, features = wire.unpack(wire.ARENA, payload)
            if len(fds) != 1:
                raise WireError("the service sent no arena")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return _Greeting(reader, fds[0], arena_bytes, bool(prefaulted), wire.Features(features))

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

    def admit(self, binding: ModelBinding) -> None:
        """Learn ``binding``'s layout and send it to the service, with the binding itself where the service
        owns lower tiers (their records are verified against it there).

        :raises CapacityError: its chunks can never be stored (a slab is too small).
        :raises ConfigError: the service's lower tiers refuse the binding (the reason is the service's).
        """
        self._bound[binding.digest] = binding, self._send_layout(binding.layout)
        if not self.lower_tiers:
            return
        answer = self._call(Op.BIND, _bind_frame(binding))
        if answer is not None and answer[0] != Status.OK:
            raise ConfigError(f"memory.service: the kvengine host service on {self.path} refused model "
                              f"{binding.namespace.model!r}: {answer[1].decode(errors='replace')}")

    def _send_layout(self, layout: ChunkLayout) -> bytes:
        """Send ``layout`` to the service unless it was sent already: its fingerprint.

        :raises CapacityError: its chunks can never be stored (a slab is too small).
        """
        fingerprint = wire.fingerprint_bytes(layout)
        if fingerprint not in self._layouts:
            answer = self._call(Op.LAYOUT, wire.layout_json(layout))
            if answer is not None and answer[0] != Status.OK:
                raise CapacityError(answer[1].decode(errors="replace"))
            self._layouts[fingerprint] = layout
        return fingerprint

    def promote(self, binding: ModelBinding, keys: Sequence[ChunkKey], first_chunk: int,
                total_tokens: int) -> tuple[int, int]:
        """Ask the service's lower tiers for ``keys`` (the rest of a lookup, short in memory): how many of
        them, from the first, are now resident (pin them next), and the record bytes read for them.

        Blocking (the tiers' reads): call it off an event loop. On a connection of its own, so this
        engine's other requests are answered meanwhile. (0, 0) where the service has no lower tier or is
        gone, or takes longer than :data:`PROMOTE_TIMEOUT_S`.
        """
        if not (self.lower_tiers and keys):
            return 0, 0
        frame = wire.PROMOTE.pack(binding.digest, first_chunk, total_tokens) + wire.pack_keys(keys)
        answer = self._promotion(Op.PROMOTE, frame)
        if answer is None or len(answer) != wire.PROMOTED.size:
            return 0, 0
        count, nbytes = wire.PROMOTED.unpack(answer)
        return min(count, len(keys)), nbytes

    def promote_each(self, binding: ModelBinding, keys: Sequence[ChunkKey]) -> list[bool]:
        """As :meth:`promote`, for keyed chunks (no prefix, no positions): whether each key is resident now."""
        if not (self.lower_tiers and keys):
            return [False] * len(keys)
        answer = self._promotion(Op.PROMOTE_EACH, wire.DIGEST.pack(binding.digest) + wire.pack_keys(keys))
        if answer is None or len(answer) != len(keys):
            return [False] * len(keys)
        return [b == 1 for b in answer]

    def _promotion(self, op: Op, frame: bytes) -> bytes | None:
        """The service's answer to a promotion, on the connection for them; None when it is gone."""
        with self._promoters_lock:
            promoter = self._idle_promoters.pop() if self._idle_promoters else None
        try:
            if promoter is None:
                promoter = self._promoter()
            wire.send_frame(promoter[0], op, frame)
            status, answer, _ = promoter[1].read()
        except (OSError, WireError, ConfigError):
            if promoter is not None:
                self._drop_promoter(promoter[0])
            return None
        with self._promoters_lock:
            if promoter[0] in self._promoters and len(self._idle_promoters) < MAX_IDLE_PROMOTERS:
                self._idle_promoters.append(promoter)
                promoter = None
        if promoter is not None:  # closed meanwhile, or enough are idle
            self._drop_promoter(promoter[0])
        return answer if status == Status.OK else None

    def _promoter(self) -> tuple[socket.socket, wire.FrameReader]:
        """A new greeted connection for promotions (the arena it is sent is mapped by the first already)."""
        sock = self._socket(PROMOTE_TIMEOUT_S)
        try:
            hello = self._greet(sock)
            os.close(hello.arena_fd)
            with self._promoters_lock:
                if self._retry_at == float("inf"):
                    raise OSError("closed")
                self._promoters.add(sock)
        except BaseException:
            sock.close()
            raise
        return sock, hello.reader

    def _drop_promoter(self, sock: socket.socket) -> None:
        with self._promoters_lock:
            self._promoters.discard(sock)
        sock.close()

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
            layout = bound[0].layout
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
        fingerprint = self._send_layout(layout)
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
        """Send stored chunks' events for the service to publish (where it publishes any)."""
        if not self.publishes_events:
            return
        events = [(entry.key, event) for entry, event in stored if self._current(entry)]
        if events:
            self._call(Op.ANNOUNCE, wire.pack_stored(events))

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
        with self._promoters_lock:
            promoters, self._promoters = self._promoters, set()
            idle, self._idle_promoters = self._idle_promoters, []
            self.lower_tiers = False
        for sock in promoters:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a promotion waiting on it, which then closes it
        for sock, _ in idle:
            sock.close()
        if conn is not None:
            conn.sock.close()
            conn.mapping.arena.close()


def _bind_frame(binding: ModelBinding) -> bytes:
    return wire.BIND.pack(binding.digest, wire.fingerprint_bytes(binding.layout)) + wire.namespace_json(
        binding.namespace)
