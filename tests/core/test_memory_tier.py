"""Memory tier: pins block eviction, LRU order protects prefix heads, two-phase stores."""

from __future__ import annotations

from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace
from kvengine.core.allocator import SlabAllocator
from kvengine.core.eviction import LRUPolicy
from kvengine.core.memory_tier import MemoryEntry, MemoryTier, Prepared

from ..conftest import make_layout

NS = Namespace(model="m").digest()
LAYOUT = make_layout()
SIZE = LAYOUT.nbytes()


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, ChunkHash(i.to_bytes(16, "little")))


def tier(n_chunks: int) -> MemoryTier:
    return MemoryTier(SlabAllocator(n_chunks * SIZE, SIZE), LRUPolicy())


def put(t: MemoryTier, i: int) -> bool:
    entry = t.prepare(key(i), LAYOUT, (0, 16))
    if isinstance(entry, Prepared):
        return False
    t.commit(entry)
    return True


def test_pinned_entries_survive_pressure():
    """With every slot pinned, a store is refused instead of evicting pinned data."""
    t = tier(2)
    assert put(t, 0) and put(t, 1)
    pinned = t.pin_prefix([key(0), key(1)])
    assert t.prepare(key(2), LAYOUT, (0, 16)) is Prepared.NO_ROOM
    assert t.contains(key(0)) and t.contains(key(1))
    t.unpin(pinned)
    assert put(t, 2) and t.used_bytes <= t.capacity_bytes


def test_prepared_entry_invisible_until_commit():
    """A prepared entry is neither contained nor pinnable until committed, is PRESENT to a second prepare, and
    abort frees its bytes."""
    t = tier(2)
    entry = t.prepare(key(0), LAYOUT, (0, 16))
    assert isinstance(entry, MemoryEntry) and not t.contains(key(0)) and t.pin_prefix([key(0)]) == []
    assert t.prepare(key(0), LAYOUT, (0, 16)) is Prepared.PRESENT
    t.abort(entry)
    assert len(t) == 0 and t.used_bytes == 0


def test_prefix_head_evicted_last():
    """Looking up a prefix touches it tail-first, so LRU evicts the tail before the head."""
    t = tier(3)
    for i in range(3):
        put(t, i)
    t.unpin(t.pin_prefix([key(0), key(1), key(2)]))
    put(t, 3)
    assert t.contains(key(0)) and t.contains(key(1)) and not t.contains(key(2))


def test_typed_views_alias_memory():
    """An entry's typed tensors have the layout's shapes and alias its raw bytes: a write through a view is in
    memory."""
    t = tier(1)
    entry = t.prepare(key(0), LAYOUT, (0, 16))
    views = t.tensors(entry)
    views[0].fill_(1.5)
    t.commit(entry)
    assert [tuple(v.shape) for v in views] == [(2, 2, 16, 4)] * 2
    assert t.raw(entry)[:4].view(__import__("torch").float32).item() == 1.5
