"""Local-disk transport vs the raw bandwidth of the same directory, plus index rebuild time.

Usage: ``.venv/bin/python benchmarks/bench_disk.py [--dir DIR] [--total-gib 1] [--repeats 3]``

Per repetition (order of raw and transport alternates between repetitions):

* persist: write ``total`` bytes as 32 MiB records until durable. Raw = plain
  ``open/write/fsync/close`` per file (buffered), and the same with O_DIRECT
  from an aligned buffer; transport = one ``put`` batch with ``fsync="data"``.
* read: page cache dropped first (``/proc/sys/vm/drop_caches``, or
  ``posix_fadvise(DONTNEED)`` per file if that is refused). Raw = sequential
  ``readinto`` a reused buffer (buffered and O_DIRECT); transport = ``get``
  in batches of 8 (every record verified: header + xxh3 payload checksum).

Ratios are transport / best raw variant (the stricter comparison) and
transport / plain buffered raw. Medians over repetitions. Then 100k small
records are laid down and the time to open the directory (index rebuild) is
measured with a cold and a warm page cache. Results go to
``benchmarks/results/disk.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace
from kvengine.chunks.layout import KVCategory, dtype_code
from kvengine.chunks.record import TensorDescriptor, encode_header
from kvengine.transports._disk_files import ALIGN, footprint, record_name
from kvengine.transports.local_disk import LocalDiskOptions, LocalDiskTransport

sys.path.insert(0, os.path.dirname(__file__))
from _util import drop_caches, print_header, write_json

NS = Namespace(model="bench/disk").digest()


def make_record(payload: bytes) -> tuple[ChunkKey, bytes]:
    key = ChunkKey(NS, ChunkHash(os.urandom(16)))
    n = len(payload)
    tensors = (TensorDescriptor(0, KVCategory.OPAQUE, dtype_code(torch.uint8), (n,), n),)
    return key, encode_header(key, (0, 256), tensors, codec_id=0, raw_length=n, payload=payload) + payload


def raw_write(paths: list[Path], records: list[bytes], direct: bool) -> float:
    if direct:  # one aligned copy prepared outside the timed region (records differ only in their header)
        m = mmap.mmap(-1, footprint(len(records[0])))
        m[: len(records[0])] = records[0]
        aligned = memoryview(m)
    start = time.perf_counter()
    for path, rec in zip(paths, records, strict=True):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o644)
        data = aligned[: footprint(len(rec))] if direct else memoryview(rec)
        off = 0
        while off < len(data):
            off += os.pwrite(fd, data[off:], off)
        if direct:
            os.ftruncate(fd, len(rec))
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - start


def raw_read(paths: list[Path], size: int, direct: bool) -> float:
    buf = memoryview(mmap.mmap(-1, footprint(size)))
    buf[:] = b"\0" * len(buf)  # prefault: the baseline pays no allocation cost
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        got = 0
        while got < size:
            k = os.preadv(fd, [buf[got:footprint(size)]], got)
            if k == 0:
                break
            got += k
        os.close(fd)
        assert got == size
    return time.perf_counter() - start


async def transport_rep(root: Path, items: list[tuple[ChunkKey, bytes]],
                        args: argparse.Namespace) -> tuple[float, float, str]:
    kv = root / "kv"
    total = sum(len(r) for _, r in items)
    t = LocalDiskTransport(LocalDiskOptions(
        path=kv, capacity_bytes=2 * total, fsync="data", io_threads=args.threads,
        direct_io=None if args.direct_io == "auto" else False, read_pool_bytes=args.read_pool_mib * 2**20))
    await t.wait_ready()
    start = time.perf_counter()
    ok = await t.put(items)
    put_s = time.perf_counter() - start
    assert all(ok), t.stats()
    method = drop_caches(sorted(kv.iterdir()))
    start = time.perf_counter()
    for i in range(0, len(items), 8):
        got = await t.get([k for k, _ in items[i : i + 8]])
        batch = items[i : i + 8]
        assert all(g is not None and len(g) == len(r) for g, (_, r) in zip(got, batch, strict=True)), t.stats()
        del got
    get_s = time.perf_counter() - start
    assert t.stats().integrity_failures == 0
    await t.close()
    shutil.rmtree(kv)
    return put_s, get_s, method


def raw_rep(root: Path, records: list[bytes]) -> dict[str, float]:
    raw = root / "raw"
    raw.mkdir()
    paths = [raw / f"r{i}" for i in range(len(records))]
    out = {"write_buffered": raw_write(paths, records, direct=False)}
    drop_caches(paths)
    out["read_buffered"] = raw_read(paths, len(records[0]), direct=False)
    out["write_direct"] = raw_write(paths, records, direct=True)
    drop_caches(paths)
    out["read_direct"] = raw_read(paths, len(records[0]), direct=True)
    shutil.rmtree(raw)
    return out


@contextlib.contextmanager
def scratch_dir(root: Path, inodes: int) -> Iterator[tuple[Path, str]]:
    """A directory for many small files: a loop-mounted ext4 image if this process may mount one.

    Deleting 100k files one by one on a ``discard``-mounted filesystem takes
    minutes (about 1.6 ms per unlink on the reference VM); unmounting an
    image and deleting it is one operation.
    """
    img, mnt = root / "rebuild.img", root / "rebuild"
    mnt.mkdir()
    mounted = False
    try:
        with open(img, "wb") as f:
            f.truncate(footprint(inodes * 4096 * 2) + 256 * 2**20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-N", str(inodes + 1024), str(img)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True, capture_output=True)
        mounted = True
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        yield mnt, "ext4 loop image" if mounted else "plain directory"
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
        img.unlink(missing_ok=True)
        shutil.rmtree(mnt, ignore_errors=True)


async def rebuild_bench(root: Path, n: int) -> dict[str, Any]:
    """Lay down ``n`` small records as files (not timed), then time opening the directory."""
    with scratch_dir(root, n) as (d, where):
        payload = os.urandom(256)

        def lay(count: int) -> None:
            for _ in range(count):
                key, rec = make_record(payload)
                fd = os.open(d / record_name(key), os.O_WRONLY | os.O_CREAT, 0o644)
                os.write(fd, rec)
                os.close(fd)

        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lay, [n // 4 + (i < n % 4) for i in range(4)]))
        out: dict[str, Any] = {"chunks": n, "filesystem": where, "lay_down_s": time.perf_counter() - start}
        for label in ("cold_s", "warm_s"):
            if label == "cold_s":
                drop_caches([])
            start = time.perf_counter()
            t = LocalDiskTransport(LocalDiskOptions(path=d, capacity_bytes=2**40, fsync="never"))
            await t.wait_ready()
            out[label] = time.perf_counter() - start
            assert t.stats().chunks == n, t.stats()
            await t.close()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--total-gib", type=float, default=1.0)
    ap.add_argument("--record-mib", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rebuild-chunks", type=int, default=100_000)
    ap.add_argument("--direct-io", choices=["auto", "off"], default="auto", help="transport O_DIRECT writes")
    ap.add_argument("--read-pool-mib", type=int, default=256, help="transport read buffer pool (0: off)")
    args = ap.parse_args()
    print_header()

    root = Path(tempfile.mkdtemp(prefix="kvengine-bench-disk-", dir=args.dir))
    try:
        payload = os.urandom(args.record_mib * 2**20 - 4 * ALIGN)  # record ~= 32 MiB, header included
        count = max(1, int(args.total_gib * 2**30) // (args.record_mib * 2**20))
        items = [make_record(payload) for _ in range(count)]
        records = [r for _, r in items]
        total = sum(len(r) for r in records)
        samples: list[dict[str, float]] = []
        method = ""
        for rep in range(args.repeats):
            if rep % 2 == 0:
                raw = raw_rep(root, records)
                put_s, get_s, method = await transport_rep(root, items, args)
            else:
                put_s, get_s, method = await transport_rep(root, items, args)
                raw = raw_rep(root, records)
            gbps = {k: total / v / 1e9 for k, v in raw.items()}
            gbps["transport_persist"] = total / put_s / 1e9
            gbps["transport_read"] = total / get_s / 1e9
            samples.append(gbps)
            print(f"rep {rep}: " + "  ".join(f"{k}={v:.2f}" for k, v in gbps.items()), flush=True)

        med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        ratios = {
            "persist_vs_best_raw": statistics.median(
                s["transport_persist"] / max(s["write_buffered"], s["write_direct"]) for s in samples),
            "persist_vs_buffered_raw": statistics.median(s["transport_persist"] / s["write_buffered"] for s in samples),
            "read_vs_best_raw": statistics.median(
                s["transport_read"] / max(s["read_buffered"], s["read_direct"]) for s in samples),
            "read_vs_buffered_raw": statistics.median(s["transport_read"] / s["read_buffered"] for s in samples),
        }
        rebuild = await rebuild_bench(root, args.rebuild_chunks)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{count} records x {args.record_mib} MiB = {total / 2**30:.2f} GiB, {args.repeats} repeats, "
          f"dir {args.dir}, cache eviction: {method}")
    print(f"{'path':28s} {'median GB/s':>12s}")
    for k, v in med.items():
        print(f"{k:28s} {v:12.2f}")
    print()
    for k, v in ratios.items():
        print(f"{k:28s} {v:12.2f}")
    print(f"\nindex rebuild of {rebuild['chunks']} chunks ({rebuild['filesystem']}): "
          f"cold cache {rebuild['cold_s']:.2f} s, warm {rebuild['warm_s']:.2f} s")
    path = write_json("disk.json", {
        "config": {**{k: str(v) for k, v in vars(args).items()}, "records": count, "record_bytes": len(records[0])},
        "cache_eviction": method,
        "samples_gbps": samples, "median_gbps": med, "median_ratios": ratios, "rebuild": rebuild,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
