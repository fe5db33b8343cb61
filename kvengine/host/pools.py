"""Shares of the host service's arena: one memory tier per tenant with a quota, one for everyone else.

A tenant given a quota (``kvengine host --quota NAME=SIZE``) gets a pool of
its own: a memory tier over a contiguous range of the shared arena, with its
own index and eviction, so its stores evict only its own chunks and another
tenant's flood never evicts them. Clients of tenants without a quota share
the rest of the arena. Pools do not see each other's chunks: a lookup is
answered from the asking client's pool only.

A pool's tier keeps offsets within its range; the service adds the pool's
``base`` when it tells a client where a chunk is (clients view the whole
arena). The service itself never reads or writes chunk bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvengine.config import MemoryConfig, check_tenant
from kvengine.core.allocator import SlabAllocator, check_physical, normalized_slab_bytes
from kvengine.core.eviction import make_policy
from kvengine.core.memory_tier import MemoryEntry, MemoryTier
from kvengine.errors import CapacityError, ConfigError
from kvengine.events import KVEventPublisher
from kvengine.host.arena import SharedArena

#: The pool of every client whose tenant has no quota.
SHARED = ""


@dataclass(frozen=True, slots=True)
class PoolStats:
    chunks: int
    used_bytes: int
    capacity_bytes: int
    evictions: int


class Pool:
    """One tenant's share (or the shared rest) of the arena."""

    def __init__(self, name: str, base: int, allocator: SlabAllocator, eviction: str,
                 events: KVEventPublisher | None = None) -> None:
        self.name = name
        self.base = base
        self.evictions = 0  # counted under the tier's lock
        self.tier = MemoryTier(allocator, make_policy(eviction), on_evict=self.evicted, events=events)

    def evicted(self, _entry: MemoryEntry) -> None:
        self.evictions += 1

    def stats(self) -> PoolStats:
        return PoolStats(len(self.tier), self.tier.used_bytes, self.tier.capacity_bytes, self.evictions)


def build_pools(memory: MemoryConfig, quotas: Mapping[str, int],
                events: KVEventPublisher | None = None) -> tuple[SharedArena, dict[str, Pool]]:
    """The shared arena of ``memory.capacity_bytes`` and its pools: each quota rounded down to whole slabs
    (at least one), the shared pool the rest (at least one slab). ``events``: where the pools publish
    their chunks' KV events.

    :raises ConfigError: a quota or the capacity cannot be had, naming which.
    """
    try:
        slab = normalized_slab_bytes(memory.effective_slab_bytes())
    except CapacityError as exc:
        raise ConfigError(f"memory.slab_bytes: {exc}") from None
    sizes: dict[str, int] = {}
    for name, quota in quotas.items():
        try:
            check_tenant(name)
        except ValueError as exc:
            raise ConfigError(f"quota {name!r}: {exc}") from None
        if quota < slab:
            raise ConfigError(f"quota {name}={quota} B is below one slab ({slab} B)")
        sizes[name] = quota // slab * slab
    total = int(memory.capacity_bytes) // slab * slab
    rest = total - sum(sizes.values())
    if rest < slab:
        raise ConfigError(f"the quotas ({sum(sizes.values())} B) leave less than one slab ({slab} B) of the "
                          f"{total} B arena for tenants without one")
    sizes[SHARED] = rest
    try:
        check_physical(total)
        arena = SharedArena.create(total)
    except CapacityError as exc:
        raise ConfigError(f"memory.capacity_bytes: {exc}") from None
    pools: dict[str, Pool] = {}
    base = 0
    for name, size in sizes.items():
        def share(nbytes: int, start: int = base) -> torch.Tensor:
            return arena.tensor[start : start + nbytes]

        # No prefault here: the arena was allocated whole (zero-filled) when it was created; touching it
        # again would only cost start-up time. ``memory.prefault`` is the clients' to act on (HELLO).
        allocator = SlabAllocator(size, slab, arena=share)
        pools[name] = Pool(name, base, allocator, memory.eviction, events)
        base += size
    return arena, pools
