"""Connections per peer for wires that carry one request per connection at a time (tcp, UCX).

:meth:`ConnectionPool.call` takes an idle connection to the peer (or opens
one), runs one request on it, and puts it back only if the request
completed. A request that timed out, failed or got no answer closes its
connection, so a late reply can never be taken for a later request's. At
most ``size`` requests per peer are in flight; more wait within their
timeout. Faults are counted and answered with None, never raised.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from .placement import Peer


class PooledConnection(Protocol):
    @property
    def closed(self) -> bool: ...

    async def close(self) -> None: ...


C = TypeVar("C", bound=PooledConnection)
T = TypeVar("T")


class ConnectionPool(Generic[C]):
    def __init__(self, size: int, connect: Callable[[Peer], Awaitable[C]], counts: Counter[str]) -> None:
        self.size = size
        self._connect = connect
        self.counts = counts
        self._idle: dict[Peer, list[C]] = {}
        self._slots: dict[Peer, asyncio.Semaphore] = {}

    async def call(self, peer: Peer, timeout: float, use: Callable[[C], Awaitable[T | None]],
                   failures: tuple[type[BaseException], ...]) -> T | None:
        """``use(connection)``'s result within ``timeout``, or None (timed out, failed with one of
        ``failures``, or ``use`` returned None); the connection is kept only after a result."""
        slots = self._slots.setdefault(peer, asyncio.Semaphore(self.size))
        conn: C | None = None
        try:
            async with asyncio.timeout(timeout), slots:
                conn = await self._take(peer)
                result = await use(conn)
            if result is not None:
                self._idle.setdefault(peer, []).append(conn)
                conn = None
            return result
        except TimeoutError:
            self.counts["timeouts"] += 1
            return None
        except failures as exc:
            self.counts[f"error_{type(exc).__name__}"] += 1
            return None
        finally:
            if conn is not None:
                await conn.close()

    async def _take(self, peer: Peer) -> C:
        idle = self._idle.setdefault(peer, [])
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
            await conn.close()
        return await self._connect(peer)

    async def forget(self, peer: Peer) -> None:
        """Close the idle connections to ``peer`` (it left the membership)."""
        for conn in self._idle.pop(peer, []):
            await conn.close()

    async def close(self) -> None:
        for peer in list(self._idle):
            await self.forget(peer)
