"""Receive buffers for large records, recycled once nothing refers to them.

A fresh buffer costs the kernel a page fault and a zero-fill for every page
on first write: for a 32 MiB record that is a few milliseconds, as long as
the transfer itself over shared memory. :class:`BufferPool` hands out
buffers (numpy arrays, huge-page backed) and takes each back when the last
reference to it -- the record the transport returned, any view or array
made from it -- is gone, so steady-state reads reuse warm memory.

Safe by reference counting: a buffer is reused only after its lease object
is finalised, which the buffer protocol guarantees happens after every
consumer has released it. Up to ``capacity_bytes`` of idle buffers are
kept; beyond that they are freed. Records below ``min_bytes`` are not pooled
(small allocations are cheap).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

_ALIGN = 2 << 20  # huge page: size classes are multiples of it


class _Lease(np.ndarray):
    """A pooled buffer on loan; returns it to its pool when finalised."""

    _release: Callable[[], None] | None = None

    def __del__(self) -> None:
        release = self._release
        if release is not None:
            self._release = None
            release()


class BufferPool:
    def __init__(self, capacity_bytes: int = 256 << 20, min_bytes: int = 1 << 20) -> None:
        self.capacity_bytes = capacity_bytes
        self.min_bytes = min_bytes
        self.idle_bytes = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` (contents undefined)."""
        if nbytes < self.min_bytes:
            return np.empty(nbytes, dtype=np.uint8)
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            idle = self._free.get(size)
            base = idle.pop() if idle else None
            if base is not None:
                self.idle_bytes -= size
        if base is None:
            base = np.empty(size, dtype=np.uint8)
        lease = base[:nbytes].view(_Lease)
        lease._release = lambda: self._give_back(base)
        return lease

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            if self.idle_bytes + base.nbytes <= self.capacity_bytes:
                self._free.setdefault(base.nbytes, []).append(base)
                self.idle_bytes += base.nbytes


#: The pool peer transports receive into (one per process, like the allocator it stands in for).
RECEIVE_BUFFERS = BufferPool()
