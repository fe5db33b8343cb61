"""Eviction policies for the memory tier.

A policy only orders keys; the tier decides which candidates are evictable
(unpinned, committed) and skips the rest. Policies are not thread-safe: the
tier calls them under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def inserted(self, key: Hashable) -> None: ...
    def accessed(self, key: Hashable) -> None: ...
    def removed(self, key: Hashable) -> None: ...
    def candidates(self) -> Iterator[Hashable]:
        """Keys in eviction order (may include pinned ones). Do not mutate while iterating."""
        ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def inserted(self, key: Hashable) -> None:
        self._order[key] = None

    def accessed(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def removed(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        return iter(self._order)


class FIFOPolicy:
    """Oldest insertion first; hits do not reorder (cheap, scan-resistant enough for tests)."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def inserted(self, key: Hashable) -> None:
        self._order[key] = None

    def accessed(self, key: Hashable) -> None:
        pass

    def removed(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        return iter(self._order)


POLICIES: dict[str, type[LRUPolicy] | type[FIFOPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    return POLICIES[name]()
