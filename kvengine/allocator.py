"""Slab allocator over one fixed host arena.

The arena is split into equal slabs. A slab serves one size class at a time:
the class of an object of ``n`` bytes is ``k = slab_bytes // n`` slots per
slab, each slot ``slab_bytes // k`` bytes, so internal waste is below one
object per slab. A slab that empties returns to the shared free list and can
take any class next, so free memory never stays stranded in a class: the
pool does not fragment over time, whatever mix of sizes it sees.

Not thread-safe: the owning tier serialises calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import CapacityError


@dataclass(frozen=True, slots=True)
class Allocation:
    slab: int
    slot: int
    offset: int
    nbytes: int  # slot size actually reserved (>= requested)


class _Slab:
    __slots__ = ("slots_per_slab", "free", "used")

    def __init__(self, slots_per_slab: int) -> None:
        self.slots_per_slab = slots_per_slab
        self.free = list(range(slots_per_slab - 1, -1, -1))
        self.used = 0


class SlabAllocator:
    def __init__(self, capacity_bytes: int, slab_bytes: int, *, pin_memory: bool = False) -> None:
        if slab_bytes <= 0 or capacity_bytes < slab_bytes:
            raise CapacityError(f"capacity {capacity_bytes} B must hold at least one slab of {slab_bytes} B")
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity_bytes // slab_bytes
        self.capacity_bytes = self.num_slabs * slab_bytes
        self.arena = torch.empty(self.capacity_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._slabs: dict[int, _Slab] = {}
        # size class (slots per slab) -> slabs of that class with a free slot
        self._partial: dict[int, set[int]] = {}
        self.used_bytes = 0

    def slot_bytes(self, nbytes: int) -> int:
        """Bytes actually reserved for an object of ``nbytes``."""
        return self.slab_bytes // self._slots_per_slab(nbytes)

    def _slots_per_slab(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise CapacityError(f"allocation size must be positive, got {nbytes}")
        if nbytes > self.slab_bytes:
            raise CapacityError(
                f"object of {nbytes} B exceeds the memory slab size {self.slab_bytes} B; "
                f"raise memory.slab_bytes"
            )
        return self.slab_bytes // nbytes

    def allocate(self, nbytes: int) -> Allocation | None:
        """A slot of at least ``nbytes``, or None when the arena is full for that class."""
        k = self._slots_per_slab(nbytes)
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
        slot = slab.free.pop()
        slab.used += 1
        if not slab.free:
            partial.discard(slab_id)
        size = self.slab_bytes // k
        self.used_bytes += size
        return Allocation(slab_id, slot, slab_id * self.slab_bytes + slot * size, size)

    def free(self, alloc: Allocation) -> None:
        slab = self._slabs[alloc.slab]
        k = slab.slots_per_slab
        slab.free.append(alloc.slot)
        slab.used -= 1
        self.used_bytes -= alloc.nbytes
        if slab.used == 0:
            del self._slabs[alloc.slab]
            self._partial[k].discard(alloc.slab)
            self._free_slabs.append(alloc.slab)
        else:
            self._partial[k].add(alloc.slab)

    def view(self, alloc: Allocation, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of a slot as a flat uint8 tensor."""
        return self.arena[alloc.offset : alloc.offset + nbytes]
