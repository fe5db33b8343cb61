"""The one buffer pool tiers and wires read records into (kvengine.buffers)."""

from __future__ import annotations

import gc

import numpy as np

from kvengine.buffers import BufferPool

MiB = 1 << 20


def test_a_buffer_is_reused_only_once_nothing_refers_to_it() -> None:
    """A record still referenced, even through an array made from a view of it, is never handed out again;
    once nothing refers to it, its mapping comes back warm and is reused, not allocated."""
    pool = BufferPool(8 * MiB)
    first = pool.take_array(3 * MiB)
    first[:4] = [1, 2, 3, 4]
    record = first.data.toreadonly()  # what a transport hands out
    del first
    view = np.frombuffer(record, dtype=np.uint8)[:4]
    del record
    second = pool.take(3 * MiB)  # the first buffer is still referenced by `view`
    second[:4] = bytes(4)
    assert list(view) == [1, 2, 3, 4]
    del view, second
    gc.collect()
    assert pool.idle_bytes == 6 * MiB  # both came back
    held = pool.take_array(3 * MiB)
    assert pool.idle_bytes == 3 * MiB and held.nbytes == 3 * MiB  # one idle buffer reused
    assert pool.take(100).nbytes == 100 and pool.idle_bytes == 3 * MiB  # small: not pooled


def test_idle_buffers_beyond_the_cap_are_dropped() -> None:
    pool = BufferPool(4 * MiB)
    taken = [pool.take(3 * MiB) for _ in range(3)]
    del taken
    gc.collect()
    assert pool.idle_bytes == 3 * MiB  # one kept; the other two would pass the 4 MiB cap
