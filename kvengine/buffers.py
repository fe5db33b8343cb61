"""Recycled buffers for large reads: the one pool every tier and wire reads records into.

Touching freshly allocated memory costs a page fault per 4 KiB page; on small
VMs that is ~1 GB/s, as slow as the disk itself, so a read into a new 32 MiB
buffer takes twice as long as one into a warm buffer. :class:`BufferPool`
hands out views of already-faulted anonymous mappings and takes a mapping
back automatically once the caller has dropped every view derived from it
(the view's exporter is a numpy array with a ``weakref.finalize``; views,
slices, numpy arrays and ``torch.frombuffer`` tensors all keep it alive).
The caller never returns anything explicitly: a buffer is reused only once
nothing refers to it, so a record still held is never overwritten.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

#: Reads below this size get a fresh array, not a pooled mapping (faults are cheap there).
POOL_MIN_BYTES = 1 << 20
_GRAIN = 1 << 20


class BufferPool:
    """Thread-safe; keeps at most ``max_idle_bytes`` of idle mappings."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[mmap.mmap]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes (contents undefined)."""
        return self.take_array(size).data

    def take_array(self, size: int) -> np.ndarray:
        """:meth:`take` as a writable uint8 array (for callers that need its address or an array type)."""
        if size < POOL_MIN_BYTES or self.max_idle_bytes <= 0:
            return np.empty(size, dtype=np.uint8)
        capacity = -(-size // _GRAIN) * _GRAIN
        with self._lock:
            free = self._idle.get(capacity)
            if free:
                mapping = free.pop()
                self._idle_bytes -= capacity
            else:
                mapping = None
        if mapping is None:
            mapping = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE)  # copy-on-write across fork
        exporter = np.frombuffer(mapping, dtype=np.uint8)
        weakref.finalize(exporter, self._give_back, mapping, capacity).atexit = False
        return exporter[:size]  # a view of ``exporter``: it lives as long as any view made from this one

    def _give_back(self, mapping: mmap.mmap, capacity: int) -> None:
        with self._lock:
            if self._idle_bytes + capacity <= self.max_idle_bytes:
                self._idle.setdefault(capacity, []).append(mapping)
                self._idle_bytes += capacity
        # otherwise dropped here; the mapping is unmapped once its last export goes
