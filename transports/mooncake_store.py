"""A Mooncake Store tier: chunk records in a cluster-wide memory pool that Mooncake runs.

Mooncake's master places each object in the segments that nodes contribute,
replicates and evicts it; this tier only names records (``kvengine/<key hex>``)
and moves them with Mooncake's batched zero-copy calls: records are written
from the engine's buffers as they lie (header and memory slot gathered by
``batch_put_from_multi_buffers``) and read with ``batch_get_into`` into
recycled receive buffers. The engine verifies every record it reads, as from
any tier; with a shared secret the records also carry a keyed MAC, checked
here, so a node that can reach the cluster but does not hold the secret
cannot plant KV.

Deadlines. A call to the store runs on one of this tier's threads and is
awaited at most ``timeout`` seconds. Mooncake's client cannot be interrupted
and blocks for seconds once its master is gone, so a call past its deadline
is left to finish on its thread, and until it has, every new call is answered
at once as a miss (counted as ``stalled``): at most one stuck call, never a
queue of them. A restarted master has lost every object; that is an empty
cache, not an error. Until the client has reached the master (it keeps
trying in the background) calls are misses too. Every such miss is counted
(:meth:`MooncakeStoreTransport.stats`): reads and deletes in
``kvengine_tier_errors_total{tier="mooncake",op}``, puts in
``kvengine_tier_put_failures_total{tier="mooncake",reason}``.

One Mooncake client per process: its data connections bind the address in
``MC_TCP_BIND_ADDRESS``, set here to ``local_hostname`` (Mooncake would
otherwise advertise the machine's external interface).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
from pydantic import ValidationError

from kvengine.addresses import is_loopback
from kvengine.buffers import BufferPool
from kvengine.chunks.keys import ChunkKey
from kvengine.chunks.record import decode_header, seal_record, verify_seal
from kvengine.config import MooncakeConfig
from kvengine.errors import ConfigError, IntegrityError, InvalidRequestError
from kvengine.threads import executor, start_thread
from kvengine.transport import Buffer, Capability, read_deadline
from kvengine.trust.secrets import read_secret_file

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Mooncake's result codes that this tier tells apart (others are faults).
OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
#: This tier's code for a call that did not run or did not end in time.
FAULT = -1
#: How often the background connect retries a master it could not reach.
_RECONNECT_SECONDS = 1.0
#: Why a put failed: Mooncake refused it (no space: until its eviction makes room), or it was not tried
#: (no master yet, a stuck call), or it did not end in time, or the call raised.
_PUT_FAILURES = ("refused", "not_connected", "stalled", "timeout", "error")
#: Why a read (exists, get) or delete was answered with a default instead of asking the store, or instead
#: of its answer: no master yet, a stuck call, past its deadline, or the call raised.
_CALL_FAULTS = ("not_connected", "stalled", "timeout", "error")
#: Tier calls whose faults are exported (``kvengine_tier_errors_total{tier="mooncake",op}``).
_READ_OPS = ("exists", "get", "delete")
#: Threads for calls to the store: one may be stuck past its deadline while another serves.
_THREADS = 2


class StoreClient(Protocol):
    """The part of ``mooncake.store.MooncakeDistributedStore`` this tier uses (a seam for unit tests)."""

    def setup(self, local_hostname: str, metadata_server: str, global_segment_size: int, local_buffer_size: int,
              protocol: str, rdma_devices: str, master_server_addr: str) -> int: ...
    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]], config: Any = ...) -> list[int]: ...
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
    def get_size(self, key: str) -> int: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def batch_remove(self, keys: list[str], force: bool = ...) -> list[int]: ...
    def close(self) -> int: ...


@dataclass(frozen=True, slots=True)
class MooncakeOptions:
    master: str
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 1 << 30
    replicas: int = 1
    timeout: float = 1.0
    secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, section: MooncakeConfig) -> MooncakeOptions:
        """The options of an engine's ``mooncake`` section; a master off loopback needs the secret."""
        if section.master is None:
            raise ConfigError("mooncake.master is not set")
        secret = read_secret_file(section.secret_file, "mooncake.secret_file")
        host = section.master.rpartition(":")[0].strip("[]")
        if secret is None and not is_loopback(host):
            raise ConfigError(
                f"mooncake.master {section.master} is not on loopback: any node that reaches the cluster could "
                "plant KV. Set mooncake.secret_file (records carry a keyed MAC) or keep the cluster on 127.0.0.0/8")
        return cls(master=section.master, local_hostname=section.local_hostname,
                   segment_bytes=int(section.segment_bytes), replicas=section.replicas, timeout=section.timeout,
                   secret=secret)


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeStats:
    """The tier's :class:`~kvengine.transport.TierStats`: what it counted (it holds nothing here).

    ``call_failures``: reads and deletes answered as misses, by op: not connected, stalled behind a stuck
    call, past the deadline, raised, and (``exists``, ``get``) each record Mooncake failed to look up or
    transfer (a negative result code other than "not found").
    """

    integrity_reasons: Mapping[str, int]
    put_failures: Mapping[str, int]
    call_failures: Mapping[str, int]
    chunks: int = 0
    used_bytes: int = 0
    evictions: int = 0


def _object_name(key: ChunkKey) -> str:
    return "kvengine/" + key.hex()


def _address(buf: Buffer) -> tuple[int, int]:
    """Where ``buf``'s bytes lie and how many there are (the buffer must stay referenced while in use)."""
    array = np.frombuffer(buf, dtype=np.uint8)
    return array.ctypes.data, array.nbytes


class MooncakeStoreTransport:
    """:class:`~kvengine.transport.ChunkTransport` over a Mooncake Store cluster (see the module doc)."""

    name = "mooncake"
    #: :meth:`put_parts` writes a record given as parts (header, memory slot) without joining them.
    capabilities = frozenset({Capability.GATHERED_WRITES})

    def __init__(self, options: MooncakeOptions, client_factory: Callable[[], StoreClient] | None = None) -> None:
        self.options = options
        bound = os.environ.get("MC_TCP_BIND_ADDRESS")
        if bound is not None and bound != options.local_hostname:
            raise ConfigError(f"mooncake.local_hostname is {options.local_hostname} but MC_TCP_BIND_ADDRESS is "
                              f"{bound}: Mooncake would advertise one address and bind the other")
        os.environ["MC_TCP_BIND_ADDRESS"] = options.local_hostname
        # One failed setup costs ~4 s with one retry, ~90 s with Mooncake's default 20.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        self._factory = client_factory or _mooncake_client
        self._client: StoreClient | None = None
        self._pool = executor(_THREADS, "kvengine-mooncake")
        self._buffers = BufferPool(256 << 20)
        self._lock = threading.Lock()
        self._stuck = 0  # calls past their deadline, still running on a thread
        self._size_hint = 0  # the largest record seen: receive buffers start at this size
        self.counts: Counter[str] = Counter()
        self._closed = threading.Event()
        self._connected = threading.Event()
        start_thread(self._connect, "kvengine-mooncake-connect")

    # -- ChunkTransport -------------------------------------------------------
    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return await self.put_parts([(key, (record,)) for key, record in items])

    async def put_parts(self, items: Sequence[tuple[ChunkKey, Sequence[Buffer]]]) -> list[bool]:
        """Store each record (given as parts, written as one object); True where Mooncake took it."""
        if not items:
            return []
        for key, parts in items:
            _check_record(key, parts)
        if self.options.secret is not None:  # every record that leaves this node says who wrote it
            secret = self.options.secret
            items = await asyncio.to_thread(
                lambda: [(k, (seal_record(b"".join(parts), secret),)) for k, parts in items])
        codes = await self._call("put", self._put_many, list(items), budget=self.options.timeout,
                                 default=[FAULT] * len(items))
        ok = [code == 0 for code in codes]
        with self._lock:
            self.counts["puts_ok"] += sum(ok)
            self.counts["put_refused"] += sum(code not in (0, FAULT) for code in codes)  # Mooncake said no
            self.counts["bytes_written"] += sum(sum(memoryview(p).nbytes for p in parts)
                                                for (_, parts), good in zip(items, ok) if good)
        return ok

    async def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        if not keys:
            return []
        budget = read_deadline(self.options.timeout) - time.monotonic()
        misses: list[Buffer | None] = [None] * len(keys)
        got = await self._call("get", self._get_many, list(keys), budget=budget, default=misses)
        hits = sum(r is not None for r in got)
        with self._lock:
            self.counts["hits"] += hits
            self.counts["misses"] += len(keys) - hits
            self.counts["bytes_read"] += sum(len(r) for r in got if r is not None)
        return got

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        budget = read_deadline(self.options.timeout) - time.monotonic()
        names = [_object_name(k) for k in keys]
        codes = await self._call("exists", lambda: self._store().batch_is_exist(names), budget=budget,
                                 default=[0] * len(keys))
        failed = Counter(f"exists_code_{-code}" for code in codes if code < 0)  # -900: the RPC failed
        if failed:
            with self._lock:
                self.counts.update(failed)
        return [code == 1 for code in codes]

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        names = [_object_name(k) for k in keys]
        # force: a read lease (another node reading it) must not keep a bad record alive
        codes = await self._call("delete", lambda: self._store().batch_remove(names, True),
                                 budget=self.options.timeout, default=[FAULT] * len(keys))
        return [code == 0 for code in codes]

    async def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        client = self._client
        if client is not None:  # closing with the master gone takes Mooncake ~13 s: not awaited past the deadline
            done = asyncio.get_running_loop().run_in_executor(None, client.close)
            try:
                await asyncio.wait_for(asyncio.shield(done), self.options.timeout)
            except (TimeoutError, Exception) as exc:
                log.debug("mooncake close did not finish cleanly: %r", exc)

    # -- extras ---------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """Whether the client has reached the master (calls before that are misses)."""
        return self._connected.is_set()

    @property
    def stalled(self) -> bool:
        """Whether a call past its deadline still runs (new calls are misses until it returns)."""
        with self._lock:
            return self._stuck > 0

    def wait_connected(self, timeout: float) -> bool:
        """Block until the client has reached the master, at most ``timeout`` seconds; whether it has."""
        return self._connected.wait(timeout)

    def stats(self) -> MooncakeStats:
        with self._lock:
            counts = dict(self.counts)
        prefix = "wrong_record_"
        failed = {op: sum(counts.get(f"{op}_{fault}", 0) for fault in _CALL_FAULTS) for op in _READ_OPS}
        for op in ("exists", "get"):  # per record that Mooncake failed to look up or transfer
            failed[op] += sum(n for k, n in counts.items() if k.startswith(f"{op}_code_"))
        return MooncakeStats(
            integrity_reasons={k[len(prefix):]: v for k, v in counts.items() if k.startswith(prefix)},
            put_failures={reason: counts.get(f"put_{reason}", 0) for reason in _PUT_FAILURES},
            call_failures=failed)

    # -- plumbing ---------------------------------------------------------------
    def _connect(self) -> None:
        """Reach the master (retried until it answers or the tier closes); runs on its own thread."""
        o = self.options
        attempts = 0
        while not self._closed.is_set():
            attempts += 1
            try:
                client = self._factory()
                code = client.setup(o.local_hostname, "P2PHANDSHAKE", o.segment_bytes, 16 << 20, "tcp", "", o.master)
            except Exception as exc:  # a broken install or binding: say so once, keep missing
                log.error("kvengine: mooncake client for %s could not be created: %r", o.master, exc)
                return
            if code == 0:
                with self._lock:
                    if self._closed.is_set():
                        break
                    self._client = client
                self._connected.set()
                log.info("kvengine: mooncake tier connected to %s as %s (attempt %d)", o.master, o.local_hostname,
                         attempts)
                return
            if attempts == 1:
                log.warning("kvengine: mooncake master %s not reachable (setup returned %d); retrying in the "
                            "background, reads and writes miss meanwhile", o.master, code)
            self._closed.wait(_RECONNECT_SECONDS)

    def _store(self) -> StoreClient:
        client = self._client
        assert client is not None  # _call runs nothing before the client is connected
        return client

    async def _call(self, op: str, fn: Callable[..., _T], *args: Any, budget: float, default: _T) -> _T:
        """``fn(*args)`` on a store thread within ``budget`` seconds; ``default`` on any fault (counted)."""
        if self._closed.is_set():
            raise InvalidRequestError("the mooncake tier is closed")
        with self._lock:
            skip = "not_connected" if self._client is None else "stalled" if self._stuck else None
            if skip is not None:
                self.counts[f"{op}_{skip}"] += 1
                return default
        future = self._pool.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), max(budget, 0.0))
        except TimeoutError:
            with self._lock:
                self._stuck += 1
                self.counts[f"{op}_timeout"] += 1
            future.add_done_callback(self._unstick)
            return default
        except Exception as exc:
            with self._lock:
                self.counts[f"{op}_error"] += 1
            log.debug("kvengine: mooncake %s failed: %r", op, exc)
            return default

    def _unstick(self, _: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._stuck -= 1

    # -- on store threads ---------------------------------------------------------
    def _put_many(self, items: list[tuple[ChunkKey, Sequence[Buffer]]]) -> list[int]:
        addresses = [[_address(part) for part in parts] for _, parts in items]
        codes = self._store().batch_put_from_multi_buffers(
            [_object_name(k) for k, _ in items], [[a for a, _ in parts] for parts in addresses],
            [[n for _, n in parts] for parts in addresses], _replicas(self.options.replicas))
        sizes = [sum(n for _, n in parts) for parts in addresses]
        with self._lock:
            self._size_hint = max(self._size_hint, *sizes)
        return list(codes)

    def _get_many(self, keys: list[ChunkKey]) -> list[Buffer | None]:
        store = self._store()
        names = [_object_name(k) for k in keys]
        size = self._size_hint or 1 << 20
        buffers = [self._buffers.take_array(size) for _ in keys]
        codes = list(store.batch_get_into(names, [b.ctypes.data for b in buffers], [size] * len(keys)))
        for i, code in enumerate(codes):
            if code == BUFFER_TOO_SMALL:  # a record larger than any seen so far: ask its size, read again
                need = store.get_size(names[i])
                if need > 0:
                    buffers[i] = self._buffers.take_array(need)
                    codes[i] = store.get_into(names[i], buffers[i].ctypes.data, need)
                    with self._lock:
                        self._size_hint = max(self._size_hint, need)
        out: list[Buffer | None] = []
        for key, name, buf, code in zip(keys, names, buffers, codes, strict=True):
            if code <= 0:
                if code != OBJECT_NOT_FOUND:
                    with self._lock:
                        self.counts[f"get_code_{-code}"] += 1
                out.append(None)
                continue
            record = buf[:code].data  # a view: the pooled buffer returns once the engine drops it
            reason = self._rejects(key, record)
            if reason is not None:  # never served; removed so that a good copy can take its place
                with self._lock:
                    self.counts[f"wrong_record_{reason}"] += 1
                store.batch_remove([name], True)
                out.append(None)
                continue
            out.append(record)
        return out

    def _rejects(self, key: ChunkKey, record: Buffer) -> str | None:
        """Why a record read must not be used: without the secret's MAC, it is not ours (None: use it).
        Without a secret the engine's own verification (header, checksum) is all there is."""
        secret = self.options.secret
        if secret is None:
            return None
        try:
            verify_seal(memoryview(record), secret, expect_key=key)
        except IntegrityError as exc:
            return exc.reason
        return None


def _check_record(key: ChunkKey, parts: Sequence[Buffer]) -> None:
    """Caller-mistake checks on the header only (the payload is the reader's to verify)."""
    first = memoryview(parts[0]) if parts else memoryview(b"")
    try:
        header = decode_header(first, expect_namespace=key.namespace)
    except IntegrityError as exc:
        raise InvalidRequestError(f"put of a malformed record (its first part must hold the header): {exc}") \
            from None
    if header.key != key or header.record_length != sum(memoryview(p).nbytes for p in parts):
        raise InvalidRequestError("put of a record whose header does not match its key or length")


def _replicas(count: int) -> Any:
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = count
    return config


def _mooncake_client() -> StoreClient:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ConfigError("the mooncake tier needs the mooncake-transfer-engine-non-cuda package (CPU machines) "
                          f"or mooncake-transfer-engine (CUDA): {exc}") from None
    client: StoreClient = MooncakeDistributedStore()
    return client


def from_section(section: MooncakeConfig) -> MooncakeStoreTransport:
    """The Mooncake tier of an engine's typed ``mooncake`` section (what :func:`kvengine.tiers.build_tiers`
    calls)."""
    try:  # checked here too: the client is made on the connect thread, where a failure is only logged
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        raise ConfigError("mooncake.master is set but the mooncake package is not installed "
                          f"(pip install mooncake-transfer-engine-non-cuda): {exc}") from None
    return MooncakeStoreTransport(MooncakeOptions.from_config(section))


def create_transport(config: Mapping[str, Any]) -> MooncakeStoreTransport:
    """Entry-point factory (group ``kvengine.transports``, name ``mooncake``): the keys of
    :class:`~kvengine.config.MooncakeConfig` (``master`` required)."""
    try:
        section = MooncakeConfig.model_validate(dict(config))
    except ValidationError as exc:
        raise ConfigError(f"invalid mooncake transport config: {exc}") from None
    return from_section(section)
