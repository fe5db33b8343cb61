"""Reservations: the engine's contract with an inference scheduler.

A lookup answers "how many tokens can the cache supply" and backs the answer
by pinning the chunks, so they cannot be evicted before the load. The answer
is idempotent per request id: asking again with the same tokens returns the
same reservation (lease renewed), pins and counts nothing new. A reservation
ends exactly once: by a load, an explicit release, or lease expiry (counted
as a reclaim).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvengine.chunks.keys import ChunkKey, NamespaceDigest
from kvengine.core.memory_tier import MemoryEntry
from kvengine.core.pins import Pins


class ReservationState(enum.Enum):
    RESERVED = "reserved"
    LOADING = "loading"
    ENDED = "ended"


@dataclass(slots=True, eq=False)
class Reservation:
    """A lookup's answer. ``matched_tokens`` is what a load will deliver."""

    request_id: str
    namespace: NamespaceDigest
    matched_tokens: int
    keys: tuple[ChunkKey, ...]
    expires_at: float
    #: Identity of the question (the looked-up chain and cap) for idempotency.
    query: tuple[object, ...] = field(repr=False, default=())
    state: ReservationState = ReservationState.RESERVED
    #: The reserved chunks' memory entries, in order: their views are read only while ``pins`` holds them (a
    #: load, between ``begin_load`` and its end); their extents stay readable after (a load's result, metrics).
    entries: tuple[MemoryEntry, ...] = field(default=(), repr=False)
    #: The pins on ``entries``, released once when the reservation ends (by the engine that made it).
    pins: Pins | None = field(default=None, repr=False)
    #: The table (of one engine) that made it: only that engine may load or release it.
    owner: object = field(default=None, repr=False, compare=False)
    #: ``time.perf_counter()`` at ``begin_load`` (the load's latency is measured from there).
    load_started: float = field(default=0.0, repr=False, compare=False)
    #: The bound model's name (``Namespace.model``): the ``model`` label of the load's metrics.
    model: str = field(default="", repr=False, compare=False)
    #: Where the reserved chunks start: the tokens before it are the caller's already (a lookup ``from_token``),
    #: neither reserved nor loaded. ``matched_tokens`` is the hit's end, counted from token 0.
    first_token: int = 0
    #: Bytes the lookup read from lower tiers into memory for it (counted as unused if it ends unloaded).
    read_bytes: int = field(default=0, repr=False, compare=False)

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    @property
    def load_start(self) -> int:
        """The token a load of it starts at: ``first_token``, or 0 for a miss (nothing to load)."""
        return self.first_token if self.keys else 0

    @property
    def reserved_tokens(self) -> int:
        """The tokens a load of it delivers: from :attr:`load_start` to ``matched_tokens``."""
        return self.matched_tokens - self.load_start


class ReservationTable:
    """Live reservations by (namespace, request id). Thread-safe."""

    def __init__(self) -> None:
        self._live: dict[tuple[NamespaceDigest, str], Reservation] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def renew(self, namespace: NamespaceDigest, request_id: str, query: tuple[object, ...],
              expires_at: float) -> tuple[bool, Reservation | None]:
        """Renew the request's live reservation if it answers ``query``: (True, it); else (False, the
        request's reservation for another question, if any). Atomic with :meth:`end_expired`, so a lease
        is never renewed on a reservation the reaper is ending."""
        with self._lock:
            res = self._live.get((namespace, request_id))
            if res is not None and res.query == query and res.state is ReservationState.RESERVED:
                res.expires_at = max(res.expires_at, expires_at)
                return True, res
            return False, res

    def put(self, res: Reservation) -> Reservation | None:
        """Insert ``res``; return the reservation it replaced, if any."""
        with self._lock:
            old = self._live.get((res.namespace, res.request_id))
            self._live[(res.namespace, res.request_id)] = res
            return old

    def begin_load(self, res: Reservation, now: float) -> bool:
        """Move a live, unexpired reservation to LOADING; False if it cannot be loaded."""
        with self._lock:
            if res.state is not ReservationState.RESERVED or res.expires_at < now:
                return False
            res.state = ReservationState.LOADING
            return True

    def end(self, res: Reservation) -> ReservationState | None:
        """Remove ``res``: the state it ended from, exactly once per reservation (None after)."""
        with self._lock:
            state = res.state
            if state is ReservationState.ENDED:
                return None
            res.state = ReservationState.ENDED
            if self._live.get((res.namespace, res.request_id)) is res:
                del self._live[(res.namespace, res.request_id)]
            return state

    def end_expired(self, now: float) -> list[tuple[Reservation, ReservationState]]:
        """End every reservation past its lease (never loaded, or a load never finished: see
        CacheEngine.begin_load); each with the state it ended in. The caller releases their pins."""
        with self._lock:
            ended = [(r, r.state) for r in self._live.values() if r.expires_at < now]
            for res, _ in ended:
                res.state = ReservationState.ENDED
                del self._live[(res.namespace, res.request_id)]
            return ended

    def all(self) -> Sequence[Reservation]:
        with self._lock:
            return list(self._live.values())
