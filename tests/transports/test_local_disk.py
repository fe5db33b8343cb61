"""Tests of the local-disk transport (kvengine.transports.local_disk)."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import kvengine.transports._disk_files as files_mod
from kvengine.chunks.keys import ChunkKey, Namespace
from kvengine.chunks.record import FORMAT_VERSION, decode_header, unpack_record
from kvengine.errors import ConfigError, InvalidRequestError, TransportError
from kvengine.transport import ChunkTransport
from kvengine.transports._disk_files import RecordFiles, footprint, record_name
from kvengine.transports.local_disk import LocalDiskOptions, LocalDiskTransport, create_transport

MiB = 2**20
#: Same digest as the conftest's make_record default namespace.
TEST_NAMESPACE = Namespace(model="tests/transports").digest()
MakeRecord = Callable[..., tuple[ChunkKey, bytes]]
Mounts = Any  # conftest.Mounts: .tmpfs(name, size) -> Path, .remount_read_only(path)
PYTHON = sys.executable
OpenDisk = Callable[..., Awaitable[LocalDiskTransport]]

# A writer process: stores records of SIZE bytes (COUNT of them, or forever
# when COUNT < 0) and prints each published key, one per line.
WRITER = r"""
import asyncio, os, sys
from pathlib import Path
from tests.transports.conftest import build_record
from kvengine.transports.local_disk import LocalDiskOptions, LocalDiskTransport

async def main(path, count, size, fsync):
    t = LocalDiskTransport(LocalDiskOptions(path=Path(path), capacity_bytes=1 << 40, fsync=fsync))
    payload = os.urandom(size)
    i = 0
    while count < 0 or i < count:
        key, rec = build_record(size, payload=payload)
        assert (await t.put([(key, rec)])) == [True]
        print(key.hex(), flush=True)
        i += 1
    await t.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
"""
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def open_disk(tmp_path: Path) -> AsyncIterator[OpenDisk]:
    """``await open_disk(path=..., capacity_bytes=..., **options)``; closed at teardown."""
    opened: list[LocalDiskTransport] = []

    async def open_(path: Path | None = None, capacity_bytes: int = 256 * MiB, **options: Any) -> LocalDiskTransport:
        t = LocalDiskTransport(LocalDiskOptions(path=path or tmp_path / "store", capacity_bytes=capacity_bytes,
                                                **options))
        await t.wait_ready()
        opened.append(t)
        return t

    yield open_
    for t in opened:
        await t.close()


def disk_bytes(path: Path) -> int:
    """What the store's files occupy, in the transport's accounting unit (4 KiB blocks)."""
    total = 0
    for entry in os.scandir(path):
        try:
            total += footprint(entry.stat().st_size)
        except FileNotFoundError:  # unlinked (evicted, or a temp file renamed) since the listing
            pass
    return total


def run_writer(path: Path, count: int, size: int, fsync: str = "data") -> subprocess.Popen[str]:
    return subprocess.Popen([PYTHON, "-c", WRITER, str(path), str(count), str(size), fsync], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)


# -- basic behaviour -----------------------------------------------------------
@pytest.mark.parametrize("fsync", ["never", "data", "always"])
async def test_round_trip_returns_identical_verified_bytes(open_disk: OpenDisk, make_record: MakeRecord,
                                                           fsync: str) -> None:
    """Scenario: records small (buffered path) and large, unaligned (O_DIRECT path) are put under each
    fsync policy; get returns exactly the stored bytes, which verify, and the counters add up."""
    t = await open_disk(fsync=fsync)
    items = [make_record(n) for n in (10, 4096 - 120, 300_000, 3 * MiB + 17)]
    assert await t.put(items) == [True] * 4
    got = await t.get([k for k, _ in items])
    for (key, rec), buf in zip(items, got, strict=True):
        assert buf is not None and bytes(buf) == rec
        unpack_record(buf, expect_key=key)
    s = t.stats()
    assert (s.puts_ok, s.hits, s.chunks) == (4, 4, 4)
    assert s.bytes_written == s.bytes_read == sum(len(r) for _, r in items)
    assert not list(t.options.path.glob("*.tmp"))
    assert isinstance(t, ChunkTransport)


async def test_page_aligned_caller_buffer_round_trips(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: a record handed over in page-aligned memory (the zero-copy O_DIRECT path, tail
    through the staging buffer) and one whose length is an exact block multiple both round-trip."""
    t = await open_disk()
    key, rec = make_record(5 * MiB + 999)
    aligned = mmap.mmap(-1, len(rec))
    aligned[:] = rec
    exact_key, exact = make_record(2 * MiB)
    exact_key, exact = make_record(2 * MiB - (len(exact) - 2 * MiB))
    assert len(exact) % 4096 == 0
    assert await t.put([(key, memoryview(aligned)), (exact_key, exact)]) == [True, True]
    got = await t.get([key, exact_key])
    assert [bytes(g) for g in got if g is not None] == [rec, exact]


async def test_batched_ops_keep_positions_for_hits_and_misses(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: a batch get/exists mixing stored and unknown keys answers position by position."""
    t = await open_disk()
    items = [make_record(1000 + i) for i in range(6)]
    assert await t.put(items) == [True] * 6
    unknown = [make_record(10)[0] for _ in range(3)]
    keys = [items[0][0], unknown[0], items[3][0], unknown[1], items[5][0], unknown[2]]
    got = await t.get(keys)
    assert [g is not None for g in got] == [True, False, True, False, True, False]
    assert bytes(got[2]) == items[3][1]
    assert await t.exists(keys) == [True, False, True, False, True, False]
    assert (t.stats().hits, t.stats().misses) == (3, 3)


async def test_exists_and_delete(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: delete removes stored chunks (file and accounting) and reports False for unknown keys."""
    t = await open_disk()
    (k1, r1), (k2, r2) = make_record(5000), make_record(6000)
    await t.put([(k1, r1), (k2, r2)])
    other = make_record(10)[0]
    assert await t.delete([k1, other]) == [True, False]
    assert await t.exists([k1, k2]) == [False, True]
    assert await t.get([k1]) == [None]
    assert not (t.options.path / record_name(k1)).exists()
    assert t.stats().used_bytes == footprint(len(r2)) == disk_bytes(t.options.path)


async def test_put_of_stored_key_is_deduplicated(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: putting a key that is already stored returns True without rewriting the file."""
    t = await open_disk()
    key, rec = make_record(20_000)
    await t.put([(key, rec)])
    path = t.options.path / record_name(key)
    inode = path.stat().st_ino
    assert await t.put([(key, rec)]) == [True]
    assert path.stat().st_ino == inode
    assert (t.stats().puts_ok, t.stats().puts_deduplicated) == (1, 1)


async def test_put_rejects_caller_mistakes(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: a record whose header names another key, a non-record, or a namespace outside the
    configured set is a caller mistake and raises instead of being stored."""
    t = await open_disk(namespaces=frozenset({TEST_NAMESPACE}))
    (k1, _), (_, r2) = make_record(100), make_record(100)
    with pytest.raises(InvalidRequestError):
        await t.put([(k1, r2)])
    with pytest.raises(InvalidRequestError):
        await t.put([(k1, b"not a record")])
    foreign_key, foreign = make_record(100, namespace=Namespace(model="other").digest())
    with pytest.raises(InvalidRequestError):
        await t.put([(foreign_key, foreign)])
    assert t.stats().chunks == 0


async def test_use_after_close_raises(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: operations on a closed transport are caller mistakes (TransportError); close is idempotent."""
    t = await open_disk()
    await t.close()
    await t.close()
    with pytest.raises(TransportError):
        await t.get([make_record(1)[0]])


# -- capacity --------------------------------------------------------------------
async def test_capacity_evicts_least_recently_used_and_is_never_exceeded(
    open_disk: OpenDisk, make_record: MakeRecord
) -> None:
    """Scenario: capacity for 5 records, 12 puts one by one while the first key is read after each put:
    usage (accounted and on disk) never exceeds capacity, the hot key survives, the coldest go."""
    items = [make_record(100_000) for _ in range(12)]
    cap = 5 * footprint(len(items[0][1]))
    t = await open_disk(capacity_bytes=cap)
    for item in items:
        assert await t.put([item]) == [True]
        assert t.stats().used_bytes <= cap and disk_bytes(t.options.path) <= cap
        assert (await t.get([items[0][0]]))[0] is not None
    present = await t.exists([k for k, _ in items])
    assert present[0] and present[-4:] == [True] * 4 and sum(present) == 5
    assert t.stats().evictions == 7


async def test_batch_larger_than_capacity_waits_for_space(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: one concurrent batch of 8 large records into room for 3: every put succeeds (later
    ones evict earlier ones once published), and usage stays within capacity throughout."""
    size = 2 * MiB
    cap = 3 * footprint(size + 200)
    t = await open_disk(capacity_bytes=cap, io_threads=4)
    items = [make_record(size) for _ in range(8)]
    peak = 0
    task = asyncio.ensure_future(t.put(items))
    while not task.done():
        peak = max(peak, disk_bytes(t.options.path))
        await asyncio.sleep(0.001)
    assert task.result() == [True] * 8
    assert peak <= cap and t.stats().used_bytes <= cap and t.stats().chunks == 3


async def test_record_larger_than_capacity_fails_softly(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: a record that can never fit is a failed put (False, counted), not an exception."""
    t = await open_disk(capacity_bytes=64 * 1024)
    assert await t.put([make_record(100_000)]) == [False]
    assert t.stats().put_failures == {"too_large": 1}


async def test_smaller_capacity_at_restart_trims_oldest(open_disk: OpenDisk, make_record: MakeRecord,
                                                        tmp_path: Path) -> None:
    """Scenario: reopening a directory with a smaller capacity evicts the oldest records down to it."""
    t = await open_disk(path=tmp_path / "s")
    items = [make_record(50_000) for _ in range(6)]
    for item in items:
        await t.put([item])
        time.sleep(0.01)  # distinct mtimes: the restart order
    await t.close()
    cap = 2 * footprint(50_200)
    t2 = await open_disk(path=tmp_path / "s", capacity_bytes=cap)
    assert await t2.exists([k for k, _ in items]) == [False] * 4 + [True] * 2
    assert disk_bytes(tmp_path / "s") <= cap


# -- restart and multiple processes ------------------------------------------------
@pytest.mark.slow
async def test_directory_written_by_another_process_is_served_after_open(open_disk: OpenDisk,
                                                                         tmp_path: Path) -> None:
    """Scenario: a separate process stores chunks and exits; this process then opens the directory,
    rebuilds the index from headers and serves every chunk, verified."""
    writer = run_writer(tmp_path / "shared", 5, 700_000)
    out, _ = writer.communicate(timeout=120)
    assert writer.returncode == 0
    keys = [ChunkKey.from_hex(line) for line in out.split()]
    t = await open_disk(path=tmp_path / "shared")
    assert t.stats().chunks == 5
    for key, buf in zip(keys, await t.get(keys), strict=True):
        assert buf is not None
        unpack_record(buf, expect_key=key)


async def test_restart_ignores_other_namespaces_and_versions(open_disk: OpenDisk, make_record: MakeRecord,
                                                             tmp_path: Path) -> None:
    """Scenario: the directory holds our chunks, another namespace's chunks and a chunk of a future
    format version; a transport limited to our namespace indexes only ours and leaves the rest alone."""
    store = tmp_path / "mixed"
    w = await open_disk(path=store)
    ours = [make_record(3000) for _ in range(3)]
    theirs = [make_record(3000, namespace=Namespace(model="other").digest()) for _ in range(2)]
    await w.put(ours + theirs)
    vkey, vrec = make_record(3000)
    (store / record_name(vkey)).write_bytes(reversion(vrec, FORMAT_VERSION + 1))
    await w.close()
    t = await open_disk(path=store, namespaces=frozenset({TEST_NAMESPACE}))
    assert t.stats().chunks == 3 and t.stats().integrity_failures == 0
    assert await t.exists([k for k, _ in ours + theirs] + [vkey]) == [True] * 3 + [False] * 3
    assert len(list(store.glob("*.kvc"))) == 6


def reversion(record: bytes, version: int, *, seal: bool = True) -> bytes:
    """``record`` as another format version would have written it (header checksum recomputed), or, with
    ``seal=False``, the same record with a damaged version field."""
    import xxhash

    out = bytearray(record)
    out[4:6] = version.to_bytes(2, "little")
    if seal:
        length = int.from_bytes(out[8:12], "little")
        out[length - 8:length] = xxhash.xxh3_64_intdigest(bytes(out[:length - 8])).to_bytes(8, "little")
    return bytes(out)


async def test_a_damaged_version_field_is_corruption_not_another_version(open_disk: OpenDisk,
                                                                         make_record: MakeRecord,
                                                                         tmp_path: Path) -> None:
    """Regression: a record whose version field was damaged was ignored by the restart scan like a newer
    writer's record: never counted, never deleted, never counted against capacity. A genuine other
    version's header still verifies (kept for its writers); a damaged one does not (deleted, counted)."""
    store = tmp_path / "versions"
    w = await open_disk(path=store)
    (good_key, good), (sealed_key, sealed), (bad_key, bad) = (make_record(3000) for _ in range(3))
    await w.put([(good_key, good)])
    await w.close()
    (store / record_name(sealed_key)).write_bytes(reversion(sealed, FORMAT_VERSION + 1))
    (store / record_name(bad_key)).write_bytes(reversion(bad, FORMAT_VERSION + 7, seal=False))
    t = await open_disk(path=store)
    assert await t.exists([good_key, sealed_key, bad_key]) == [True, False, False]
    assert t.stats().integrity_reasons == {"damaged_version": 1}
    assert sorted(p.name for p in store.glob("*.kvc")) == sorted([record_name(good_key), record_name(sealed_key)])


async def test_restart_removes_temp_files_of_dead_writers_only(open_disk: OpenDisk, tmp_path: Path) -> None:
    """Scenario: temp files left by a dead process are removed on open; one owned by a live writer
    (here: this process) is left for it to finish."""
    store = tmp_path / "tmps"
    store.mkdir()
    dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    hexkey = "ab" * 32
    (store / f"{hexkey}.{dead_pid}.0000.tmp").write_bytes(b"partial")
    (store / f"{hexkey}.junk.tmp").write_bytes(b"partial")
    live = store / f"{hexkey}.{os.getpid()}.0001.tmp"
    live.write_bytes(b"in flight")
    await open_disk(path=store)
    assert [p.name for p in store.glob("*.tmp")] == [live.name]


@pytest.mark.slow
async def test_kill9_writer_mid_store_never_serves_a_torn_chunk(open_disk: OpenDisk, tmp_path: Path) -> None:
    """Scenario: a writer storing 8 MiB records is SIGKILLed while a temp file is being written;
    reopening removes the temp file and every chunk on disk is either served verified or a miss."""
    store = tmp_path / "killed"
    seen_tmp = 0
    for round_ in range(2):
        writer = run_writer(store, -1, 8 * MiB, fsync="never")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill once 2 more records are out and a third is in flight
            if store.is_dir() and len(list(store.glob("*.kvc"))) >= 2 * (round_ + 1) and list(store.glob("*.tmp")):
                break
            time.sleep(0.002)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        seen_tmp += len(list(store.glob("*.tmp")))
    assert seen_tmp >= 1, "the writer was never caught mid-store"
    t = await open_disk(path=store)
    assert not list(store.glob("*.tmp"))
    keys = [ChunkKey.from_hex(p.name[:64]) for p in store.glob("*.kvc")]
    assert len(keys) >= 4
    for key, buf in zip(keys, await t.get(keys), strict=True):
        if buf is not None:
            unpack_record(buf, expect_key=key)
    assert t.stats().integrity_failures == 0


# -- corruption ------------------------------------------------------------------
def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(data)


async def test_bit_flips_truncation_and_foreign_files_are_detected_deleted_counted(
    open_disk: OpenDisk, make_record: MakeRecord, caplog: pytest.LogCaptureFixture
) -> None:
    """Scenario: stored files get a payload bit flip, a header bit flip, a truncation, trailing bytes
    and another chunk's record; each get is a miss, the file is deleted, the failure counted by
    reason and logged once per reason; an untouched chunk is still served."""
    t = await open_disk()
    items = [make_record(2 * MiB) for _ in range(6)]
    await t.put(items)
    path = [t.options.path / record_name(k) for k, _ in items]
    _flip_bit(path[0], len(items[0][1]) - 5)
    _flip_bit(path[1], 40)
    os.truncate(path[2], len(items[2][1]) - 1000)
    with open(path[3], "ab") as f:
        f.write(b"extra")
    path[4].write_bytes(items[5][1])
    caplog.set_level(logging.WARNING, logger="kvengine.transports.local_disk")
    got = await t.get([k for k, _ in items])
    assert [g is None for g in got] == [True] * 5 + [False]
    assert await t.get([k for k, _ in items[:5]]) == [None] * 5  # now a plain miss, not re-counted
    assert not any(p.exists() for p in path[:5])
    s = t.stats()
    assert s.integrity_failures == 5 and s.chunks == 1
    assert s.integrity_reasons == {"payload_checksum": 1, "header_checksum": 1, "truncated_payload": 1,
                                   "trailing_bytes": 1, "other_key": 1}
    assert s.used_bytes == disk_bytes(t.options.path)
    assert len(caplog.records) == 5


async def test_oversized_file_under_a_record_name_is_not_read(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: a stored record's file is replaced by a (sparse) file larger than the whole capacity;
    get does not try to buffer it: a miss, the file deleted, counted as oversized."""
    t = await open_disk(capacity_bytes=8 * MiB)
    key, rec = make_record(1000)
    await t.put([(key, rec)])
    os.truncate(t.options.path / record_name(key), 64 * 2**30)
    assert await t.get([key]) == [None]
    assert t.stats().integrity_reasons == {"oversized": 1}
    assert not (t.options.path / record_name(key)).exists()


async def test_torn_file_found_at_restart_is_deleted_and_counted(open_disk: OpenDisk, make_record: MakeRecord,
                                                                 tmp_path: Path) -> None:
    """Scenario: a truncated record (as fsync="never" may leave after power loss) and a file of garbage
    are found by the restart scan: neither indexed, both deleted and counted."""
    store = tmp_path / "torn"
    t = await open_disk(path=store)
    items = [make_record(300_000) for _ in range(3)]
    await t.put(items)
    await t.close()
    os.truncate(store / record_name(items[0][0]), 1000)
    (store / record_name(make_record(1)[0])).write_bytes(os.urandom(5000))
    t2 = await open_disk(path=store)
    assert await t2.exists([k for k, _ in items]) == [False, True, True]
    assert t2.stats().integrity_failures == 2
    assert len(list(store.glob("*.kvc"))) == 2


# -- faults: full disk, read-only directory ---------------------------------------
async def test_full_tmpfs_fails_puts_softly_logs_once_and_keeps_reads(
    open_disk: OpenDisk, make_record: MakeRecord, mounts: Mounts, caplog: pytest.LogCaptureFixture
) -> None:
    """Scenario: a 2 MiB tmpfs fills up (ENOSPC) under a 64 MiB capacity: further puts return False,
    are counted as no_space and logged once; no temp file is left; stored chunks still read."""
    store = mounts.tmpfs("small", "2m")
    t = await open_disk(path=store, capacity_bytes=64 * MiB)
    caplog.set_level(logging.WARNING, logger="kvengine.transports.local_disk")
    stored, results = [], []
    for _ in range(8):
        item = make_record(400_000)
        ok = (await t.put([item]))[0]
        results.append(ok)
        if ok:
            stored.append(item)
    assert results.count(False) >= 3 and stored
    s = t.stats()
    assert s.put_failures == {"no_space": results.count(False)} and s.puts_failed == results.count(False)
    assert len([r for r in caplog.records if "no_space" in r.getMessage()]) == 1
    assert not list(store.glob("*.tmp"))
    for (_, rec), buf in zip(stored, await t.get([k for k, _ in stored]), strict=True):
        assert buf is not None and bytes(buf) == rec


async def test_read_only_mount_fails_puts_softly_and_serves_reads(
    open_disk: OpenDisk, make_record: MakeRecord, mounts: Mounts, caplog: pytest.LogCaptureFixture
) -> None:
    """Scenario: a store directory remounted read-only (root ignores chmod, a ro mount does not):
    opening works, gets serve the chunks, puts return False counted as read_only, logged once."""
    store = mounts.tmpfs("ro", "16m")
    w = await open_disk(path=store)
    items = [make_record(500_000) for _ in range(3)]
    await w.put(items)
    await w.close()
    mounts.remount_read_only(store)
    caplog.set_level(logging.WARNING, logger="kvengine.transports.local_disk")
    t = await open_disk(path=store)
    got = await t.get([k for k, _ in items])
    assert [bytes(g) if g is not None else None for g in got] == [r for _, r in items]
    assert await t.put([make_record(1000), make_record(2000)]) == [False, False]
    assert t.stats().put_failures == {"read_only": 2}
    assert len([r for r in caplog.records if "read_only" in r.getMessage()]) == 1


@pytest.mark.parametrize(("err", "reason"), [(errno.ENOSPC, "no_space"), (errno.EDQUOT, "no_space"),
                                             (errno.EROFS, "read_only"), (errno.EACCES, "read_only"),
                                             (errno.EIO, "io_error")])
async def test_write_faults_are_soft_failures_by_reason(open_disk: OpenDisk, make_record: MakeRecord,
                                                        monkeypatch: pytest.MonkeyPatch, err: int,
                                                        reason: str) -> None:
    """Scenario (fault injection): the write primitive fails part-way with ``err``; puts return False,
    are counted under ``reason``, the temp file is removed and reads of existing chunks still work."""
    t = await open_disk()
    good = make_record(2 * MiB)
    await t.put([good])

    def failing(fd: int, parts: list[memoryview], *_: object, **__: object) -> None:
        os.pwrite(fd, parts[0][:4096], 0)
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(RecordFiles, "_write_direct", lambda self, fd, parts, nbytes: failing(fd, parts))
    monkeypatch.setattr(files_mod, "_write_buffered", failing)
    assert await t.put([make_record(2 * MiB), make_record(1000)]) == [False, False]
    assert t.stats().put_failures == {reason: 2}
    assert not list(t.options.path.glob("*.tmp"))
    assert bytes((await t.get([good[0]]))[0]) == good[1]
    assert t.stats().used_bytes == disk_bytes(t.options.path)


async def test_o_direct_refusal_falls_back_to_buffered(open_disk: OpenDisk, make_record: MakeRecord,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario: the filesystem accepts O_DIRECT at open but refuses the I/O (EINVAL); the put still
    succeeds through buffered I/O and the transport stops trying O_DIRECT."""
    def refuse(self: RecordFiles, fd: int, parts: list[memoryview], nbytes: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(RecordFiles, "_write_direct", refuse)
    t = await open_disk()
    key, rec = make_record(3 * MiB)
    assert await t.put([(key, rec)]) == [True]
    assert bytes((await t.get([key]))[0]) == rec
    assert t.stats().direct_io is False


# -- extras ------------------------------------------------------------------------
async def test_get_into_fills_caller_buffer(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: get_into reads a verified payload into a caller buffer, returns its header; a miss
    is None; a too-small buffer is a caller mistake; a corrupt record is a counted miss."""
    t = await open_disk()
    (key, rec), (bad_key, bad_rec) = make_record(1 * MiB + 3), make_record(5000)
    await t.put([(key, rec), (bad_key, bad_rec)])
    out = bytearray(2 * MiB)
    header = await t.get_into(key, out)
    assert header is not None and bytes(out[: header.payload_length]) == rec[header.header_length :]
    assert await t.get_into(make_record(1)[0], out) is None
    with pytest.raises(InvalidRequestError):
        await t.get_into(key, bytearray(10))
    _flip_bit(t.options.path / record_name(bad_key), len(bad_rec) - 1)
    assert await t.get_into(bad_key, out) is None
    assert t.stats().integrity_failures == 1 and not (t.options.path / record_name(bad_key)).exists()


async def test_read_buffers_are_recycled_only_after_release(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: large get results come from a buffer pool; a result still held is never reused
    (its bytes stay intact across later gets), a dropped one goes back to the pool."""
    t = await open_disk()
    items = [make_record(2 * MiB) for _ in range(3)]
    await t.put(items)
    held = (await t.get([items[0][0]]))[0]
    assert held is not None
    for _ in range(3):
        got = await t.get([items[1][0], items[2][0]])
        assert [bytes(g) for g in got if g is not None] == [items[1][1], items[2][1]]
        del got
        gc.collect()
    assert bytes(held) == items[0][1]
    pool = t._files.buffers  # white-box check of the pool
    before = pool.idle_bytes
    del held
    gc.collect()
    assert pool.idle_bytes > before


def test_create_transport_factory_validates_config(tmp_path: Path) -> None:
    """Scenario: the entry-point factory takes a plain dict (sizes as strings, namespaces as hex) and
    rejects unknown keys or a missing path with ConfigError."""
    t = create_transport({"path": str(tmp_path / "f"), "capacity_bytes": "8MiB", "fsync": "always",
                          "namespaces": [TEST_NAMESPACE.hex()], "io_threads": 2})
    try:
        assert t.options.capacity_bytes == 8 * MiB and t.options.fsync == "always"
        assert t.options.namespaces == frozenset({TEST_NAMESPACE})
    finally:
        asyncio.run(t.close())
    for bad in ({"path": str(tmp_path), "colour": "red"}, {"capacity_bytes": 10},
                {"path": str(tmp_path), "fsync": "sometimes"}, {"path": str(tmp_path), "namespaces": ["zz"]}):
        with pytest.raises(ConfigError):
            create_transport(bad)


async def test_index_rebuild_reads_many_small_records(open_disk: OpenDisk, make_record: MakeRecord,
                                                      tmp_path: Path) -> None:
    """Scenario: 2,000 records laid down by a previous run are all indexed on open (headers only),
    with their exact accounted size."""
    store = tmp_path / "many"
    store.mkdir()
    total = 0
    payload = os.urandom(64)
    for _ in range(2000):
        key, rec = make_record(64, payload=payload)
        (store / record_name(key)).write_bytes(rec)
        total += footprint(len(rec))
    t = await open_disk(path=store)
    assert t.stats().chunks == 2000 and t.stats().used_bytes == total
    assert t.stats().rebuild_seconds > 0


# -- issue 9: streamed buffered writes, placed reads ---------------------------------
async def test_streamed_buffered_write_is_synced_before_it_is_published(
        open_disk: OpenDisk, make_record: MakeRecord, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario: with O_DIRECT off, a large record is written piece by piece with writeback started
    after each piece; its name appears only after the fdatasync of its temp file has returned."""
    events: list[tuple[str, object]] = []
    real_sync, real_replace, real_wb = os.fdatasync, os.replace, files_mod.start_writeback
    t = await open_disk(direct_io=False, fsync="data")
    key, rec = make_record(3 * files_mod.STREAM_BYTES + 12345)
    final = t.options.path / record_name(key)

    def sync(fd: int) -> None:
        assert not final.exists(), "record published before its data was synced"
        real_sync(fd)
        events.append(("sync", fd))

    def replace(src: Any, dst: Any) -> None:
        events.append(("replace", Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fdatasync", sync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(files_mod, "start_writeback", lambda fd, off, n: (events.append(("wb", (off, n))),
                                                                          real_wb(fd, off, n))[1])
    assert await t.put([(key, rec)]) == [True]
    kinds = [kind for kind, _ in events]
    assert kinds == ["wb"] * 4 + ["sync", "replace"]
    pieces = [v for k, v in events if k == "wb"]
    step = files_mod.STREAM_BYTES
    assert pieces == [(0, step), (step, step), (2 * step, step), (3 * step, len(rec) - 3 * step)]
    assert bytes((await t.get([key]))[0]) == rec


@pytest.mark.parametrize("direct_io", [None, False])
@pytest.mark.parametrize("fail_at", ["write", "sync"])
async def test_a_failed_record_in_a_batch_leaves_the_others_whole(
        open_disk: OpenDisk, make_record: MakeRecord, monkeypatch: pytest.MonkeyPatch,
        direct_io: bool | None, fail_at: str) -> None:
    """Scenario (fault injection): in a batch of 4 large records, the write or the fdatasync of one
    fails with EIO. Only that put is False; it leaves no file, temp file or index entry (a record
    whose data was not synced is never published), and the other three read back exactly."""
    t = await open_disk(direct_io=direct_io, fsync="data")
    items = [make_record(2 * MiB + 100 * i) for i in range(4)]
    victim = items[2][1][:64]  # its header: holds the key
    real_sync, real_pwrite = os.fdatasync, os.pwrite
    doomed: set[int] = set()

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if offset == 0 and bytes(data[:64]) == victim:
            doomed.add(fd)
            if fail_at == "write":
                raise OSError(errno.EIO, "injected write error")
        return real_pwrite(fd, data, offset)

    def sync(fd: int) -> None:
        if fd in doomed and fail_at == "sync":
            doomed.discard(fd)  # the number is reused once the victim's file is closed
            raise OSError(errno.EIO, "injected fdatasync error")
        real_sync(fd)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fdatasync", sync)
    assert await t.put(items) == [True, True, False, True]
    monkeypatch.undo()
    assert t.stats().put_failures == {"io_error": 1}
    assert await t.exists([k for k, _ in items]) == [True, True, False, True]
    got = await t.get([k for k, _ in items])
    assert got[2] is None and not (t.options.path / record_name(items[2][0])).exists()
    assert [bytes(g) for g in got if g is not None] == [items[i][1] for i in (0, 1, 3)]
    assert not list(t.options.path.glob("*.tmp"))
    assert t.stats().used_bytes == disk_bytes(t.options.path)


async def test_get_into_placement_chooses_the_destination_from_the_header(
        open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Scenario: get_into with a placement function: it sees the verified header and returns where
    the payload goes (read and verified there, a hit); returning None stops the read (neither hit nor
    miss, the record stays); a too-small destination is a caller mistake; a corrupt payload is a
    counted miss and deleted, after the placement was asked."""
    t = await open_disk()
    (key, rec), (bad_key, bad_rec) = make_record(3 * MiB + 7), make_record(300_000)
    await t.put([(key, rec), (bad_key, bad_rec)])
    seen: list[Any] = []
    kept: list[bytearray] = []

    def place(header: Any) -> bytearray:
        seen.append(header)
        kept.append(bytearray(header.payload_length))
        return kept[-1]

    header = await t.get_into(key, place)
    assert header is not None and seen[0].key == key and header == seen[0]
    assert bytes(kept[-1]) == rec[header.header_length:]
    assert (t.stats().hits, t.stats().bytes_read) == (1, len(rec))
    assert await t.get_into(key, lambda h: None) is None
    assert (t.stats().hits, t.stats().misses) == (1, 0) and await t.exists([key]) == [True]
    with pytest.raises(InvalidRequestError):
        await t.get_into(key, lambda h: bytearray(h.payload_length - 1))
    with pytest.raises(InvalidRequestError):
        await t.get_into(key, lambda h: bytes(h.payload_length))  # read-only
    _flip_bit(t.options.path / record_name(bad_key), len(bad_rec) - 1)
    assert await t.get_into(bad_key, place) is None
    assert seen[-1].key == bad_key
    assert t.stats().integrity_failures == 1 and not (t.options.path / record_name(bad_key)).exists()


# -- gathered writes -----------------------------------------------------------------
def _address(buf: Any) -> int:
    import numpy as np
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


@pytest.mark.parametrize("direct_io", [None, False])
@pytest.mark.parametrize("split", ["header+aligned slot", "header+unaligned slot", "odd pieces"])
async def test_put_parts_writes_their_concatenation(open_disk: OpenDisk, make_record: MakeRecord,
                                                    monkeypatch: pytest.MonkeyPatch, direct_io: bool | None,
                                                    split: str) -> None:
    """Scenario: a record handed over as parts (header bytes + a payload in its own memory, aligned or
    not, or cut at odd places) is stored as their concatenation and reads back exactly. With O_DIRECT
    on, a page-aligned payload is written straight from the caller's memory (no staging copy)."""
    t = await open_disk(direct_io=direct_io)
    key, rec = make_record(3 * MiB + 123)
    n = decode_header(rec).header_length
    assert n % 4096 == 0
    slot = mmap.mmap(-1, 4 * MiB)
    shift = 64 if split == "header+unaligned slot" else 0
    memoryview(slot)[shift : shift + len(rec) - n] = rec[n:]
    payload = memoryview(slot)[shift : shift + len(rec) - n]
    parts: list[Any] = [rec[:n], payload]
    if split == "odd pieces":
        parts = [rec[: n + 100], rec[n + 100 : n + 5000], payload[5000:1_000_001], payload[1_000_001:]]
    sources: list[int] = []
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        sources.append(_address(data))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    assert await t.put_parts([(key, parts)]) == [True]
    monkeypatch.undo()
    assert bytes((await t.get([key]))[0]) == rec
    assert t.stats().bytes_written == len(rec) and t.stats().used_bytes == disk_bytes(t.options.path)
    if t.stats().direct_io:
        assert (_address(payload) in sources) == (split == "header+aligned slot")
    del payload, parts


async def test_put_parts_rejects_parts_that_are_not_a_record(open_disk: OpenDisk, make_record: MakeRecord) -> None:
    """Caller mistakes, named: a first part that does not start with the header, or parts whose
    lengths do not add up to the record the header announces; nothing is written."""
    t = await open_disk()
    key, rec = make_record(300_000)
    with pytest.raises(InvalidRequestError, match="first part"):
        await t.put_parts([(key, [rec[:10], rec[10:]])])
    with pytest.raises(InvalidRequestError, match="length"):
        await t.put_parts([(key, [rec, b"\0"])])
    assert t.stats().chunks == 0 and not list(t.options.path.iterdir())
