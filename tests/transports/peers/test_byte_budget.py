"""The byte budgets: the peer client's writes in flight, and the tcp server's receives shared by its clients."""

from __future__ import annotations

import asyncio

from kvengine.transports.peers.byte_budget import ByteBudget, Grant, SharedByteBudget


async def test_takers_are_served_in_turn_and_one_larger_than_the_budget_holds_all_of_it() -> None:
    """First come, first served: a small taker behind a large one waits for it; a taker larger than the
    budget gets the whole budget; every byte comes back."""
    budget = ByteBudget(100)
    assert budget.try_take(60)
    large = asyncio.ensure_future(budget.take(500))  # waits for all 100
    await asyncio.sleep(0)
    assert not budget.try_take(10)  # fits, but the large taker is first in line
    small = asyncio.ensure_future(budget.take(10))
    budget.give(60)
    assert await large and not small.done()
    budget.give(500)
    assert await small and budget.free == 90
    budget.give(10)
    assert budget.free == 100


async def test_a_taker_that_times_out_leaves_the_line_and_holds_nothing() -> None:
    """A taker that times out gets False, holds no bytes and blocks no later taker."""
    budget = ByteBudget(100)
    assert budget.try_take(100)
    assert not await budget.take(50, timeout=0.01)
    budget.give(100)
    assert budget.free == 100 and budget.try_take(100)


def _shared(limit: int, clients: int, min_share: int = 1) -> SharedByteBudget:
    return SharedByteBudget(limit, min_share=min_share, clients=lambda: clients)


def test_a_clients_share_is_an_equal_part_of_the_budget_at_most_half_and_at_least_the_minimum() -> None:
    """Alone a client may hold half the budget; with more clients an equal part, never below ``min_share``
    (itself capped at half)."""
    assert _shared(100, 1).share() == 50
    assert _shared(100, 4).share() == 25
    assert _shared(100, 50, min_share=10).share() == 10
    assert _shared(100, 50, min_share=80).share() == 50


async def test_a_client_beyond_its_share_is_refused_at_once_and_one_at_its_share_blocks_no_one_else() -> None:
    """A request larger than the share is refused without waiting; a client holding its whole share waits on
    its own bytes while another client takes the rest at once, and its request is served when it gives back."""
    budget = _shared(100, 2)
    assert await budget.take(b"hog", 60, timeout=5) is Grant.OVER_SHARE
    assert budget.try_take(b"hog", 50)
    second = asyncio.ensure_future(budget.take(b"hog", 10, timeout=5))
    await asyncio.sleep(0)
    assert not second.done()
    assert budget.try_take(b"honest", 50)  # the hog's waiting request does not stand in its way
    budget.give(b"hog", 50)
    assert await second is Grant.TAKEN
    assert budget.held(b"hog") == 10 and budget.free == 40


async def test_a_request_that_fits_its_share_but_not_the_free_bytes_is_first_in_line() -> None:
    """First come, first served among requests within their client's share: a large one is not starved by
    smaller ones that would fit."""
    budget = _shared(100, 4, min_share=50)
    assert budget.try_take(b"a", 50) and budget.try_take(b"b", 40)
    large = asyncio.ensure_future(budget.take(b"c", 30, timeout=5))
    await asyncio.sleep(0)
    assert not budget.try_take(b"d", 5)  # it fits, but c is first in line
    budget.give(b"a", 50)
    assert await large is Grant.TAKEN and budget.free == 30


async def test_waiters_are_refused_when_clients_join_and_shares_shrink() -> None:
    """A waiting request larger than the share it would now get (more clients connected) is refused, not left
    waiting until its deadline; a taker that times out or is cancelled holds nothing."""
    clients = [2]
    budget = SharedByteBudget(100, min_share=1, clients=lambda: clients[0])
    assert budget.try_take(b"a", 50) and budget.try_take(b"c", 50)
    waiting = asyncio.ensure_future(budget.take(b"b", 40, timeout=5))
    await asyncio.sleep(0)
    clients[0] = 4
    budget.reshare()
    assert await waiting is Grant.OVER_SHARE
    assert await budget.take(b"b", 25, timeout=0.01) is Grant.TIMED_OUT
    cancelled = asyncio.ensure_future(budget.take(b"b", 25, timeout=5))
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    budget.give(b"a", 50)
    budget.give(b"c", 50)
    assert budget.free == 100 and budget.held(b"b") == 0
