"""Slab allocator: capacity bound, reuse of emptied slabs across size classes."""

from __future__ import annotations

import os
import random

import pytest

from kvengine.core.allocator import ALIGN, LARGE_SLOT, PAGE, SlabAllocator
from kvengine.errors import CapacityError


def test_capacity_never_exceeded_and_slots_disjoint():
    """Allocating until refused: slots never overlap, stay aligned and within capacity, and every slab is filled."""
    a = SlabAllocator(1 << 20, 1 << 16)
    allocs = []
    while (x := a.allocate(5000)) is not None:
        allocs.append(x)
    assert a.used_bytes <= a.capacity_bytes
    spans = sorted((x, x + a.slot_size_at(x)) for x in allocs)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= a.capacity_bytes
    assert len(allocs) == 16 * (65536 // (-(-5000 // ALIGN) * ALIGN))
    assert all(x % ALIGN == 0 for x in allocs)


def test_no_fragmentation_after_mixed_churn():
    """After any churn, freeing everything lets the arena serve its full capacity in one class."""
    a = SlabAllocator(1 << 20, 1 << 16)
    rng = random.Random(0)
    live = []
    for _ in range(5000):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            x = a.allocate(rng.choice([100, 3000, 20000, 65536]))
            if x is not None:
                live.append(x)
        assert a.used_bytes <= a.capacity_bytes
    for x in live:
        a.free(x)
    assert a.used_bytes == 0
    big = [a.allocate(65536) for _ in range(16)]
    assert all(b is not None for b in big) and a.allocate(1) is None


def test_oversized_object_is_refused_clearly():
    """An object larger than a slab, or an arena smaller than one slab, is a CapacityError (naming the slab)."""
    a = SlabAllocator(1 << 20, 1 << 16)
    with pytest.raises(CapacityError, match="slab"):
        a.allocate((1 << 16) + 1)
    with pytest.raises(CapacityError):
        SlabAllocator(100, 1 << 16)


def test_large_slots_are_page_aligned_small_ones_stay_dense():
    """Slots of >= 64 KiB start on page boundaries (in memory too: direct I/O writes them in place);
    small objects keep the 64-byte grain, so a slab still holds as many of them."""
    a = SlabAllocator(8 << 20, 1 << 20)
    assert a.arena.data_ptr() % PAGE == 0 and a.arena.storage_offset() == 0
    large = [a.allocate(LARGE_SLOT + 1000) for _ in range(6)]
    assert all(x is not None and (a.arena.data_ptr() + x) % PAGE == 0 for x in large)
    sizes = [a.slot_size_at(x) for x in large if x is not None]
    assert all(n % PAGE == 0 and n >= LARGE_SLOT + 1000 for n in sizes)
    small = [a.allocate(100) for _ in range(10)]
    assert all(x is not None and a.slot_size_at(x) == 128 for x in small)


def test_a_forked_child_cannot_write_into_the_parents_arena():
    """The arena is private memory: a child forked after it was allocated (e.g. by a multiprocessing
    engine) writes into its own copy, never into the parent's cache."""
    a = SlabAllocator(1 << 20, 1 << 16, prefault=True)
    pid = os.fork()
    if pid == 0:  # child
        a.arena[:4096] = 7
        os._exit(0 if int(a.arena[0]) == 7 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(a.arena[:4096].max()) == 0
