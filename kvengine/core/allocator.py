"""Slab allocator over one fixed host arena.

The arena is split into equal slabs. A slab serves one size class at a time:
the class of an object of ``n`` bytes (rounded up to ``ALIGN``) is
``k = slab_bytes // n`` slots per slab, each slot ``slab_bytes // k`` bytes
rounded down to ``ALIGN``, so internal waste is below one object per slab and
every slot starts ``ALIGN``-aligned (typed views need aligned offsets). Slots
of ``LARGE_SLOT`` bytes or more are rounded to whole pages and start on a page
boundary (the arena and slabs are page-aligned), so direct I/O can write and
read them in place.
A slab that empties returns to the shared free list and can take any class next, so free memory never stays stranded in a class: the
pool does not fragment over time, whatever mix of sizes it sees.

The arena is allocated up front; an arena larger than the machine's physical
memory, or one the system refuses, is a :class:`CapacityError` naming its size.

Not thread-safe: the owning tier serialises calls.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import torch

from kvengine.errors import CapacityError

ALIGN = 64
PAGE = 4096
#: Slots at least this large are page-aligned (waste under 1/16 of a slot).
LARGE_SLOT = 16 * PAGE


class _Slab:
    __slots__ = ("slots_per_slab", "free", "fresh", "used")

    def __init__(self, slots_per_slab: int) -> None:
        self.slots_per_slab = slots_per_slab
        self.free: list[int] = []  # returned slots
        self.fresh = 0  # slots [fresh, slots_per_slab) were never handed out
        self.used = 0

    def take(self) -> int:
        self.used += 1
        if self.free:
            return self.free.pop()
        self.fresh += 1
        return self.fresh - 1

    @property
    def full(self) -> bool:
        return self.used == self.slots_per_slab


class SlabAllocator:
    def __init__(
        self, capacity_bytes: int, slab_bytes: int, *, pin_memory: bool = False, prefault: bool = False,
        arena: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """``arena(nbytes)`` provides the memory (default: private anonymous, or page-locked with
        ``pin_memory``): a page-aligned uint8 tensor of ``nbytes`` at storage offset 0 (typed views index
        the storage). The host service's pools pass slices of one arena instead: they use offsets only."""
        slab_bytes = normalized_slab_bytes(slab_bytes)
        if capacity_bytes < slab_bytes:
            raise CapacityError(f"capacity {capacity_bytes} B must hold at least one slab of {slab_bytes} B")
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity_bytes // slab_bytes
        self.capacity_bytes = self.num_slabs * slab_bytes
        check_physical(self.capacity_bytes)
        self.arena = arena(self.capacity_bytes) if arena is not None else _page_aligned_empty(self.capacity_bytes,
                                                                                                pin_memory)
        if prefault:
            self.arena.zero_()
        self._typed: dict[torch.dtype, torch.Tensor] = {torch.uint8: self.arena}
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._slabs: dict[int, _Slab] = {}
        # size class (slots per slab) -> slabs of that class with a free slot
        self._partial: dict[int, set[int]] = {}
        #: requested bytes -> (slots per slab, slot bytes) of its size class
        self._classes: dict[int, tuple[int, int]] = {}
        self.used_bytes = 0

    def slot_bytes(self, nbytes: int) -> int:
        """Bytes actually reserved for an object of ``nbytes``."""
        return self._slot_size(self._slots_per_slab(nbytes))

    def _slot_size(self, slots_per_slab: int) -> int:
        size = self.slab_bytes // slots_per_slab
        return _round_down(size, PAGE if size >= LARGE_SLOT else ALIGN)

    def _slots_per_slab(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise CapacityError(f"allocation size must be positive, got {nbytes}")
        grain = PAGE if nbytes >= LARGE_SLOT else ALIGN
        aligned = -(-nbytes // grain) * grain
        if aligned > self.slab_bytes:
            raise CapacityError(
                f"object of {nbytes} B exceeds the memory slab size {self.slab_bytes} B; "
                f"raise memory.slab_bytes"
            )
        return self.slab_bytes // aligned

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a slot of at least ``nbytes`` (:meth:`slot_size_at` its size), or None when the
        arena is full for that class.

        An allocation is only its offset: its slab and slot follow from it (an int per cached chunk
        instead of an object: the index of a million chunks is smaller by about 100 MB).
        """
        size_class = self._classes.get(nbytes)
        if size_class is None:  # a few sizes recur (one per layout): remember their class and slot size
            k = self._slots_per_slab(nbytes)
            size_class = (k, self._slot_size(k))
            if len(self._classes) < 64:
                self._classes[nbytes] = size_class
        k, size = size_class
        partial = self._partial.setdefault(k, set())
        if partial:
            slab_id = next(iter(partial))
        elif self._free_slabs:
            slab_id = self._free_slabs.pop()
            self._slabs[slab_id] = _Slab(k)
            partial.add(slab_id)
        else:
            return None
        slab = self._slabs[slab_id]
        slot = slab.take()
        if slab.full:
            partial.discard(slab_id)
        self.used_bytes += size
        return slab_id * self.slab_bytes + slot * size

    def slot_size_at(self, offset: int) -> int:
        """Bytes reserved by the allocation at ``offset``."""
        return self._slot_size(self._slabs[offset // self.slab_bytes].slots_per_slab)

    def free(self, offset: int) -> None:
        slab_id, within = divmod(offset, self.slab_bytes)
        slab = self._slabs[slab_id]
        k = slab.slots_per_slab
        size = self._slot_size(k)
        slab.free.append(within // size)
        slab.used -= 1
        self.used_bytes -= size
        if slab.used == 0:
            del self._slabs[slab_id]
            self._partial[k].discard(slab_id)
            self._free_slabs.append(slab_id)
        else:
            self._partial[k].add(slab_id)

    def release(self) -> None:
        """Give the arena's memory back now (not at garbage collection); the allocator is unusable after."""
        self.arena = torch.empty(0, dtype=torch.uint8)
        self._typed = {}
        self._free_slabs = []
        self._partial = {}

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole arena viewed as ``dtype`` (slots are aligned for every dtype)."""
        arena = self._typed.get(dtype)
        if arena is None:
            arena = self._typed[dtype] = self.arena.view(dtype)
        return arena

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the slot at ``offset`` as a flat uint8 tensor."""
        return self.arena[offset : offset + nbytes]


def normalized_slab_bytes(slab_bytes: int) -> int:
    """The slab an allocator asked for ``slab_bytes`` uses (rounded down to its alignment grain).

    :raises CapacityError: below the smallest slab.
    """
    if slab_bytes < ALIGN:
        raise CapacityError(f"a slab must be at least {ALIGN} B, got {slab_bytes} B")
    return _round_down(slab_bytes, PAGE if slab_bytes >= LARGE_SLOT else ALIGN)


def _round_down(n: int, grain: int) -> int:
    return n // grain * grain


def _page_aligned_empty(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` on page boundaries, at storage offset 0 (views index the storage).

    torch only promises 64-byte alignment; CUDA's pinned host allocator and
    anonymous mappings give whole pages.

    :raises CapacityError: the system refuses the allocation.
    """
    try:
        if pin_memory:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        # Private: a forked child gets a copy-on-write view, never a window into this cache.
        return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
    except (OSError, RuntimeError) as exc:  # mmap: ENOMEM; CUDA's pinned allocator: RuntimeError
        raise CapacityError(f"cannot allocate a host arena of {_human(nbytes)}: {exc}") from None


def check_physical(nbytes: int) -> None:
    """Refuse an arena larger than physical memory (an anonymous mapping may be granted lazily, and fail
    only when touched) with a :class:`CapacityError` naming both sizes."""
    physical = physical_memory_bytes()
    if physical is not None and nbytes > physical:
        raise CapacityError(f"a host arena of {_human(nbytes)} exceeds this machine's physical memory "
                            f"({_human(physical)})")


def physical_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        return None


def _human(nbytes: int) -> str:
    """``nbytes`` in binary units, e.g. "64.0 TiB"."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}" if unit != "B" else f"{nbytes} B"
