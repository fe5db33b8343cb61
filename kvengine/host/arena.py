"""A host arena in shared memory: created by the service, mapped by its clients.

The arena is an anonymous memory file (``memfd``): it has no name to find or
to leave behind, and it lives exactly as long as a process holds it (the
service, or a client still reading pinned chunks of a service that died).
Clients receive its descriptor over the service's Unix socket.
"""

from __future__ import annotations

import mmap
import os

import torch

from kvengine.errors import CapacityError


class SharedArena:
    """``nbytes`` of shared memory as a flat uint8 tensor (page-aligned, at storage offset 0)."""

    def __init__(self, fd: int, nbytes: int, *, populate: bool = False) -> None:
        """Map ``fd``; ``populate`` maps every page in now (for an arena whose pages all exist already:
        its first copies then take no page faults)."""
        self.fd = fd
        self.nbytes = nbytes
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        try:
            self._map = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise CapacityError(f"cannot map a shared arena of {nbytes} B: {exc}") from None
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int) -> SharedArena:
        """A new zero-filled arena, its memory allocated (see :class:`CapacityError`: it cannot be)."""
        try:
            fd = os.memfd_create("kvengine-arena", os.MFD_CLOEXEC)
        except (AttributeError, OSError) as exc:  # not Linux, or no memfd
            raise CapacityError(f"cannot create a shared-memory arena on this system: {exc}") from None
        try:
            # Allocated now, not as pages are first written: a shared page that cannot be had later is a
            # SIGBUS in whichever client touches it, so a service that cannot hold its arena refuses to start.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            raise CapacityError(f"cannot allocate a shared arena of {nbytes} B: {exc}") from None
        return cls(fd, nbytes)

    def close(self) -> None:
        """Close the descriptor. The mapping goes when the last tensor viewing it does (a reader still
        copying a pinned chunk out never faults)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
