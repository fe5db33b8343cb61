"""The local-disk tier over a directory others can write: names that look like records but are FIFOs or
links are never read, so no scan or read blocks on them; each is a counted miss, and a put takes the name back.

Each operation runs under a deadline (:func:`tests.untrusted_dir.within`): a reader that blocks fails the
test instead of hanging the suite."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvengine.metrics import EngineMetrics
from kvengine.transports._disk_files import record_name
from kvengine.transports.local_disk import LocalDiskOptions, LocalDiskTransport

from ..untrusted_dir import plant_fifo, within
from .conftest import MakeRecord, build_record

DEADLINE = 10.0


def _options(path: Path) -> LocalDiskOptions:
    return LocalDiskOptions(path=path, capacity_bytes=64 << 20, fsync="never")


def test_a_fifo_named_like_a_record_does_not_hang_the_restart_scan(tmp_path: Path) -> None:
    """Regression: the restart scan opened every ``<key>.kvc`` blocking, so one FIFO under a record's name hung
    the scan, and with it every operation (each waits for the scan). Now it is left alone and not indexed; the
    real records next to it are indexed and served."""
    store = tmp_path / "store"
    good = build_record(5000)
    fifo_key, _ = build_record(100)

    async def write() -> None:
        t = LocalDiskTransport(_options(store))
        assert await t.put([good]) == [True]
        await t.close()

    asyncio.run(write())
    fifo = plant_fifo(store / record_name(fifo_key))

    async def reopen() -> tuple[list[bytes | None], int]:
        t = LocalDiskTransport(_options(store))
        try:
            got = await t.get([good[0], fifo_key])
            return [bytes(g) if g is not None else None for g in got], t.stats().chunks
        finally:
            await t.close()

    got, chunks = within(DEADLINE, lambda: asyncio.run(reopen()), fifos=[fifo])
    assert got == [good[1], None] and chunks == 1
    assert fifo.exists()  # not ours to delete: left alone


@pytest.mark.parametrize("swap", ["fifo", "link_to_a_fifo"])
def test_a_record_swapped_for_a_fifo_after_the_scan_is_a_counted_miss(tmp_path: Path, make_record: MakeRecord,
                                                                      swap: str) -> None:
    """Regression: a get opened an indexed record's file blocking and following links, so a record replaced by
    a FIFO (or by a link to one outside the directory) after the scan blocked that read, and the I/O thread,
    forever. Now a get and a get_into of it are misses within the deadline, counted in ``read_errors`` (exported
    as ``kvengine_tier_errors_total{tier="local_disk",op="get"}``) and unindexed; a later put of the key
    replaces the name with a real record, served again."""
    store = tmp_path / "store"
    first, second = make_record(3000), make_record(3000)
    elsewhere = tmp_path / "elsewhere.fifo"

    async def scenario() -> None:
        t = LocalDiskTransport(_options(store))
        metrics = EngineMetrics()
        metrics.watch_tiers([t])
        try:
            assert await t.put([first, second]) == [True, True]
            for key, _ in (first, second):
                path = store / record_name(key)
                path.unlink()
                if swap == "fifo":
                    plant_fifo(path)
                else:
                    path.symlink_to(elsewhere)
            assert await t.get([first[0]]) == [None]
            assert await t.get_into(second[0], bytearray(4096)) is None
            s = t.stats()
            assert (s.read_errors, s.chunks, s.used_bytes) == (2, 0, 0)
            assert metrics.value("kvengine_tier_errors_total", tier="local_disk", op="get") == 2
            assert await t.exists([first[0], second[0]]) == [False, False]
            assert await t.put([first]) == [True]  # the put's rename takes the name back
            assert [bytes(g) if g is not None else None for g in await t.get([first[0]])] == [first[1]]
        finally:
            await t.close()

    plant_fifo(elsewhere)
    fifos = [elsewhere, store / record_name(first[0]), store / record_name(second[0])]
    within(DEADLINE, lambda: asyncio.run(scenario()), fifos=fifos)
    assert os.path.isfile(store / record_name(first[0])) and not os.path.islink(store / record_name(first[0]))
