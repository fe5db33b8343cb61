"""The byte budget shared by the peer client's writes and the tcp server's receives."""

from __future__ import annotations

import asyncio

from kvengine.transports.byte_budget import ByteBudget


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
