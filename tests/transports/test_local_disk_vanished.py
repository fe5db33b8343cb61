"""The local-disk tier's numbers say what is on disk: records that vanish behind its index (deleted, evicted by
another process on the directory) are written again by the next put, not claimed stored, and leave the
``kvengine_tier_chunks`` gauge; a write that fails (read-only, full) is never counted as stored."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from kvengine import KVEngine, Namespace
from kvengine.metrics import EngineMetrics
from kvengine.transports._disk_files import footprint, record_name
from kvengine.transports.local_disk import LocalDiskOptions, LocalDiskTransport

from ..conftest import CHUNK, FakeKV, make_layout
from .conftest import MakeRecord

REPO = Path(__file__).resolve().parents[2]
TOKENS = list(range(4 * CHUNK))


async def test_a_put_of_a_record_deleted_behind_the_tiers_back_writes_it_again(tmp_path: Path,
                                                                             make_record: MakeRecord) -> None:
    """Regression: a put of a key the index held returned True without writing, even when the file had been
    deleted behind the tier's back, so the chunk was counted as stored and was not on disk. Now the put finds
    the file gone, writes it again and serves it; a put of a record still there is deduplicated as before."""
    t = LocalDiskTransport(LocalDiskOptions(path=tmp_path, capacity_bytes=64 << 20, fsync="never"))
    try:
        gone, kept = make_record(5000), make_record(5000)
        assert await t.put([gone, kept]) == [True, True]
        (tmp_path / record_name(gone[0])).unlink()
        assert await t.put([gone, kept]) == [True, True]
        assert (tmp_path / record_name(gone[0])).read_bytes() == gone[1]
        assert [bytes(b) for b in await t.get([gone[0], kept[0]]) if b is not None] == [gone[1], kept[1]]
        s = t.stats()
        assert (s.puts_ok, s.puts_deduplicated, s.vanished, s.chunks) == (3, 1, 1, 2)
        assert s.used_bytes == 2 * footprint(len(gone[1]))
    finally:
        await t.close()


EVICTOR = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from kvengine.transports.local_disk import LocalDiskOptions, LocalDiskTransport

    async def main(path, capacity):  # opening with a smaller capacity evicts the oldest records down to it
        t = LocalDiskTransport(LocalDiskOptions(path=Path(path), capacity_bytes=int(capacity), fsync="never"))
        await t.wait_ready()
        print(t.stats().evictions)
        await t.close()

    asyncio.run(main(*sys.argv[1:]))
""")


async def test_records_another_process_evicts_leave_the_chunk_gauge(tmp_path: Path, make_record: MakeRecord) -> None:
    """Regression: records that vanished from the directory (here: evicted by another process that opened it
    with a smaller capacity) stayed in ``kvengine_tier_chunks`` and ``used_bytes`` until a read of each failed.
    Now the periodic check (one listing of names) unindexes them, counted as ``vanished``."""
    t = LocalDiskTransport(LocalDiskOptions(path=tmp_path, capacity_bytes=64 << 20, fsync="never",
                                            reconcile_seconds=0.1))
    metrics = EngineMetrics()
    metrics.watch_tiers([t])
    try:
        items = [make_record(20_000) for _ in range(3)]
        for item in items:
            assert await t.put([item]) == [True]
            os.utime(tmp_path / record_name(item[0]), (time.time() - 100 + len(os.listdir(tmp_path)),) * 2)
        assert metrics.value("kvengine_tier_chunks", tier="local_disk") == 3
        one = footprint(len(items[0][1]))
        other = subprocess.run([sys.executable, "-c", EVICTOR, str(tmp_path), str(one)], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        assert other.returncode == 0 and other.stdout.split() == ["2"], other.stderr
        deadline = time.monotonic() + 10
        while metrics.value("kvengine_tier_chunks", tier="local_disk") != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert metrics.value("kvengine_tier_chunks", tier="local_disk") == 1
        assert metrics.value("kvengine_tier_used_bytes", tier="local_disk") == one
        assert t.stats().vanished == 2
        assert await t.exists([k for k, _ in items]) == [False, False, True]  # the newest one is left
    finally:
        await t.close()


@pytest.mark.parametrize("fault", ["read_only", "no_space"])
def test_a_store_to_a_read_only_or_full_disk_is_not_counted_as_stored(mounts: Any, fault: str) -> None:
    """Regression (seen under vLLM: ``kvengine_stored_chunks_total{tier="local_disk"}`` rose by 31 with the
    directory read-only and by 26 with the disk full, no new file): the records an engine indexed at start were
    deleted behind its back, and its stores of the same chunks were claimed written. Now, on a real tmpfs
    remounted read-only or filled up, those stores fail: counted in ``kvengine_tier_put_failures_total`` by
    reason, not in ``kvengine_stored_chunks_total``, and ``kvengine_tier_chunks`` drops to what is on disk."""
    store = mounts.tmpfs("disk", "1m")
    layout, kv = make_layout(), FakeKV(len(TOKENS))
    config = {"chunk_size": CHUNK, "memory": {"capacity_bytes": 1 << 20},
              "disk": {"path": str(store), "capacity_bytes": "512KiB", "fsync": "never"}}
    with KVEngine(config) as writer:
        assert writer.store(writer.bind(Namespace(model="m"), layout), TOKENS, kv.source).stored_chunks == 4
    with KVEngine(config) as eng:  # indexes the 4 records at start, its memory empty
        binding = eng.bind(Namespace(model="m"), layout)
        m = eng.metrics
        deadline = time.monotonic() + 10
        while m.value("kvengine_tier_chunks", tier="local_disk") != 4 and time.monotonic() < deadline:
            time.sleep(0.02)  # the restart scan runs in the background
        assert m.value("kvengine_tier_chunks", tier="local_disk") == 4
        for record in store.glob("*.kvc"):  # deleted behind its back
            record.unlink()
        if fault == "read_only":
            mounts.remount_read_only(store)
        else:
            _fill(store / "filler")
        assert eng.store(binding, TOKENS, kv.source).stored_chunks == 4  # in memory
        eng.flush()
        assert m.value("kvengine_stored_chunks_total", tier="local_disk") == 0
        assert m.value("kvengine_tier_put_failures_total", tier="local_disk", reason=fault) == 4
        assert m.value("kvengine_tier_chunks", tier="local_disk") == 0
        assert m.value("kvengine_tier_used_bytes", tier="local_disk") == 0
    assert not list(store.glob("*.kvc"))


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full (ENOSPC)."""
    block = b"\0" * 4096
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == 28, exc  # ENOSPC
