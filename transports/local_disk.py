"""Local-disk transport: chunk records as files in one directory, LRU-bounded.

One file per record (``<key hex>.kvc``, see :mod:`._disk_files`), written to
a temp file and published with ``os.replace``: a reader sees nothing or a
whole record. Files rather than segments because chunks are MiBs: eviction
is an ``unlink``, recovery needs no log, nothing needs compacting.

fsync policy (``LocalDiskOptions.fsync``):

* ``"never"``  -- no fsync; a crash may lose recent puts or leave a torn
  file, which is detected (restart scan or ``get``), deleted and counted.
* ``"data"``   -- fdatasync the temp file before the rename: a put that
  returned True has its bytes on stable storage; the name may still be lost
  in a power cut (the chunk is then simply missing).
* ``"always"`` -- also fsync the directory after renames and unlinks.

Capacity counts each record rounded up to 4 KiB blocks and is never
exceeded, on disk either: space is reserved before a write starts, evicting
the least recently read-or-written records, whose files are unlinked before
the space is reused. After a restart the LRU order starts from file mtimes.

Restart: the directory is scanned in the background (headers only) when the
transport is built; operations wait for it. Records of another format
version, or of a namespace outside ``namespaces``, are left alone and not
indexed (nor counted against capacity); corrupt or torn records are deleted
and counted; temp files of writers no longer alive are removed. Several
processes may open one directory, but each enforces capacity on what it
indexed at open: give one of them the writer role.

Records can vanish behind the index (an operator's ``rm``, another process's
eviction). A put of an indexed key first checks (one ``lstat``) that its file
is still there, so it writes it again rather than claim it stored; every
``reconcile_seconds`` one listing of the directory's names unindexes the
records that are gone, so ``chunks`` and ``used_bytes`` say what is on disk
(counted as ``vanished``); a get of one is a miss, as before.

The directory is untrusted (:mod:`kvengine.untrusted_files`): a name that
looks like a record but is not a regular file (a FIFO, a link, a device) is
never opened for reading, so neither the restart scan nor a get can block on
it; it is left alone, not indexed, and a get of it is a miss (counted in
``read_errors``).

Faults never raise: a full disk (ENOSPC/EDQUOT), a read-only directory
(EROFS/EACCES/EPERM) or another I/O error makes ``put`` return False
(counted per reason, logged once per reason) and reads keep working. Every
``get`` verifies with :func:`kvengine.chunks.record.unpack_record`; a failure is a
miss, the file is deleted and the reason counted. Caller mistakes (a record
not matching its key, a namespace outside ``namespaces``, use after
``close``) raise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, get_args

from pydantic import ValidationError

from kvengine.chunks.keys import DIGEST_BYTES, ChunkKey, NamespaceDigest
from kvengine.chunks.record import RecordHeader, decode_header, unpack_record
from kvengine.config import DiskConfig
from kvengine.errors import ConfigError, IntegrityError, InvalidRequestError, TransportError
from kvengine.threads import executor, start_thread
from kvengine.transport import Buffer, Capability
from kvengine.untrusted_files import UnsafeFileError

from ._disk_files import RECORD_SUFFIX, FsyncPolicy, RecordFiles, ScanResult, footprint, record_name

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_PUT_REASONS = {errno.ENOSPC: "no_space", errno.EDQUOT: "no_space", errno.EROFS: "read_only",
                errno.EACCES: "read_only", errno.EPERM: "read_only"}


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalDiskOptions:
    """Everything the transport needs; build from a :class:`DiskConfig` with :meth:`from_config`."""

    path: Path
    capacity_bytes: int
    fsync: FsyncPolicy = "data"
    #: Namespaces this process serves; records of others are ignored. None: all.
    namespaces: frozenset[NamespaceDigest] | None = None
    #: None: O_DIRECT for large records where the filesystem accepts it; False: never; True: required.
    direct_io: bool | None = None
    io_threads: int = 4
    #: Idle read buffers kept for reuse (fresh memory costs a page fault per 4 KiB).
    read_pool_bytes: int = 256 * 2**20
    #: How often indexed records are checked to be still on disk (another process may delete or evict
    #: them), on a thread of its own; stretched to 20x the last check's duration (at most 5% of a core). 0: never.
    reconcile_seconds: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.capacity_bytes <= 0:
            raise ConfigError(f"local_disk capacity_bytes must be > 0, got {self.capacity_bytes}")
        if self.fsync not in get_args(FsyncPolicy):
            raise ConfigError(f"local_disk fsync must be one of {get_args(FsyncPolicy)}, got {self.fsync!r}")
        if self.io_threads < 1:
            raise ConfigError(f"local_disk io_threads must be >= 1, got {self.io_threads}")
        if not self.reconcile_seconds >= 0:
            raise ConfigError(f"local_disk reconcile_seconds must be >= 0, got {self.reconcile_seconds}")
        if self.namespaces is not None and any(len(ns) != DIGEST_BYTES for ns in self.namespaces):
            raise ConfigError("local_disk namespaces must be 16-byte namespace digests")

    @classmethod
    def from_config(cls, disk: DiskConfig, **extra: Any) -> LocalDiskOptions:
        if disk.path is None:
            raise ConfigError("disk.path is required for the local_disk transport")
        return cls(path=Path(disk.path), capacity_bytes=int(disk.capacity_bytes), fsync=disk.fsync, **extra)


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskStats:
    """A consistent snapshot of the transport's state and counters (monotonic unless noted)."""

    chunks: int  # gauge
    used_bytes: int  # gauge, including space reserved by in-flight puts
    capacity_bytes: int
    puts_ok: int
    puts_deduplicated: int  # put of a key already stored (its file checked to be there): nothing written
    puts_failed: int
    hits: int
    misses: int
    read_errors: int  # I/O errors on reads, names that are not regular files (also counted as misses)
    integrity_failures: int
    evictions: int
    bytes_written: int
    bytes_read: int
    vanished: int  # indexed records whose file was gone (deleted, evicted by another process): unindexed
    put_failures: Mapping[str, int] = field(default_factory=dict)  # by reason
    integrity_reasons: Mapping[str, int] = field(default_factory=dict)
    direct_io: bool = False
    rebuild_seconds: float = 0.0

    @property
    def call_failures(self) -> Mapping[str, int]:
        """Tier calls that failed and were answered as misses, by op (``kvengine_tier_errors_total``)."""
        return {"get": self.read_errors}


_COUNTERS = ("puts_ok", "puts_deduplicated", "puts_failed", "hits", "misses", "read_errors",
             "integrity_failures", "evictions", "bytes_written", "bytes_read", "vanished")


class LocalDiskTransport:
    """A :class:`kvengine.transport.ChunkTransport` over a local directory."""

    name = "local_disk"

    def __init__(self, options: LocalDiskOptions) -> None:
        self.options = options
        parent = options.path.parent
        if not options.path.is_dir() and not parent.is_dir():
            # Never create parents: a mount point that is missing would silently become a
            # directory on the root filesystem, and fill it.
            raise TransportError(f"disk cache directory {options.path}: its parent {parent} does not exist "
                                 "(a missing mount?); create it first")
        try:
            options.path.mkdir(exist_ok=True)
        except OSError as exc:
            if not options.path.is_dir():
                raise TransportError(f"cannot create disk cache directory {options.path}: {exc}") from exc
        self._files = RecordFiles(options.path, direct_io=options.direct_io,
                                  pool_bytes=options.read_pool_bytes)
        self._pool = executor(options.io_threads, "kvengine-disk")
        self._cond = threading.Condition()
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> record length, LRU first
        self._published = 0  # footprint of indexed records
        self._reserved = 0  # footprint of in-flight puts
        self._unlinking = 0  # footprint of records dropped from the index, not yet unlinked
        self._counts: Counter[str] = Counter()
        self._put_reasons: Counter[str] = Counter()
        self._bad_reasons: Counter[str] = Counter()
        self._warned: set[str] = set()
        self._rebuild_seconds = 0.0
        self._closed = False
        #: Keys published since the running reconcile listed the directory (kept by it whatever it saw).
        self._fresh: set[ChunkKey] | None = None
        self._stopping = threading.Event()
        self._reconciling = threading.Lock()  # one reconcile at a time: they share _fresh
        self._ready = self._pool.submit(self._rebuild)
        if options.reconcile_seconds > 0:
            start_thread(self._reconcile_loop, "kvengine-disk-reconcile")

    # -- ChunkTransport -------------------------------------------------------
    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return await self.put_parts([(key, (buf,)) for key, buf in items])

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        await self._begin()
        hits = self._lookup(keys)
        pending = (self._get_hit(key, hit) for key, hit in zip(keys, hits, strict=True))
        return list(await asyncio.gather(*pending))

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        await self._begin()
        with self._cond:
            return [key in self._index for key in keys]

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        await self._begin()
        return await self._run(self._delete_many, list(keys))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        await asyncio.to_thread(self._pool.shutdown, True)

    # -- extras ---------------------------------------------------------------
    #: :meth:`put_parts` writes a record given as parts (the engine's header + memory slot) without joining them;
    #: :meth:`get_into` accepts a placement function (the engine reads records straight into memory slots).
    capabilities = frozenset({Capability.GATHERED_WRITES, Capability.PLACED_READS})

    async def put_parts(self, items: Sequence[tuple[ChunkKey, Sequence[Buffer]]]) -> list[bool]:
        """:meth:`put` of records given as parts, written in order as one file (no copy to join them)."""
        await self._begin()
        checked = [(key, self._checked_record(key, parts)) for key, parts in items]
        return list(await asyncio.gather(*(self._run(self._put_one, key, views) for key, views in checked)))

    async def get_into(
        self, key: ChunkKey, out: bytearray | memoryview | Callable[[RecordHeader], Buffer | None]
    ) -> RecordHeader | None:
        """Read ``key``'s payload straight into ``out`` (verified); its header, or None on a miss.

        ``out`` may also be a function of the record's verified header that
        returns the destination (at least ``header.payload_length`` bytes). It
        runs on an I/O thread before the payload is read; if it returns None
        nothing more is read and None is returned (neither a hit nor a miss).
        The payload checksum is verified once, over the bytes in the
        destination; on a failure the destination holds garbage, the record is
        deleted and counted, and None is returned.
        """
        await self._begin()
        place = partial(_placed, out) if callable(out) else _writable(out)
        if not self._lookup([key])[0]:
            return None
        header = await self._run(self._guarded_read, key, lambda: self._files.read_into(key, place))
        if header is not None:
            with self._cond:
                self._counts["hits"] += 1
                self._counts["bytes_read"] += header.record_length
        return header

    async def wait_ready(self) -> None:
        """Wait for the startup index rebuild (every operation also waits for it)."""
        await asyncio.wrap_future(self._ready)

    async def reconcile(self) -> int:
        """Unindex records whose file is gone (what the background check does every
        ``reconcile_seconds``); how many were."""
        await self._begin()
        return await self._run(self._reconcile)

    def stats(self) -> DiskStats:
        with self._cond:
            return DiskStats(
                chunks=len(self._index), used_bytes=self._published + self._reserved + self._unlinking,
                capacity_bytes=self.options.capacity_bytes, **{name: self._counts[name] for name in _COUNTERS},
                put_failures=dict(self._put_reasons), integrity_reasons=dict(self._bad_reasons),
                direct_io=self._files.direct, rebuild_seconds=self._rebuild_seconds,
            )

    # -- plumbing (event loop side) ---------------------------------------------
    async def _begin(self) -> None:
        if self._closed:
            raise TransportError("local_disk transport is closed")
        if not self._ready.done():
            await asyncio.wrap_future(self._ready)

    def _run(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _checked_record(self, key: ChunkKey, parts: Sequence[Buffer]) -> list[memoryview]:
        """Caller-mistake checks on the header only (the payload checksum is the reader's job)."""
        views = [memoryview(part).cast("B") for part in parts]
        ns = self.options.namespaces
        if ns is not None and key.namespace not in ns:
            raise InvalidRequestError("put of a chunk outside this transport's namespaces")
        try:
            header = decode_header(views[0] if views else b"", expect_namespace=key.namespace)
        except IntegrityError as exc:
            raise InvalidRequestError(
                f"put of a malformed record (its first part must hold the header): {exc}") from None
        if header.key != key or header.record_length != sum(v.nbytes for v in views):
            raise InvalidRequestError("put of a record whose header does not match its key or length")
        return views

    def _lookup(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is indexed, touching the LRU order of hits; misses counted here."""
        with self._cond:
            hits = [key in self._index for key in keys]
            for key, hit in zip(keys, hits, strict=True):
                if hit:
                    self._index.move_to_end(key)
            self._counts["misses"] += hits.count(False)
        return hits

    async def _get_hit(self, key: ChunkKey, hit: bool) -> Buffer | None:
        return await self._run(self._get_one, key) if hit else None

    # -- workers (thread pool side) ---------------------------------------------
    def _put_one(self, key: ChunkKey, parts: list[memoryview]) -> bool:
        nbytes = sum(part.nbytes for part in parts)
        need = footprint(nbytes)
        if need > self.options.capacity_bytes:
            return self._put_failed("too_large", f"{nbytes} B record > capacity")
        self._drop_if_vanished(key)  # a put of an indexed key whose file is gone must write it again
        if not self._reserve(key, need):
            return True  # already stored: content-addressed, nothing to write
        failure: OSError | None = None
        try:
            self._files.write(key, parts, self.options.fsync)
        except OSError as exc:
            failure = exc
        finally:  # also on unexpected errors: a leaked reservation would block later puts
            with self._cond:
                self._reserved -= need
                if failure is None:
                    self._forget_locked(key)
                    self._index[key] = nbytes
                    self._published += need
                    if self._fresh is not None:
                        self._fresh.add(key)
                    self._counts["puts_ok"] += 1
                    self._counts["bytes_written"] += nbytes
                self._cond.notify_all()
        if failure is not None:
            return self._put_failed(_PUT_REASONS.get(failure.errno or 0, "io_error"), str(failure))
        return True

    def _drop_if_vanished(self, key: ChunkKey) -> None:
        """Unindex ``key`` if it is indexed but its file is gone or not what was indexed (one ``lstat``)."""
        with self._cond:
            length = self._index.get(key)
        if length is None or self._files.holds(key, length):
            return
        with self._cond:
            if self._index.get(key) == length:  # not re-published meanwhile
                self._forget_locked(key)
                self._counts["vanished"] += 1
                self._cond.notify_all()

    def _reserve(self, key: ChunkKey, need: int) -> bool:
        """Reserve ``need`` bytes, evicting LRU records first; False if ``key`` is already stored
        (indexed: checked on disk by :meth:`_drop_if_vanished` just before, or published meanwhile)."""
        cap = self.options.capacity_bytes
        while True:
            with self._cond:
                if key in self._index:
                    self._index.move_to_end(key)
                    self._counts["puts_deduplicated"] += 1
                    return False
                if self._published + self._reserved + self._unlinking + need <= cap:
                    self._reserved += need
                    return True
                short = self._published + self._reserved + need - cap  # once pending unlinks are done
                if short <= 0 or not self._index:  # in-flight puts or unlinks will free the space
                    self._cond.wait()
                    continue
                victims, freed = [], 0
                while freed < short and self._index:
                    victim = next(iter(self._index))
                    freed += self._detach_locked(victim)
                    victims.append(victim)
                self._counts["evictions"] += len(victims)
            self._unlink(victims, freed)

    def _detach_locked(self, key: ChunkKey) -> int:
        """Drop ``key`` from the index, its footprint now counted as being unlinked."""
        size = self._index.pop(key, None)
        freed = footprint(size) if size is not None else 0
        self._published -= freed
        self._unlinking += freed
        return freed

    def _forget_locked(self, key: ChunkKey) -> None:
        """Drop ``key`` from the index whose file is already gone."""
        size = self._index.pop(key, None)
        if size is not None:
            self._published -= footprint(size)

    def _unlink(self, keys: list[ChunkKey], freed: int) -> list[bool]:
        """Unlink ``keys``' files, then release the ``freed`` bytes :meth:`_detach_locked` held back."""
        done = [self._files.unlink(key) for key in keys]
        if self.options.fsync == "always" and any(done):
            with contextlib.suppress(OSError):
                self._files.sync_dir()
        with self._cond:
            self._unlinking -= freed
            self._cond.notify_all()
        return done

    def _delete_many(self, keys: list[ChunkKey]) -> list[bool]:
        with self._cond:
            freed = sum(self._detach_locked(key) for key in keys)
        return self._unlink(keys, freed)

    def _get_one(self, key: ChunkKey) -> Buffer | None:
        check = partial(unpack_record, expect_key=key)
        buf = self._guarded_read(key, partial(self._files.read, key, check, max_bytes=self.options.capacity_bytes))
        if buf is not None:
            with self._cond:
                self._counts["hits"] += 1
                self._counts["bytes_read"] += len(buf)
        return buf

    def _guarded_read(self, key: ChunkKey, read: Callable[[], _T]) -> _T | None:
        """Run ``read``; a vanished file or a failed check (file deleted) is a counted miss."""
        try:
            return read()
        except FileNotFoundError:
            pass
        except UnsafeFileError as exc:  # a FIFO, a link, a device under a record's name: never read
            self._warn_once("unsafe", "%s; served as a miss", exc)
            with self._cond:
                self._counts["read_errors"] += 1
        except IntegrityError as exc:
            with self._cond:
                self._counts["integrity_failures"] += 1
                self._bad_reasons[exc.reason] += 1
            self._warn_once(f"integrity:{exc.reason}", "corrupt record %s (%s); deleted", key.hex(), exc)
        except OSError as exc:
            self._warn_once("read_error", "read of %s failed: %s", key.hex(), exc)
            with self._cond:
                self._counts["read_errors"] += 1
                self._counts["misses"] += 1
            return None
        with self._cond:
            self._forget_locked(key)
            self._counts["misses"] += 1
        return None

    def _put_failed(self, reason: str, detail: str) -> bool:
        with self._cond:
            self._counts["puts_failed"] += 1
            self._put_reasons[reason] += 1
        self._warn_once(f"put:{reason}", "puts to %s are failing (%s: %s); further ones are only counted",
                        self.options.path, reason, detail)
        return False

    def _warn_once(self, reason: str, message: str, *args: object) -> None:
        with self._cond:
            if reason in self._warned:
                return
            self._warned.add(reason)
        log.warning("local_disk: " + message, *args)

    def _rebuild(self) -> None:
        start = time.perf_counter()
        accept: Callable[[NamespaceDigest], bool] = (
            (lambda ns: True) if self.options.namespaces is None else self.options.namespaces.__contains__
        )
        try:
            found = self._files.scan(accept)
        except OSError as exc:
            self._warn_once("scan", "cannot scan %s, starting empty: %s", self.options.path, exc)
            found = ScanResult()
        with self._cond:
            for key, size, _ in found.records:
                self._index[key] = size
                self._published += footprint(size)
            for reason in found.corrupt:
                self._bad_reasons[reason] += 1
            self._counts["integrity_failures"] += len(found.corrupt)
        if found.corrupt:
            self._warn_once("integrity:scan", "deleted %d corrupt records in %s", len(found.corrupt), self.options.path)
        if found.unsafe:
            self._warn_once("unsafe", "%d names in %s that look like records are not regular files, left alone and "
                            "not indexed (%s)", len(found.unsafe), self.options.path, found.unsafe[0])
        with self._cond:  # a smaller capacity than last time: trim, oldest first
            victims, freed = [], 0
            while self._published > self.options.capacity_bytes:
                victim = next(iter(self._index))
                freed += self._detach_locked(victim)
                victims.append(victim)
            self._counts["evictions"] += len(victims)
        self._unlink(victims, freed)
        self._rebuild_seconds = time.perf_counter() - start
        log.info("local_disk: indexed %d records in %s in %.2f s (%d ignored, %d corrupt, %d temp files removed)",
                 len(found.records), self.options.path, self._rebuild_seconds, found.ignored,
                 len(found.corrupt), found.temps_removed)

    def _reconcile(self) -> int:
        """Unindex records whose name is gone from the directory (each confirmed by an ``lstat``); how many.

        One listing of names, nothing opened: cheap next to stat'ing every record. A record published
        while the listing runs may be missing from it, so those are kept (``_fresh``).
        """
        with self._reconciling:
            with self._cond:
                self._fresh = set()
            try:
                try:
                    names = self._files.names()
                except OSError as exc:
                    self._warn_once("reconcile", "cannot list %s to find vanished records: %s", self.options.path, exc)
                    return 0
                with self._cond:
                    indexed = list(self._index.items())
                gone = [(key, size) for key, size in indexed
                        if record_name(key) not in names and not self._files.holds(key, size)]
                with self._cond:
                    dropped = [key for key, size in gone if self._index.get(key) == size and key not in self._fresh]
                    for key in dropped:
                        self._forget_locked(key)
                    self._counts["vanished"] += len(dropped)
                    self._cond.notify_all()
            finally:
                with self._cond:
                    self._fresh = None
        if dropped:
            self._warn_once("vanished", "%d indexed records are gone from %s (deleted, or evicted by another process "
                            "on the directory); unindexed", len(dropped), self.options.path)
        return len(dropped)

    def _reconcile_loop(self) -> None:
        """:meth:`_reconcile` every ``reconcile_seconds``, stretched to 20x its last duration (its own thread)."""
        concurrent.futures.wait([self._ready])
        interval = self.options.reconcile_seconds
        while not self._stopping.wait(interval):
            started = time.perf_counter()
            self._reconcile()
            interval = max(self.options.reconcile_seconds, 20 * (time.perf_counter() - started))


def _writable(buf: Buffer) -> memoryview:
    view = memoryview(buf).cast("B")
    if view.readonly:
        raise InvalidRequestError("get_into needs a writable buffer")
    return view


def _placed(place: Callable[[RecordHeader], Buffer | None], header: RecordHeader) -> memoryview | None:
    dest = place(header)
    return None if dest is None else _writable(dest)


_OPTION_KEYS = ("direct_io", "io_threads", "read_pool_bytes", "reconcile_seconds")
_EXTRA_KEYS = ("namespaces", *_OPTION_KEYS)


def records_per_namespace(path: Path) -> dict[str, int]:
    """Record files under a disk tier's directory per namespace (binding) digest, in hex (for operators)."""
    counts: dict[str, int] = {}
    for entry in Path(path).glob(f"*{RECORD_SUFFIX}"):
        ns = entry.name[: 2 * DIGEST_BYTES]
        counts[ns] = counts.get(ns, 0) + 1
    return counts


def delete_namespace_records(path: Path, namespace_hex: str) -> int:
    """Delete every record of one namespace (binding) digest from a disk tier's directory; returns how many.

    For an operator's purge: an engine running on the directory meanwhile serves those records as misses.
    """
    if len(namespace_hex) != 2 * DIGEST_BYTES or any(c not in "0123456789abcdef" for c in namespace_hex):
        raise ValueError(f"not a namespace digest: {namespace_hex!r}")
    deleted = 0
    for entry in Path(path).glob(f"{namespace_hex}*{RECORD_SUFFIX}"):
        entry.unlink(missing_ok=True)
        deleted += 1
    return deleted


def from_section(disk: DiskConfig, *, namespaces: Collection[NamespaceDigest] = (),
                 extra: Mapping[str, Any] | None = None) -> LocalDiskTransport:
    """The disk tier of an engine's typed ``disk`` section (what :func:`kvengine.tiers.build_tiers` calls).

    ``namespaces``: serve only these (default: all); ``extra``: ``direct_io``,
    ``io_threads``, ``read_pool_bytes``, ``reconcile_seconds`` (see :class:`LocalDiskOptions`).
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_OPTION_KEYS))
    if unknown:
        raise ConfigError(f"unknown local_disk options {unknown}; allowed: {list(_OPTION_KEYS)}")
    return LocalDiskTransport(LocalDiskOptions.from_config(disk, namespaces=frozenset(namespaces) or None, **extra))


def create_transport(config: Mapping[str, Any]) -> LocalDiskTransport:
    """Entry-point factory (group ``kvengine.transports``, name ``local_disk``), for plain options.

    Keys: those of :class:`DiskConfig` (``path`` required, sizes like "64GiB"
    accepted; ``codec`` is the engine's business and ignored here), plus
    ``namespaces`` (hex digests), ``direct_io``, ``io_threads``,
    ``read_pool_bytes`` and ``reconcile_seconds`` (see :class:`LocalDiskOptions`).
    """
    disk_keys = {k: v for k, v in config.items() if k not in _EXTRA_KEYS}
    try:
        disk = DiskConfig.model_validate(disk_keys)
    except ValidationError as exc:
        raise ConfigError(f"invalid local_disk transport config: {exc}") from None
    extra = {k: config[k] for k in _OPTION_KEYS if k in config}
    try:
        namespaces = [NamespaceDigest(bytes.fromhex(h)) for h in config.get("namespaces") or ()]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"local_disk namespaces must be hex digests: {exc}") from None
    return from_section(disk, namespaces=namespaces, extra=extra)
