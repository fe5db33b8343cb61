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
    entries: list[MemoryEntry] = field(default_factory=list, repr=False)
    #: The table (of one engine) that made it: only that engine may load or release it.
    owner: object = field(default=None, repr=False, compare=False)

    @property
    def num_chunks(self) -> int:
        return len(self.keys)


class ReservationTable:
    """Live reservations by (namespace, request id). Thread-safe."""

    def __init__(self) -> None:
        self._live: dict[tuple[NamespaceDigest, str], Reservation] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def get(self, namespace: NamespaceDigest, request_id: str) -> Reservation | None:
        with self._lock:
            return self._live.get((namespace, request_id))

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

    def end(self, res: Reservation) -> bool:
        """Remove ``res``; True exactly once per reservation."""
        with self._lock:
            if res.state is ReservationState.ENDED:
                return False
            res.state = ReservationState.ENDED
            if self._live.get((res.namespace, res.request_id)) is res:
                del self._live[(res.namespace, res.request_id)]
            return True

    def expired(self, now: float) -> list[Reservation]:
        """Reservations past their lease: never loaded, or loads never finished (see CacheEngine.begin_load)."""
        with self._lock:
            return [r for r in self._live.values() if r.expires_at < now]

    def all(self) -> Sequence[Reservation]:
        with self._lock:
            return list(self._live.values())
