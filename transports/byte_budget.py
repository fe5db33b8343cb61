"""A budget of bytes held at once, shared by whoever moves records: the peer client's writes in flight,
the tcp server's payloads being received.

Takers are served first come, first served (a large taker is not starved by a stream of small ones);
a taker larger than the whole budget holds all of it. Not thread-safe: one event loop uses it.
"""

from __future__ import annotations

import asyncio


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free = limit
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def try_take(self, nbytes: int) -> bool:
        """Take ``nbytes`` now if they fit and nobody waits before; give them back with :meth:`give`."""
        need = min(nbytes, self.limit)
        if self._waiters or need > self.free:
            return False
        self.free -= need
        return True

    async def take(self, nbytes: int, timeout: float | None = None) -> bool:
        """Take ``nbytes``, waiting in turn; False if they did not come within ``timeout``."""
        if self.try_take(nbytes):
            return True
        entry = (min(nbytes, self.limit), asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await entry[1]
            return True
        except TimeoutError:
            self._withdraw(entry)
            return False
        except BaseException:
            self._withdraw(entry)
            raise

    def give(self, nbytes: int) -> None:
        """Give back bytes taken; waiters that now fit are served in turn."""
        self.free += min(nbytes, self.limit)
        while self._waiters and self._waiters[0][0] <= self.free:
            need, future = self._waiters.pop(0)
            if not future.done():  # else its taker was cancelled (a timeout) and is leaving the line
                self.free -= need
                future.set_result(None)

    def _withdraw(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """A taker that stopped waiting: out of the line, or, if it was served meanwhile, its bytes back."""
        if entry in self._waiters:
            self._waiters.remove(entry)
        elif entry[1].done() and not entry[1].cancelled():
            self.give(entry[0])
