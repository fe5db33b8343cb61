"""Pins: the one owner of the engine's pins on memory entries.

A pinned entry is never evicted or freed (:mod:`.memory_tier`), so a pin
that is never released leaks memory for good, and one released twice lets a
chunk be evicted under a reader. Every pin the engine takes is therefore held
by a :class:`Pins` handle, and this module is the only place that takes or
releases one (``tests/core/test_pins.py`` checks that no other module of the
engine calls the memory tier's pin methods):

* acquired by :meth:`Pins.prefix` / :meth:`Pins.of` (resident chunks) or
  :meth:`Pins.commit` (a filled slot whose writer's pin becomes the handle's);
* passed on whole, joined (:meth:`Pins.add`) or split per entry
  (:meth:`Pins.split`), each of which moves the pins: one owner at a time;
* released by :meth:`Pins.release`, which is idempotent, and by leaving a
  ``with`` block, so every exit path of a scoped use releases them.

A slot :meth:`~.memory_tier.HostMemory.prepare` returns is pinned too, but
that pin belongs to the two-phase store: its ``commit`` or ``abort`` settles
it (the stager's and promoter's slots). The host service keeps its own ledger
of the pins its clients in other processes hold, released when a client's
connection closes (:mod:`kvengine.host.service`).

A handle belongs to one task or thread at a time; it is not locked.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType

from kvengine.chunks.keys import ChunkKey
from kvengine.core.memory_tier import HostMemory, MemoryEntry


class Pins:
    """Pins on memory entries of one memory tier, in order, released once by whoever holds the handle."""

    __slots__ = ("_memory", "_entries")

    def __init__(self, memory: HostMemory, entries: Iterable[MemoryEntry] = ()) -> None:
        """A handle on pins already taken on ``entries`` (use the constructors below to take them)."""
        self._memory = memory
        self._entries = list(entries)

    # -- acquiring ------------------------------------------------------------------------------
    @classmethod
    def prefix(cls, memory: HostMemory, keys: Sequence[ChunkKey]) -> Pins:
        """The longest prefix of ``keys`` that ``memory`` holds, pinned."""
        return cls(memory, memory.pin_prefix(keys) if keys else ())

    @classmethod
    def of(cls, memory: HostMemory, key: ChunkKey) -> Pins:
        """Chunk ``key`` pinned, if ``memory`` holds it (else an empty handle)."""
        return cls.prefix(memory, (key,))

    @classmethod
    def commit(cls, memory: HostMemory, slots: Iterable[MemoryEntry]) -> Pins:
        """Publish prepared ``slots`` (filled), each keeping its writer's pin, now this handle's."""
        pins = cls(memory)
        for slot in slots:
            memory.commit(slot, keep_pin=True)
            pins._entries.append(slot)
        return pins

    # -- reading ---------------------------------------------------------------------------------
    @property
    def entries(self) -> Sequence[MemoryEntry]:
        """The pinned entries, in order (valid to read while this handle holds them)."""
        return self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[MemoryEntry]:
        return iter(self._entries)

    def __getitem__(self, i: int) -> MemoryEntry:
        return self._entries[i]

    def __repr__(self) -> str:
        return f"Pins({len(self._entries)} entries)"

    # -- passing on ------------------------------------------------------------------------------
    def add(self, other: Pins) -> Pins:
        """Move ``other``'s pins to the end of this handle (``other`` is left empty); this handle."""
        assert other._memory is self._memory, "pins of another memory tier"
        self._entries += other._entries
        other._entries = []
        return self

    def split(self) -> list[Pins]:
        """One handle per entry, in order; this handle is left empty."""
        handles = [Pins(self._memory, (entry,)) for entry in self._entries]
        self._entries = []
        return handles

    # -- releasing -------------------------------------------------------------------------------
    def release(self) -> None:
        """Unpin every entry still held; idempotent (a second call releases nothing)."""
        entries, self._entries = self._entries, []
        if entries:
            self._memory.unpin(entries)

    def __enter__(self) -> Pins:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def release_all(handles: Iterable[Pins]) -> None:
    """Release each of ``handles``."""
    for pins in handles:
        pins.release()


__all__ = ["Pins", "release_all"]
