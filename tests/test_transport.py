"""The read scope a lookup opens for its reads from lower tiers (:mod:`kvengine.transport`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvengine import ReadScope
from kvengine.errors import InvalidRequestError
from kvengine.transport import read_budget, read_deadline, read_scope, read_source


def test_outside_a_scope_transports_keep_their_own_deadline_and_placement() -> None:
    assert read_budget(2.0) == 2.0 and read_source() is None
    assert abs(read_deadline(2.0) - (time.monotonic() + 2.0)) < 0.1


def test_a_scope_sets_the_budget_and_source_and_a_nested_one_cannot_renew_them() -> None:
    with read_scope(ReadScope(budget=30.0, source="10.0.0.1:7700")):
        start = read_deadline(1.0) - 30.0
        assert read_budget(2.0) == 30.0 and read_source() == "10.0.0.1:7700"
        with read_scope(ReadScope(budget=600.0, source="10.0.0.2:7700")):
            assert read_budget(2.0) == 30.0 and read_source() == "10.0.0.1:7700"
            assert abs(read_deadline(1.0) - 30.0 - start) < 1e-6
    assert read_source() is None


async def test_tasks_started_inside_a_scope_inherit_it() -> None:
    async def seen() -> tuple[float, str | None]:
        await asyncio.sleep(0)
        return read_budget(1.0), read_source()

    with read_scope(ReadScope(budget=5.0, source="h:1")):
        task = asyncio.ensure_future(seen())
    assert await task == (5.0, "h:1")


@pytest.mark.parametrize("budget", [0, -1.0])
def test_a_budget_that_is_not_positive_is_refused_by_name(budget: float) -> None:
    with pytest.raises(InvalidRequestError, match="ReadScope.budget must be > 0 seconds"):
        ReadScope(budget=budget)
