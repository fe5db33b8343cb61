"""LMCache 0.5.6 side of the side-by-side benchmark, and the system-neutral driver both sides run.

Runs INSIDE ``.venv-lmcache`` (``bash scripts/setup_lmcache.sh``)::

    .venv-lmcache/bin/python benchmarks/lmcache_side.py --out /tmp/lm.json [--tokens 32768]

Normally started by ``benchmarks/bench_vs_lmcache.py``, which runs kvengine's
side through the same :func:`run` driver in a process of its own, so both
systems are timed by the same code, with the same workload, in the same
process layout. This module imports neither kvengine nor (at module level)
LMCache; it needs only torch and the standard library.

The driver (:func:`run`) measures, per process:

* hashing: the system's token -> chunk-key entry point, tensor and list input;
* control path: store and lookup+retrieve of a prompt whose chunks are 1 KiB,
  so the copy costs ~nothing and what is left is per-chunk bookkeeping;
* L1: store and lookup+retrieve of the full prompt through host memory,
  interleaved per round with a raw per-chunk ``torch`` copy of the same bytes
  (both directions) -- the physical limit; then storing the cached prompt again;
  RSS beyond the configured pool;
* disk, buffered then O_DIRECT: store until durable, then (page cache dropped)
  lookup+retrieve from disk only, interleaved per round with a raw
  write+fsync and read of the same bytes as one file per chunk, by one
  stream and by 4 parallel streams.

Every retrieve lands in the model's KV buffer itself (as a real engine's
paged KV buffer): the round trip is verified by zeroing the buffer and
comparing a fingerprint. The raw copy goes through a 512 MiB ring of
chunk-sized slots, far larger than any CPU cache; that keeps peak RSS at
buffer + pool (~9 GB for 32k tokens) instead of buffer + copy + pool.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import machine_info

POOL_SLACK = 256 * 2**20
RING_BYTES = 512 * 2**20
#: Threads of the parallel raw-disk baseline (as many as kvengine's disk transport uses by default).
RAW_STREAMS = 4
ALIGN = 4096
VOCAB = 150_000


# -- workload ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class KVShape:
    """The model: KV of ``layers`` x 2 x tokens x ``heads`` x ``head_dim`` in bf16, chunked by ``chunk``."""

    layers: int = 32
    heads: int = 8
    head_dim: int = 128
    chunk: int = 256
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if min(self.layers, self.heads, self.head_dim, self.chunk) <= 0:
            raise ValueError(f"KVShape dimensions must be positive: {self}")

    def nbytes(self, tokens: int) -> int:
        return 2 * self.layers * tokens * self.heads * self.head_dim * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.nbytes(self.chunk)

    def buffer(self, tokens: int) -> torch.Tensor:
        """The model's KV buffer ``[2, L, T, H, D]`` (LMCache's KV_2LTD memory format, H*D split).

        Random bits, different in every chunk: one random chunk, then chunk
        ``i`` is that chunk plus ``i`` (element-wise, int16). Fast (a full
        ``random_`` of 4 GB takes ~40 s here) and chunk-order sensitive.
        """
        out = torch.empty((2, self.layers, tokens, self.heads, self.head_dim), dtype=self.dtype)
        words = out.view(torch.int16)
        base = torch.empty((2, self.layers, min(tokens, self.chunk), self.heads, self.head_dim), dtype=torch.int16)
        base.random_(-16000, 16000, generator=torch.Generator().manual_seed(7))  # no NaN/Inf bit patterns
        for i, start in enumerate(range(0, tokens, self.chunk)):
            end = min(start + self.chunk, tokens)
            torch.add(base[:, :, : end - start], i, out=words[:, :, start:end])
        return out


def prompt(tokens: int, seed: int) -> torch.Tensor:
    """Token ids of one prompt; the same seed gives the same prompt in both processes."""
    return torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(seed))


# -- the interface each side implements ----------------------------------------------------------------------------


class Engine(Protocol):
    """One configured cache engine of a system, bound to one KV buffer."""

    def store(self, tokens: torch.Tensor) -> int:
        """Store every full chunk of ``tokens`` from the buffer; returns chunks actually written."""

    def retrieve(self, tokens: torch.Tensor, request_id: str) -> int:
        """Lookup (pinning), copy the hit into the buffer, release; returns tokens loaded."""

    def close(self) -> None: ...


class DiskEngine(Protocol):
    """A system writing to a local-disk tier, reading back from that tier only."""

    def prepare_write(self) -> None:
        """Untimed: get ready to store (e.g. open an engine with an empty memory tier)."""

    def persist(self, tokens: torch.Tensor) -> tuple[float, float]:
        """Store ``tokens``, return once every chunk is durable on disk: (store returned, durable) in seconds."""

    def prepare_read(self) -> None:
        """Untimed: make sure the next retrieve must come from disk (e.g. reopen with an empty memory tier)."""

    def retrieve(self, tokens: torch.Tensor, request_id: str) -> int: ...

    def close(self) -> None: ...


class Side(Protocol):
    name: str
    version: str
    notes: dict[str, str]

    def hasher(self, shape: KVShape) -> Callable[[Any], int]:
        """The token -> chunk keys entry point its ``store`` uses; returns the number of keys."""

    def open_l1(self, shape: KVShape, pool_bytes: int, buf: torch.Tensor) -> Engine: ...

    def open_disk(self, shape: KVShape, pool_bytes: int, disk_bytes: int, path: Path, direct: bool,
                  buf: torch.Tensor) -> DiskEngine: ...


# -- measurement helpers --------------------------------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return _status("VmRSS")


def peak_rss() -> int:
    return _status("VmHWM")


_PEAK_BEFORE_RESETS = 0


def process_peak_rss() -> int:
    """Peak RSS of the whole process so far, across :func:`reset_peak_rss` calls."""
    return max(_PEAK_BEFORE_RESETS, peak_rss())


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); a no-op where refused."""
    global _PEAK_BEFORE_RESETS
    _PEAK_BEFORE_RESETS = process_peak_rss()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def drop_caches() -> str:
    """Empty the page cache (root); falls back to nothing, reported."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return "NOT DROPPED"


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """(seconds, result) of ``fn(*args)``."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def fingerprint(buf: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Content check: the first, middle and last token of every chunk, all layers and heads (a copy).

    Every chunk's bytes differ (see :meth:`KVShape.buffer`), so a missing,
    misplaced, partial or zeroed chunk changes this; a full comparison of
    4 GB would cost more than the measurement.
    """
    pos = sorted({p for s in range(0, buf.shape[2], chunk)
                  for p in (s, min(s + chunk // 2, buf.shape[2] - 1), min(s + chunk, buf.shape[2]) - 1)})
    return torch.stack([buf[:, :, p] for p in pos])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))  # bitwise, NaN-proof


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class RingCopy:
    """Raw per-chunk copies of the buffer through a ring of chunk slots: the memory-bandwidth limit.

    Chunk ``i`` is copied out (strided buffer -> contiguous slot) and chunk
    ``i - slots`` copied back in from the slot it left ``slots`` chunks ago
    (so from DRAM, not cache); the buffer ends unchanged.
    """

    def __init__(self, shape: KVShape, ring_bytes: int = RING_BYTES) -> None:
        self.shape = shape
        self.slots = max(2, ring_bytes // shape.chunk_bytes)
        self.ring = torch.zeros((self.slots, 2, shape.layers, shape.chunk, shape.heads, shape.head_dim),
                                dtype=shape.dtype)

    def round(self, buf: torch.Tensor) -> tuple[float, float]:
        c, n = self.shape.chunk, buf.shape[2] // self.shape.chunk
        t_out = t_in = 0.0
        clock = time.perf_counter
        for i in range(n + self.slots):
            j = i - self.slots
            if j >= 0:
                t0 = clock()
                buf[:, :, j * c : (j + 1) * c].copy_(self.ring[j % self.slots])
                t_in += clock() - t0
            if i < n:
                t0 = clock()
                self.ring[i % self.slots].copy_(buf[:, :, i * c : (i + 1) * c])
                t_out += clock() - t0
        return t_out, t_in


def _aligned(nbytes: int) -> memoryview:
    m = memoryview(mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN))
    m[:] = b"\0" * len(m)  # prefault: the baseline pays no page faults
    return m


class RawDisk:
    """The disk limit: one file per chunk, written (buffered or O_DIRECT) then all fsynced, and read back
    from a cold page cache into reused aligned buffers; by one stream in file order, or by ``streams``
    threads each taking every ``streams``-th file (what a device with a deep queue needs to be kept busy)."""

    def __init__(self, root: Path, chunk: torch.Tensor) -> None:
        self.root = root
        self.size = chunk.numel() * chunk.element_size()
        self.src = _aligned(self.size)
        self.src[: self.size] = chunk.contiguous().view(torch.uint8).numpy().tobytes()
        self.dst = [_aligned(self.size) for _ in range(RAW_STREAMS)]

    def round(self, files: int, direct: bool, streams: int = 1) -> tuple[float, float]:
        self.root.mkdir(parents=True, exist_ok=True)
        paths = [self.root / f"raw{i}.bin" for i in range(files)]
        flag = os.O_DIRECT if direct else 0
        shares = [paths[k::streams] for k in range(streams)]

        def write(share: list[Path]) -> list[int]:
            fds = []
            for path in share:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
                off = 0
                while off < self.size:
                    off += os.pwrite(fd, self.src[off : self.size], off)
                fds.append(fd)
            return fds

        def sync(fds: list[int]) -> None:  # everything written first: the kernel may batch the writeback
            for fd in fds:
                os.fsync(fd)
                os.close(fd)

        def read(k: int) -> None:
            for path in shares[k]:
                fd = os.open(path, os.O_RDONLY | flag)
                got = 0
                while got < self.size:
                    n = os.preadv(fd, [self.dst[k][got : self.size]], got)
                    if n == 0:
                        break
                    got += n
                os.close(fd)
                assert got == self.size, (path, got)

        with ThreadPoolExecutor(streams) as pool:
            t0 = time.perf_counter()
            fds = list(pool.map(write, shares))
            list(pool.map(sync, fds))
            write_s = time.perf_counter() - t0
            drop_caches()
            t0 = time.perf_counter()
            list(pool.map(read, range(streams)))
            read_s = time.perf_counter() - t0
        shutil.rmtree(self.root)
        return write_s, read_s


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the driver -------------------------------------------------------------------------------------------------------


def bench_hashing(side: Side, shape: KVShape, tokens: int, repeats: int) -> dict[str, float]:
    ids = prompt(tokens, 1)
    as_list = ids.tolist()
    fn = side.hasher(shape)
    out = {}
    for label, value in (("tensor", ids), ("list", as_list)):
        assert fn(value) == tokens // shape.chunk
        times = [timed(fn, value)[0] for _ in range(max(30, repeats * 10))]
        out[f"{label}_mtok_s"] = tokens / median(times) / 1e6
    return out


def bench_control(side: Side, tokens: int, repeats: int) -> dict[str, float]:
    """Per-chunk cost with 1 KiB chunks: hashing, allocation, pins, copies-call overhead, bookkeeping."""
    shape = KVShape(layers=1, heads=1, head_dim=1)
    n = tokens // shape.chunk
    buf = shape.buffer(tokens)
    eng = side.open_l1(shape, 64 * 2**20, buf)
    try:
        store, retrieve = [], []
        for r in range(max(10, repeats * 4)):
            ids = prompt(tokens, 1000 + r)
            dt, stored = timed(eng.store, ids)
            assert stored == n, (stored, n)
            store.append(dt)
            dt, loaded = timed(eng.retrieve, ids, f"ctl{r}")
            assert loaded == tokens, (loaded, tokens)
            retrieve.append(dt)
    finally:
        eng.close()
    return {"chunks": n, "store_us_per_chunk": median(store) / n * 1e6,
            "retrieve_us_per_chunk": median(retrieve) / n * 1e6}


def bench_l1(side: Side, shape: KVShape, buf: torch.Tensor, repeats: int) -> dict[str, Any]:
    tokens = buf.shape[2]
    nbytes = shape.nbytes(tokens)
    pool = nbytes + POOL_SLACK
    ring = RingCopy(shape)
    ref = fingerprint(buf)
    gc.collect()
    base = rss()
    reset_peak_rss()
    open_s, eng = timed(side.open_l1, shape, pool, buf)
    try:
        first = prompt(tokens, 10)
        warm_store, stored = timed(eng.store, first)  # first touch of the pool and every store path
        assert stored == tokens // shape.chunk, stored
        rounds = []
        ids = first
        for r in range(repeats):
            raw_out, raw_in = ring.round(buf)
            ids = prompt(tokens, 11 + r)  # fresh keys: the previous prompt is evicted
            store_s, stored = timed(eng.store, ids)
            assert stored == tokens // shape.chunk, f"round {r}: stored {stored} chunks"
            retrieve_s, loaded = timed(eng.retrieve, ids, f"l1-{r}")
            assert loaded == tokens, f"round {r}: loaded {loaded} tokens"
            rounds.append({"raw_out_s": raw_out, "raw_in_s": raw_in, "store_s": store_s, "retrieve_s": retrieve_s})
            log(f"{side.name} L1 round {r}: raw out {nbytes / raw_out / 1e9:.2f} in {nbytes / raw_in / 1e9:.2f} "
                f"store {nbytes / store_s / 1e9:.2f} retrieve {nbytes / retrieve_s / 1e9:.2f} GB/s")
        steady = rss()
        peak = peak_rss()
        buf.zero_()
        loaded = eng.retrieve(ids, "verify")
        if loaded != tokens or not same(fingerprint(buf), ref):
            raise AssertionError(f"{side.name}: L1 round trip is not byte-identical (loaded {loaded})")
        again = []
        for _ in range(1):  # LMCache takes seconds here; passes give more samples
            dt, stored = timed(eng.store, ids)
            again.append({"s": dt, "stored_chunks": stored})
    finally:
        eng.close()
    gc.collect()
    gb = nbytes / 1e9
    return {
        "tokens": tokens, "bytes": nbytes, "pool_bytes": pool, "open_s": open_s,
        "warmup_store_gbps": gb / warm_store,
        **summarize_l1(rounds, nbytes),
        "store_again_ms": median([a["s"] for a in again]) * 1e3,
        "store_again_stored_chunks": [a["stored_chunks"] for a in again],
        "rss_base_bytes": base,
        "overhead_steady_bytes": steady - base - pool,
        "overhead_peak_bytes": peak - base - pool,
    }


def bench_disk(side: Side, shape: KVShape, buf: torch.Tensor, repeats: int, root: Path) -> dict[str, Any]:
    tokens = buf.shape[2]
    nbytes = shape.nbytes(tokens)
    files = tokens // shape.chunk
    pool = nbytes + POOL_SLACK
    ref = fingerprint(buf)
    raw = RawDisk(root / f"{side.name}-raw", buf[:, :, : shape.chunk])
    gb = nbytes / 1e9
    out: dict[str, Any] = {"tokens": tokens, "bytes": nbytes, "files": files, "cache_drop": drop_caches()}
    seed = 100
    for mode in ("buffered", "direct"):
        rounds = []
        path = root / f"{side.name}-{mode}"
        eng = side.open_disk(shape, pool, (repeats + 1) * (nbytes + files * 2 * ALIGN), path, mode == "direct", buf)
        try:
            for r in range(repeats):
                row: dict[str, float] = {}
                order = ("raw", "sys") if r % 2 == 0 else ("sys", "raw")
                for what in order:
                    if what == "raw":
                        row["raw_write_s"], row["raw_read_s"] = raw.round(files, mode == "direct")
                        row["raw_write_par_s"], row["raw_read_par_s"] = raw.round(files, mode == "direct", RAW_STREAMS)
                        continue
                    seed += 1
                    ids = prompt(tokens, seed)
                    eng.prepare_write()
                    row["returned_s"], row["persist_s"] = eng.persist(ids)
                    eng.prepare_read()
                    buf.zero_()
                    drop_caches()
                    gc.collect()
                    base = rss()
                    reset_peak_rss()
                    row["read_s"], loaded = timed(eng.retrieve, ids, f"disk-{mode}-{r}")
                    row["read_peak_overhead_bytes"] = peak_rss() - base
                    if loaded != tokens or not same(fingerprint(buf), ref):
                        raise AssertionError(f"{side.name}: disk ({mode}) round trip failed (loaded {loaded})")
                rounds.append(row)
                log(f"{side.name} disk {mode} round {r}: raw write {gb / row['raw_write_s']:.2f} "
                    f"(4 streams {gb / row['raw_write_par_s']:.2f}) read {gb / row['raw_read_s']:.2f} "
                    f"(4 streams {gb / row['raw_read_par_s']:.2f}); persist {gb / row['persist_s']:.2f} "
                    f"(store returned {row['returned_s']:.2f}s) read {gb / row['read_s']:.2f} GB/s")
        finally:
            eng.close()
            gc.collect()
            shutil.rmtree(path, ignore_errors=True)
        out[mode] = summarize_disk(rounds, nbytes)
    return out


def summarize_l1(rounds: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    """Medians of L1 rounds; "vs raw" ratios are per round (raw copy measured next to the operation)."""
    gb = nbytes / 1e9
    return {
        "rounds": rounds,
        "raw_out_gbps": gb / median([r["raw_out_s"] for r in rounds]),
        "raw_in_gbps": gb / median([r["raw_in_s"] for r in rounds]),
        "store_gbps": gb / median([r["store_s"] for r in rounds]),
        "retrieve_gbps": gb / median([r["retrieve_s"] for r in rounds]),
        "store_vs_raw": median([r["raw_out_s"] / r["store_s"] for r in rounds]),
        "retrieve_vs_raw": median([r["raw_in_s"] / r["retrieve_s"] for r in rounds]),
    }


def summarize_disk(rounds: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    """Medians of one disk mode's rounds; "vs raw" ratios are per round."""
    gb = nbytes / 1e9
    return {
        "rounds": rounds,
        "raw_write_gbps": gb / median([r["raw_write_s"] for r in rounds]),
        "raw_read_gbps": gb / median([r["raw_read_s"] for r in rounds]),
        "raw_write_par_gbps": gb / median([r["raw_write_par_s"] for r in rounds]),
        "raw_read_par_gbps": gb / median([r["raw_read_par_s"] for r in rounds]),
        "persist_gbps": gb / median([r["persist_s"] for r in rounds]),
        "read_gbps": gb / median([r["read_s"] for r in rounds]),
        "persist_vs_raw": median([min(r["raw_write_s"], r["raw_write_par_s"]) / r["persist_s"] for r in rounds]),
        "read_vs_raw": median([min(r["raw_read_s"], r["raw_read_par_s"]) / r["read_s"] for r in rounds]),
        "store_returned_s": median([r["returned_s"] for r in rounds]),
        "read_peak_overhead_bytes": max(r["read_peak_overhead_bytes"] for r in rounds),
    }


def run(side: Side, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement for one system, in a fixed order; returns the JSON-ready result."""
    torch.set_num_threads(args.threads)
    shape = KVShape()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"system": side.name, "version": side.version, "notes": side.notes,
                              "pid": os.getpid(), "torch": torch.__version__, "threads": args.threads,
                              "shape": {"layers": shape.layers, "heads": shape.heads, "head_dim": shape.head_dim,
                                        "chunk": shape.chunk, "dtype": str(shape.dtype)}}
    machine = machine_info()  # each side records its own (its venv's python and torch may differ)
    result["machine"] = machine.as_dict()
    log(f"{side.name} machine: {machine}")
    parts = set(args.parts.split(","))
    if "hashing" in parts:
        result["hashing"] = bench_hashing(side, shape, args.tokens, args.repeats)
        log(f"{side.name} hashing: {result['hashing']}")
    if "control" in parts:
        result["control"] = bench_control(side, args.tokens, args.repeats)
        log(f"{side.name} control: {result['control']}")
    buf = shape.buffer(args.tokens)
    if "l1" in parts:
        result["l1"] = bench_l1(side, shape, buf, args.repeats)
    if "disk" in parts and args.disk_tokens > 0 and args.disk_repeats > 0:
        root = Path(args.dir)
        root.mkdir(parents=True, exist_ok=True)
        disk_tokens = min(args.disk_tokens, args.tokens) // shape.chunk * shape.chunk
        result["disk"] = bench_disk(side, shape, buf[:, :, :disk_tokens], args.disk_repeats, root)
    result["process_peak_rss_bytes"] = process_peak_rss()
    result["wall_s"] = time.perf_counter() - t0
    return result


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=32768, help="prompt length for hashing, control and L1 rows")
    ap.add_argument("--disk-tokens", type=int, default=32768,
                    help="prompt length for disk rows (0: skip); its first tokens of the same buffer")
    ap.add_argument("--repeats", type=int, default=2, help="L1 rounds (raw copy, store, retrieve interleaved)")
    ap.add_argument("--disk-repeats", type=int, default=1, help="disk rounds per mode (buffered, O_DIRECT)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--dir", default="/tmp/kvengine-vs-lmcache", help="scratch directory for disk rows")
    ap.add_argument("--parts", default="hashing,control,l1,disk", help="comma-separated subset to run")
    ap.add_argument("--out", required=True, help="write the JSON result here")


# -- LMCache ----------------------------------------------------------------------------------------------------------


class _Connector:
    """Minimal copy-in/copy-out connector: ``[2, L, T, H*D]`` slices of a host buffer <-> memory objects."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf.view(buf.shape[0], buf.shape[1], buf.shape[2], -1)  # [2, L, T, H*D]

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.buf.shape[1], num_tokens, self.buf.shape[3]])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(self.buf[:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.buf[:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end)


class _LMEngine:
    """One ``LMCacheEngine`` built through its builder, ``post_init()`` done."""

    _count = 0

    def __init__(self, shape: KVShape, buf: torch.Tensor, **config: Any) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
        from lmcache.v1.metadata import LMCacheMetadata

        connector_cls = type("CopyConnector", (_Connector, GPUConnectorInterface), {})
        _LMEngine._count += 1
        self.instance_id = f"bench{_LMEngine._count}"
        self.builder = LMCacheEngineBuilder
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=shape.chunk, **config)
        md = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                             kv_dtype=shape.dtype, chunk_size=shape.chunk,
                             kv_shape=(shape.layers, 2, shape.chunk, shape.heads, shape.head_dim))
        self.engine = LMCacheEngineBuilder.get_or_create(self.instance_id, cfg, md, connector_cls(buf), None, None)
        self.engine.post_init()  # without it store fails on `assert self.storage_manager`
        self.chunk = shape.chunk

    def store(self, tokens: torch.Tensor) -> int:
        """Chunks newly written: LMCache's store returns nothing, so count its allocations."""
        manager = self.engine.storage_manager
        alloc = manager.allocate
        count = 0

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            obj = alloc(*args, **kwargs)
            count += obj is not None
            return obj

        manager.allocate = counting
        try:
            self.engine.store(tokens)
        finally:
            del manager.allocate
        return count

    def retrieve(self, tokens: torch.Tensor, request_id: str) -> int:
        self.engine.lookup(tokens, lookup_id=request_id, pin=True)
        try:
            mask = self.engine.retrieve(tokens, req_id=request_id)
        finally:
            self.engine.lookup_unpin(request_id)
        return int(mask.sum())

    def close(self) -> None:
        self.builder.destroy(self.instance_id)
        self.engine = None


class LMCacheSide:
    name = "lmcache"

    def __init__(self) -> None:
        import importlib.metadata as md

        self.version = md.version("lmcache")
        self.notes = {
            "hash": "builtin Python hash of (prefix hash, token tuple) per chunk (default pre_caching_hash_algorithm)",
            "connector": "benchmarks/lmcache_side.py CopyConnector: per-chunk torch copy of [2, L, 256, H*D] slices",
            "disk_durability": "LMCache never fsyncs its disk files; persist time adds an fsync of every file "
                               "after its writes complete, to reach the same durability point as kvengine",
            "disk_read": "local_cpu=False: retrieve reads from disk into staging memory objects, then copies out",
        }

    def hasher(self, shape: KVShape) -> Callable[[Any], int]:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.token_database import ChunkedTokenDatabase

        cfg = LMCacheEngineConfig.from_defaults(chunk_size=shape.chunk, max_local_cpu_size=0.01)
        md = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                             kv_dtype=shape.dtype, chunk_size=shape.chunk,
                             kv_shape=(shape.layers, 2, shape.chunk, shape.heads, shape.head_dim))
        db = ChunkedTokenDatabase(cfg, md)
        return lambda tokens: sum(1 for _ in db.process_tokens(tokens=tokens))

    def open_l1(self, shape: KVShape, pool_bytes: int, buf: torch.Tensor) -> Engine:
        return _LMEngine(shape, buf, local_cpu=True, max_local_cpu_size=pool_bytes / 2**30)

    def open_disk(self, shape: KVShape, pool_bytes: int, disk_bytes: int, path: Path, direct: bool,
                  buf: torch.Tensor) -> DiskEngine:
        path.mkdir(parents=True, exist_ok=True)
        return _LMDisk(shape, buf, local_cpu=False, max_local_cpu_size=pool_bytes / 2**30,
                       local_disk=str(path) + "/", max_local_disk_size=disk_bytes / 2**30,
                       extra_config={"use_odirect": direct})


class _LMDisk(_LMEngine):
    def __init__(self, shape: KVShape, buf: torch.Tensor, **config: Any) -> None:
        super().__init__(shape, buf, **config)
        self.disk = self.engine.storage_manager.storage_backends["LocalDiskBackend"]
        self.db = self.engine.token_database

    def prepare_write(self) -> None:
        pass

    def persist(self, tokens: torch.Tensor) -> tuple[float, float]:
        t0 = time.perf_counter()
        stored = self.store(tokens)
        returned = time.perf_counter() - t0
        keys = [key for _, _, key in self.db.process_tokens(tokens=tokens)]
        assert stored == len(keys), (stored, len(keys))
        while True:  # puts run on LMCache's disk worker threads
            with self.disk.disk_lock:
                done = all(k in self.disk.dict for k in keys)
            if done and not self.disk.disk_worker.put_tasks:
                break
            time.sleep(0.001)
        for key in keys:  # LMCache never fsyncs: reach the same durability point as kvengine
            fd = os.open(self.disk.dict[key].path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return returned, time.perf_counter() - t0

    def prepare_read(self) -> None:
        hot = getattr(self.engine.storage_manager.storage_backends.get("LocalCPUBackend"), "hot_cache", {})
        assert not hot, "local_cpu=False, yet chunks are cached in memory"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    args = ap.parse_args()
    result = run(LMCacheSide(), args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    log(f"lmcache side done in {result['wall_s']:.0f}s, wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
