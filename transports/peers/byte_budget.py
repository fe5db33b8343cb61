"""Budgets of bytes held at once by whoever moves records.

* :class:`ByteBudget` -- one taker's bytes in flight (the peer client's writes). Takers are served first
  come, first served (a large taker is not starved by a stream of small ones); a taker larger than the
  whole budget holds all of it.
* :class:`SharedByteBudget` -- bytes shared by clients that do not trust each other (the tcp server's
  payloads being received): each client holds at most its share, so one that announces a payload and
  sends nothing cannot keep the others waiting.

Neither is thread-safe: one event loop uses each.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Callable


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


class Grant(enum.Enum):
    """What a client asking :class:`SharedByteBudget` for bytes got."""

    TAKEN = "taken"
    #: More than the client's share: refused at once (waiting would not help).
    OVER_SHARE = "over_share"
    TIMED_OUT = "timed_out"


class SharedByteBudget:
    """A budget of bytes shared by clients, none of which holds more than its share.

    A client's share is ``limit // clients`` (clients: those connected, as ``clients()`` counts them), but
    never below ``min_share`` and never above half the budget: whichever client holds its whole share, the
    others always find at least half the budget beyond it. A request larger than the share is refused at once
    (:attr:`Grant.OVER_SHARE`); one that fits the share but not what its client has left waits on its own
    client's bytes and blocks nobody; one that fits its client's share but not the free bytes waits in line,
    first come first served (a large request is not starved by a stream of small ones). Shares are
    computed when bytes are taken: a client that holds more than a share shrunk since (clients joined) keeps
    it until it gives it back. Not thread-safe: one event loop uses it.
    """

    def __init__(self, limit: int, *, min_share: int, clients: Callable[[], int]) -> None:
        if limit < 1 or min_share < 1:
            raise ValueError("a shared byte budget and its minimum share must be positive")
        self.limit = limit
        self.free = limit
        self.min_share = min_share
        self._clients = clients
        self._held: Counter[bytes] = Counter()
        self._waiters: list[tuple[bytes, int, asyncio.Future[Grant]]] = []

    def share(self) -> int:
        """The most one client may hold now."""
        half = max(1, self.limit // 2)
        return min(half, max(self.min_share, self.limit // max(1, self._clients())))

    def held(self, client: bytes) -> int:
        return self._held[client]

    def try_take(self, client: bytes, nbytes: int) -> bool:
        """Take ``nbytes`` for ``client`` now if they fit its share and the free bytes, and nobody within
        their share waits before; give them back with :meth:`give`."""
        share = self.share()
        if self._held[client] + nbytes > share or nbytes > self.free or self._line_blocked(share):
            return False
        self._grant(client, nbytes)
        return True

    async def take(self, client: bytes, nbytes: int, timeout: float | None = None) -> Grant:
        """Take ``nbytes`` for ``client``, waiting in turn up to ``timeout``."""
        if nbytes > self.share():
            return Grant.OVER_SHARE
        if self.try_take(client, nbytes):
            return Grant.TAKEN
        entry = (client, nbytes, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                return await entry[2]
        except TimeoutError:
            self._withdraw(entry)
            return Grant.TIMED_OUT
        except BaseException:
            self._withdraw(entry)
            raise

    def give(self, client: bytes, nbytes: int) -> None:
        """Give back bytes ``client`` took; waiters that now fit are served in turn."""
        self.free += nbytes
        self._held[client] -= nbytes
        if self._held[client] <= 0:
            del self._held[client]
        self.reshare()

    def reshare(self) -> None:
        """Serve the waiters that fit now (after bytes came back, or the number of clients changed); refuse
        those larger than the share has become."""
        share = self.share()
        for entry in list(self._waiters):
            client, need, future = entry
            if future.done():  # its taker was cancelled (a timeout) and is leaving the line
                self._waiters.remove(entry)
            elif need > share:
                self._waiters.remove(entry)
                future.set_result(Grant.OVER_SHARE)
            elif self._held[client] + need > share:
                continue  # waits for its own client's bytes: blocks no one else
            elif need > self.free:
                break  # first in line: those behind it wait too
            else:
                self._waiters.remove(entry)
                self._grant(client, need)
                future.set_result(Grant.TAKEN)

    def _line_blocked(self, share: int) -> bool:
        """Someone within their client's share is waiting for free bytes."""
        return any(not f.done() and self._held[c] + n <= share for c, n, f in self._waiters)

    def _grant(self, client: bytes, nbytes: int) -> None:
        self.free -= nbytes
        self._held[client] += nbytes

    def _withdraw(self, entry: tuple[bytes, int, asyncio.Future[Grant]]) -> None:
        """A taker that stopped waiting: out of the line, or, if it was served meanwhile, its bytes back."""
        if entry in self._waiters:
            self._waiters.remove(entry)
            self.reshare()  # it may have been first in line
        elif entry[2].done() and not entry[2].cancelled() and entry[2].result() is Grant.TAKEN:
            self.give(entry[0], entry[1])
