"""``kvengine host``: one memory tier per machine, in shared memory, for every engine on it.

The service owns the memory tier's index, pins and eviction
(:class:`~kvengine.core.memory_tier.MemoryTier`, unchanged) over an arena in
shared memory. Engines attach over a Unix socket
(:class:`~kvengine.host.client.ServiceMemory`) and copy chunk bytes to and
from the arena themselves.

Lifetimes: everything a connection holds, its pins and its prepared (not yet
committed) stores, is released when the connection closes, however the client
ended (a SIGKILL closes its socket too). A prepared entry is invisible to
lookups until committed, so nothing a client half-wrote is ever served.

Who may attach: the socket file is created with ``mode`` (default owner only),
and each connection's peer credentials (``SO_PEERCRED``) are checked against
the service's own uid and ``allow_uids`` before anything else is answered.

One thread per connection, blocking on its socket: a lookup's round trip is a
few tens of microseconds, lower than an event loop's per-request overhead.

With ``kvengine host --config``, the service also owns tiers below the arena
(:class:`LowerTiers`: committed chunks are written to them, and clients ask it
to promote what a lookup finds short) and publishes the arena's KV events
(clients send each stored chunk's event, with its tokens).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvengine.chunks.keys import ChunkKey, Namespace, NamespaceDigest
from kvengine.chunks.layout import ChunkLayout
from kvengine.config import MemoryConfig
from kvengine.core.memory_tier import MemoryEntry, MemoryTier, Prepared
from kvengine.core.pins import Pins
from kvengine.errors import CapacityError, ConfigError
from kvengine.events import AllBlocksCleared, KVEventPublisher
from kvengine.host import wire
from kvengine.host.pools import SHARED, Pool, PoolStats, build_pools
from kvengine.host.wire import Op, Status, WireError
from kvengine.threads import start_thread

logger = logging.getLogger("kvengine.host")

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: Layouts the service remembers at most (a model has one per rank; this bounds what clients can make it hold).
MAX_LAYOUTS = 4096


class LowerTiers(Protocol):
    """The tiers below the arena, when the service owns them (``kvengine host --config``;
    :class:`kvengine.core.host_tiers.HostTiers`). Called from connection threads."""

    def describe(self) -> str: ...
    def bind(self, namespace: Namespace, layout: ChunkLayout, digest: NamespaceDigest) -> str | None: ...
    def written(self, memory: MemoryTier, pins: Pins) -> None: ...
    def promote(self, memory: MemoryTier, digest: NamespaceDigest, keys: list[ChunkKey], first_chunk: int,
                total_tokens: int) -> tuple[int, int]: ...
    def promote_each(self, memory: MemoryTier, digest: NamespaceDigest, keys: list[ChunkKey]) -> list[bool]: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class HostStats:
    """What the service holds and has done, for its log line and tests."""

    connections: int
    chunks: int
    used_bytes: int
    capacity_bytes: int
    pins: int
    evictions: int
    #: Pins and prepared stores released because their connection closed without releasing them.
    released_pins: int
    aborted_stores: int
    refused_connections: int
    #: Per pool: each tenant with a quota, and "" for the rest.
    pools: dict[str, PoolStats]


@dataclass(eq=False)
class _Client:
    """One connection's holdings: released, whatever remains, when it closes."""

    pid: int
    uid: int
    pool: Pool | None = None  # set by HELLO
    pins: dict[ChunkKey, tuple[MemoryEntry, int]] = field(default_factory=dict)
    prepared: dict[ChunkKey, MemoryEntry] = field(default_factory=dict)

    def pin(self, entry: MemoryEntry) -> None:
        held = self.pins.get(entry.key)
        self.pins[entry.key] = (entry, held[1] + 1 if held else 1)

    def unpin(self, key: ChunkKey) -> MemoryEntry | None:
        """The entry of one of this client's pins of ``key``, released from its holdings; None if it holds
        none (a client cannot release another's pins)."""
        held = self.pins.get(key)
        if held is None:
            return None
        entry, count = held
        if count == 1:
            del self.pins[key]
        else:
            self.pins[key] = (entry, count - 1)
        return entry


class HostService:
    """The memory tier of ``memory`` in a shared arena, served on the Unix socket ``path``."""

    def __init__(self, memory: MemoryConfig, path: str | Path, *, quotas: Mapping[str, int] | None = None,
                 allow_uids: Iterable[int] = (), mode: int = 0o600, lower: LowerTiers | None = None,
                 events: KVEventPublisher | None = None) -> None:
        """``quotas``: tenant name -> bytes of the arena that tenant's clients get to themselves (see
        :mod:`kvengine.host.pools`); clients of other tenants share the rest. ``lower``: tiers below the
        arena that the service owns (its clients then have none of their own). ``events``: where the
        arena's KV events are published (clients send each stored chunk's). Both are closed with the
        service."""
        self.path = Path(path)
        self.lower = lower
        self.events = events
        self.features = wire.Features(0)
        if lower is not None:
            self.features |= wire.Features.LOWER_TIERS
        if events is not None:
            self.features |= wire.Features.EVENTS
        self.mode = mode
        self.allowed_uids = frozenset({os.getuid(), *allow_uids})
        self.prefaulted = memory.prefault
        self._arena, self.pools = build_pools(memory, quotas or {}, events)
        self._layouts: dict[bytes, ChunkLayout] = {}  # fingerprint -> layout
        self._lock = threading.Lock()  # the counters and the connection set
        self._connections: dict[socket.socket, threading.Thread] = {}  # each served by its thread
        self._released_pins = self._aborted_stores = self._refused = 0
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    @property
    def capacity_bytes(self) -> int:
        return self._arena.nbytes

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the socket and serve in background threads.

        :raises ConfigError: another service answers on ``path``, or the socket cannot be created.
        """
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise ConfigError(f"{self.path} exists and is not a socket: refusing to replace it")
            if _answers(self.path):
                raise ConfigError(f"a service already listens on {self.path}")
            self.path.unlink()  # left by a service that died
        if self.events is not None:
            self.events.start()  # raises ConfigError for an endpoint it cannot open
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, self.mode)
            listener.listen(64)
        except OSError as exc:
            listener.close()
            if self.events is not None:
                self.events.close()
            raise ConfigError(f"cannot serve on {self.path}: {exc}") from None
        self._listener = listener
        self._acceptor = start_thread(self._accept, "kvengine-host-accept")
        logger.info("kvengine host: serving %d B in %d pools on %s", self.capacity_bytes, len(self.pools), self.path)

    def close(self) -> None:
        """Stop serving: drop every connection, remove the socket file, free the arena."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        if self._acceptor is not None:
            self._acceptor.join()
        with self._lock:
            connections = list(self._connections.items())
        for conn, thread in connections:
            with contextlib.suppress(OSError):  # closed by its thread meanwhile
                conn.shutdown(socket.SHUT_RDWR)  # its thread releases its holdings and exits
            thread.join(timeout=5)
        self.path.unlink(missing_ok=True)
        if self.lower is not None:  # writes what is queued: it reads the arena, so before the arena goes
            self.lower.close()
        for pool in self.pools.values():
            pool.tier.close()
        self._arena.close()
        if self.events is not None:
            self.events.publish(AllBlocksCleared())
            self.events.close()

    def stats(self) -> HostStats:
        with self._lock:
            connections = len(self._connections)
        pools = {name: pool.stats() for name, pool in self.pools.items()}
        return HostStats(connections, sum(p.chunks for p in pools.values()),
                         sum(p.used_bytes for p in pools.values()), self.capacity_bytes,
                         sum(pool.tier.total_pins() for pool in self.pools.values()),
                         sum(p.evictions for p in pools.values()), self._released_pins, self._aborted_stores,
                         self._refused, pools)

    # -- connections -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while (listener := self._listener) is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:  # registered before its thread can end and remove it
                self._connections[conn] = start_thread(self._serve, "kvengine-host-client", conn)

    def _serve(self, conn: socket.socket) -> None:
        pid, uid, _gid = _CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                             _CREDENTIALS.size))
        client = _Client(pid, uid)
        reader = wire.FrameReader(conn)
        try:
            while True:
                op, payload, _ = reader.read()
                answer = self._answer(client, op, payload)
                if answer is not None:
                    status, data, fds = answer
                    wire.send_frame(conn, status, data, fds)
                    if status == Status.FORBIDDEN:
                        return
        except (WireError, OSError) as exc:
            if str(exc) != "connection closed":
                logger.info("kvengine host: dropping client pid %d: %s", pid, exc)
        except Exception:  # a bug here must cost one connection, never the service
            logger.exception("kvengine host: dropping client pid %d", pid)
        finally:
            self._release(client)
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()

    def _release(self, client: _Client) -> None:
        """Everything ``client`` still holds goes back: its pins, and its stores never committed."""
        pins = [entry for entry, count in client.pins.values() for _ in range(count)]
        if client.pool is not None:
            client.pool.tier.unpin(pins)
            for entry in client.prepared.values():
                client.pool.tier.abort(entry)
        with self._lock:
            self._released_pins += len(pins)
            self._aborted_stores += len(client.prepared)
        client.pins.clear()
        client.prepared.clear()

    def _answer(self, client: _Client, op: int, payload: bytes) -> tuple[int, bytes, list[int]] | None:
        """One request's status, payload and descriptors (the arena's, with HELLO); None: not answered."""
        pool = client.pool
        if pool is None:
            return self._hello(client, op, payload)
        tier = pool.tier
        if op == Op.PIN_PREFIX:
            entries = tier.pin_prefix(wire.unpack_keys(payload))
            for pinned in entries:
                client.pin(pinned)
            return Status.OK, b"".join(wire.PINNED.pack(pool.base + e.offset, e.token_start, e.num_tokens,
                                                        wire.fingerprint_bytes(e.layout)) for e in entries), []
        if op == Op.UNPIN:
            tier.unpin([e for e in map(client.unpin, wire.unpack_keys(payload)) if e is not None])
            return None
        if op == Op.PREPARE:
            return self._prepare(client, pool, payload)
        if op in (Op.COMMIT, Op.ABORT):
            raw, keep_pin = wire.unpack(wire.COMMIT, payload)
            entry = client.prepared.pop(wire.key_from(raw), None)
            if entry is None:  # not this connection's store: nothing to do (and nothing is answered)
                return None
            if op == Op.ABORT:
                tier.abort(entry)
                return None
            lower = self.lower
            if lower is None:
                tier.commit(entry, keep_pin=bool(keep_pin))  # the writer's pin, if kept, is the client's
                if keep_pin:
                    client.pin(entry)
                return None
            handed = Pins.commit(tier, (entry,))  # the writer's pin passes to the lower tiers' writer
            if keep_pin:
                tier.pin(entry.key)  # and the client holds one of its own
                client.pin(entry)
            lower.written(tier, handed)
            return None
        if op in (Op.DISCARD, Op.CONTAINS):
            key = wire.key_from(wire.unpack(wire.KEY, payload)[0])
            done = tier.discard(key) if op == Op.DISCARD else tier.contains(key)
            return Status.OK, bytes([done]), []
        if op == Op.LAYOUT:
            return self._layout(tier, payload)
        if op == Op.BIND:
            return self._bind(payload)
        if op == Op.ANNOUNCE:
            tier.announce_keys(wire.unpack_stored(payload))
            return None
        if op in (Op.PROMOTE, Op.PROMOTE_EACH):
            return self._promote(tier, op, payload)
        if op == Op.STATS:
            own = sum(count for _, count in client.pins.values())
            return Status.OK, wire.STATS.pack(len(tier), tier.used_bytes, tier.capacity_bytes, own,
                                              tier.total_pins()), []
        raise WireError(f"unknown op {op}")

    def _hello(self, client: _Client, op: int, payload: bytes) -> tuple[int, bytes, list[int]]:
        if op != Op.HELLO:
            raise WireError(f"op {op} before HELLO")
        if client.uid not in self.allowed_uids:
            with self._lock:
                self._refused += 1
            logger.warning("kvengine host: refused pid %d: uid %d is not allowed", client.pid, client.uid)
            return Status.FORBIDDEN, (f"uid {client.uid} may not use the kvengine host service on {self.path} "
                                      f"(allowed uids: {sorted(self.allowed_uids)})").encode(), []
        if len(payload) < wire.VERSION_FRAME.size:
            raise WireError("HELLO without a version")
        (version,) = wire.VERSION_FRAME.unpack_from(payload)
        if version != wire.VERSION:
            return Status.REFUSED, (f"protocol version {version}; this service speaks "
                                    f"{wire.VERSION}").encode(), []
        tenant = payload[wire.VERSION_FRAME.size :].decode(errors="replace")
        client.pool = self.pools.get(tenant, self.pools[SHARED])
        return Status.OK, wire.ARENA.pack(self._arena.nbytes, self.prefaulted, self.features), [self._arena.fd]

    def _prepare(self, client: _Client, pool: Pool, payload: bytes) -> tuple[int, bytes, list[int]]:
        raw, fingerprint, start, end = wire.unpack(wire.PREPARE, payload)
        key = wire.key_from(raw)
        layout = self._layouts.get(fingerprint)
        if layout is None:
            return Status.REFUSED, b"unknown layout: send it (LAYOUT) first", []
        if not 0 <= start < end or end - start > layout.chunk_size:
            return Status.REFUSED, f"token range [{start}, {end}) is not a chunk".encode(), []
        if key in client.prepared:
            return Status.PRESENT, b"", []
        entry = pool.tier.prepare(key, layout, (start, end))
        if entry is Prepared.PRESENT:
            return Status.PRESENT, b"", []
        if entry is Prepared.NO_ROOM:
            return Status.NO_ROOM, b"", []
        client.prepared[key] = entry
        return Status.OK, wire.OFFSET.pack(pool.base + entry.offset), []

    def _promote(self, tier: MemoryTier, op: int, payload: bytes) -> tuple[int, bytes, list[int]]:
        """Bring chunks the lower tiers hold into ``tier`` (blocking this connection's thread for their reads;
        clients send promotions on connections of their own)."""
        lower = self.lower
        if op == Op.PROMOTE:
            (digest, first_chunk, total_tokens), rest = wire.unpack_head(wire.PROMOTE, payload)
            keys = wire.unpack_keys(rest)
            promoted = (0, 0) if lower is None else lower.promote(tier, NamespaceDigest(digest), keys, first_chunk,
                                                                  total_tokens)
            return Status.OK, wire.PROMOTED.pack(*promoted), []
        (digest,), rest = wire.unpack_head(wire.DIGEST, payload)
        keys = wire.unpack_keys(rest)
        resident = [False] * len(keys) if lower is None else lower.promote_each(tier, NamespaceDigest(digest), keys)
        return Status.OK, bytes(resident), []

    def _bind(self, payload: bytes) -> tuple[int, bytes, list[int]]:
        (digest, fingerprint), rest = wire.unpack_head(wire.BIND, payload)
        namespace = wire.namespace_from_json(rest)
        layout = self._layouts.get(fingerprint)
        if layout is None:
            return Status.REFUSED, b"unknown layout: send it (LAYOUT) first", []
        refused = None if self.lower is None else self.lower.bind(namespace, layout, NamespaceDigest(digest))
        if refused is not None:
            return Status.REFUSED, refused.encode(), []
        return Status.OK, b"", []

    def _layout(self, tier: MemoryTier, payload: bytes) -> tuple[int, bytes, list[int]]:
        layout = wire.layout_from_json(payload)
        try:
            tier.check_fits(layout.nbytes())
        except CapacityError as exc:
            return Status.REFUSED, str(exc).encode(), []
        fingerprint = wire.fingerprint_bytes(layout)
        if fingerprint not in self._layouts and len(self._layouts) >= MAX_LAYOUTS:
            return Status.REFUSED, f"the service knows {MAX_LAYOUTS} layouts already".encode(), []
        self._layouts[fingerprint] = layout
        return Status.OK, b"", []


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()
