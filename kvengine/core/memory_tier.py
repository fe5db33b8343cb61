"""L1: the host-memory tier.

Fixed capacity (a :class:`SlabAllocator` arena, never exceeded), pins, and a
pluggable eviction policy. Stores are two-phase so the copy runs outside the
lock: :meth:`prepare` reserves a slot (evicting unpinned entries if needed),
the caller fills it, :meth:`commit` publishes it (or :meth:`abort` returns
it). A prepared entry is invisible to lookups until committed.

Invariant: an entry with ``pins > 0`` is never evicted or freed.

KV events (optional, see :mod:`kvengine.events`): the engine announces the
chunks it stored or promoted through :meth:`MemoryTier.announce`, which marks
them; a marked entry's removal (eviction or discard) is published as it
happens. Both under the lock, so a chunk's removal is never published before
its store. Without a publisher none of it runs.

Concurrency: one ``threading.Lock`` guards the index, the pins, the eviction
policy and the allocator. Every method holds it only for dictionary and
free-list work proportional to the entries it touches, never across a copy,
an I/O or a wait (``on_evict`` runs under it and only counts; KV events are
only queued under it, never sent). So it may be taken from any thread, the
event loop included, and it is: the engine's loop (pins for lookups,
commits), its copy threads (``prepare`` / ``commit`` of stores), the
local-disk tier's I/O threads (``prepare`` of a placed read) and peer-server
threads (reads of resident chunks by ``EngineStore``). Tensor views of an
entry are read or written outside the lock, by whoever holds a pin.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvengine.chunks.keys import ChunkKey
from kvengine.chunks.layout import ChunkLayout
from kvengine.core.allocator import SlabAllocator
from kvengine.core.eviction import EvictionPolicy
from kvengine.events import MEDIUM_MEMORY, BlockRemoved, BlockStored, KVEventPublisher
from kvengine.types import ModelBinding


class Prepared(enum.Enum):
    """Why :meth:`MemoryTier.prepare` returned no entry."""

    PRESENT = "present"  # the key is stored (or being stored) already
    NO_ROOM = "no_room"  # everything evictable is gone and it still does not fit


@dataclass(slots=True, eq=False)
class MemoryEntry:
    """One chunk resident in host memory."""

    key: ChunkKey
    layout: ChunkLayout
    #: The chunk's first token position and its token count (no tuple object per entry).
    token_start: int
    num_tokens: int
    #: Where its slot starts in the arena (the allocation: see :meth:`SlabAllocator.allocate`).
    offset: int
    pins: int = 0
    committed: bool = False
    #: Its BlockStored event was published (:meth:`MemoryTier.announce`): its removal will be too.
    announced: bool = False
    _views: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)

    @property
    def token_range(self) -> tuple[int, int]:
        return self.token_start, self.token_start + self.num_tokens

    @property
    def nbytes(self) -> int:
        """Payload bytes (a partial chunk's are fewer than its slot's)."""
        return self.layout.nbytes(self.num_tokens)


class HostMemory(Protocol):
    """The memory tier as the engine uses it: :class:`MemoryTier` (an arena of this process) or
    :class:`~kvengine.host.client.ServiceMemory` (the host service's shared arena)."""

    name: str
    #: Whether tiers below this memory answer :meth:`promote` (the host service's, when it owns them).
    lower_tiers: bool
    #: Whether :meth:`announce` publishes KV events (callers build them only then).
    @property
    def publishes_events(self) -> bool: ...

    @property
    def capacity_bytes(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def pinned(self) -> bool: ...
    def __len__(self) -> int: ...
    def total_pins(self) -> int: ...
    def admit(self, binding: ModelBinding) -> None: ...
    def promote(self, binding: ModelBinding, keys: Sequence[ChunkKey], first_chunk: int,
                total_tokens: int) -> tuple[int, int]: ...
    def promote_each(self, binding: ModelBinding, keys: Sequence[ChunkKey]) -> list[bool]: ...
    def contains(self, key: ChunkKey) -> bool: ...
    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryEntry]: ...
    def pin(self, key: ChunkKey) -> MemoryEntry | None: ...
    def unpin(self, entries: Iterable[MemoryEntry]) -> None: ...
    def prepare(self, key: ChunkKey, layout: ChunkLayout,
                token_range: tuple[int, int]) -> MemoryEntry | Prepared: ...
    def commit(self, entry: MemoryEntry, *, keep_pin: bool = False) -> None: ...
    def abort(self, entry: MemoryEntry) -> None: ...
    def announce(self, stored: Iterable[tuple[MemoryEntry, BlockStored]]) -> None: ...
    def raw(self, entry: MemoryEntry) -> torch.Tensor: ...
    def tensors(self, entry: MemoryEntry) -> tuple[torch.Tensor, ...]: ...
    def discard(self, key: ChunkKey) -> bool: ...
    def close(self) -> None: ...


class MemoryTier:
    name = "memory"
    lower_tiers = False

    def __init__(
        self,
        allocator: SlabAllocator,
        policy: EvictionPolicy,
        *,
        on_evict: Callable[[MemoryEntry], None] | None = None,
        events: KVEventPublisher | None = None,
    ) -> None:
        self._alloc = allocator
        self._policy = policy
        self._entries: dict[ChunkKey, MemoryEntry] = {}
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self._events = events

    # -- introspection -------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked host memory (CUDA hosts: device copies run at full speed)."""
        return bool(self._alloc.arena.is_pinned())

    def __len__(self) -> int:
        return len(self._entries)

    def total_pins(self) -> int:
        with self._lock:
            return sum(e.pins for e in self._entries.values())

    @property
    def publishes_events(self) -> bool:
        return self._events is not None

    def check_fits(self, nbytes: int) -> None:
        """Raise :class:`CapacityError` if an object of ``nbytes`` can never be stored."""
        self._alloc.slot_bytes(nbytes)

    def admit(self, binding: ModelBinding) -> None:
        """Raise :class:`CapacityError` if ``binding``'s chunks can never be stored."""
        self.check_fits(binding.layout.nbytes())

    def promote(self, binding: ModelBinding, keys: Sequence[ChunkKey], first_chunk: int,
                total_tokens: int) -> tuple[int, int]:
        """Nothing is below this arena but the engine's own tiers (its promoter reads them): (0, 0)."""
        return 0, 0

    def promote_each(self, binding: ModelBinding, keys: Sequence[ChunkKey]) -> list[bool]:
        """As :meth:`promote`, for keyed chunks: none."""
        return [False] * len(keys)

    # -- lookups -------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.committed

    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryEntry]:
        """Pin the longest prefix of ``keys`` that is resident; return its entries.

        Entries are touched last-to-first so that, under LRU, the tail of a
        prefix is evicted before its head (a missing head makes the rest
        unreachable).
        """
        with self._lock:
            pinned: list[MemoryEntry] = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or not entry.committed:
                    break
                entry.pins += 1
                pinned.append(entry)
            for entry in reversed(pinned):
                self._policy.accessed(entry.key)
            return pinned

    def pin(self, key: ChunkKey) -> MemoryEntry | None:
        entries = self.pin_prefix([key])
        return entries[0] if entries else None

    def unpin(self, entries: Iterable[MemoryEntry]) -> None:
        with self._lock:
            for entry in entries:
                assert entry.pins > 0, f"unbalanced unpin of {entry.key}"
                entry.pins -= 1

    # -- two-phase store ----------------------------------------------
    def prepare(self, key: ChunkKey, layout: ChunkLayout, token_range: tuple[int, int]) -> MemoryEntry | Prepared:
        """Reserve a slot for ``key``, evicting unpinned entries if needed.

        Returns the new entry, pinned once for the writer (``commit`` or
        ``abort`` settles that pin), or why there is none. A partial chunk
        takes a full chunk's slot: one size class per layout keeps the arena
        from splitting into classes that cannot serve each other.
        """
        full = layout.nbytes()
        with self._lock:
            if key in self._entries:
                return Prepared.PRESENT
            offset = self._alloc.allocate(full)
            while offset is None:
                if not self._evict_one_locked(full):
                    return Prepared.NO_ROOM
                offset = self._alloc.allocate(full)
            start, end = token_range
            entry = MemoryEntry(key, layout, start, end - start, offset, pins=1)
            self._entries[key] = entry
            return entry

    def commit(self, entry: MemoryEntry, *, keep_pin: bool = False) -> None:
        """Publish a prepared entry; ``keep_pin`` hands the writer's pin to the caller."""
        with self._lock:
            entry.committed = True
            if not keep_pin:
                entry.pins -= 1
            self._policy.inserted(entry.key)
            # Whoever filled the views may have copied gradient-tracking tensors into them (which makes
            # a view, not the arena, track gradients): readers get fresh views.
            entry._views = None

    def abort(self, entry: MemoryEntry) -> None:
        with self._lock:
            entry.pins -= 1
            self._remove_locked(entry)

    def announce(self, stored: Iterable[tuple[MemoryEntry, BlockStored]]) -> None:
        """Publish each entry's BlockStored event if the entry is still resident and not announced yet, and
        mark it so its removal is published too. No-op without a publisher.

        Under the lock, as removals are: an entry evicted before this is not announced at all, one evicted
        after has its removal queued after its store.
        """
        events = self._events
        if events is None:
            return
        with self._lock:
            for entry, event in stored:
                if not entry.announced and entry.committed and self._entries.get(entry.key) is entry:
                    entry.announced = True
                    events.publish(event)

    def announce_keys(self, stored: Iterable[tuple[ChunkKey, BlockStored]]) -> None:
        """:meth:`announce` by key, for the host service (its clients know their chunks by key, not by this
        tier's entries): the chunk resident under each key is announced once."""
        # The pairs are built as announce consumes them, under its lock: each key's entry is the one resident.
        self.announce((entry, event) for key, event in stored if (entry := self._entries.get(key)) is not None)

    # -- data access ----------------------------------------------------
    def raw(self, entry: MemoryEntry) -> torch.Tensor:
        """The entry's payload as flat uint8 (valid while pinned)."""
        return self._alloc.view(entry.offset, entry.nbytes)

    def tensors(self, entry: MemoryEntry) -> tuple[torch.Tensor, ...]:
        """Typed views of the entry's tensors, in layout order (valid while pinned)."""
        views = entry._views
        if views is None:
            # Detached: an in-place copy of a gradient-tracking tensor into a view never makes the arena
            # (and so every later view of it) track gradients.
            views = entry._views = tuple(v.detach() for v in entry.layout.views(
                self._alloc.typed, entry.offset, entry.num_tokens))
        return views

    def close(self) -> None:
        """Drop every entry and release the arena (pins no longer matter: the engine is closed). No removal
        events: the engine publishes AllBlocksCleared."""
        with self._lock:
            for entry in self._entries.values():
                entry._views = None
            self._entries.clear()
            self._alloc.release()

    # -- removal ----------------------------------------------------------
    def discard(self, key: ChunkKey) -> bool:
        """Drop an unpinned entry; False if absent or pinned."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pins or not entry.committed:
                return False
            self._remove_locked(entry)
            return True

    def _evict_one_locked(self, nbytes: int) -> bool:
        """Evict the first evictable entry; prefer entries of a slot size that helps."""
        want = self._alloc.slot_bytes(nbytes)
        fallback: MemoryEntry | None = None
        for key in self._policy.candidates():
            entry = self._entries[key]  # type: ignore[index]
            if entry.pins or not entry.committed:
                continue
            if self._alloc.slot_size_at(entry.offset) == want:
                fallback = entry
                break
            if fallback is None:
                fallback = entry
        if fallback is None:
            return False
        self._remove_locked(fallback)
        if self._on_evict is not None:
            self._on_evict(fallback)
        return True

    def _remove_locked(self, entry: MemoryEntry) -> None:
        if entry.announced and self._events is not None:
            self._events.publish(BlockRemoved((entry.key.chunk_hash,), MEDIUM_MEMORY))
        del self._entries[entry.key]
        self._policy.removed(entry.key)
        entry._views = None
        self._alloc.free(entry.offset)
