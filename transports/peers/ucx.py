"""Peer sharing over UCX (``ucxx``), same protocol and fault behaviour as ZeroMQ.

Connection: a client opens a TCP *control* connection to the server's
``host:port``; both sides send a hello (magic, version, the UCX tag they will
receive on, their UCX worker address) and create endpoints from each other's
worker address. Worker addresses, not UCX's sockaddr listener, because the
listener cannot connect with ``UCX_TLS=sm`` (and shared-memory endpoints do
not support UCX's peer-failure handling, so it is only turned on when
``UCX_TLS`` names no shared-memory transport). The control connection stays
open for the life of the UCX connection: when it closes (a process died or
hung up), both sides drop that connection at once -- the liveness signal
that UCX alone does not give over shared memory.

Messages use the tag API, each receiving side on its own per-connection tag,
with exactly sized buffers (no copies, any ``UCX_TLS``)::

    preamble  8 KiB: header length (u32), the header (protocol), and,
              when they all fit, the records (one UCX message in all)
    rest      the header's remainder, if it did not fit the preamble
    records   otherwise one message per record (PUT requests, GET replies), whole

A connection carries one request at a time; a client keeps up to
``connections_per_peer`` connections per peer for concurrency. A request
that times out or fails discards its connection (its tags die with it, so a
late reply can never be taken for another request's).

One event loop per process for UCX: ``ucxx`` binds its process-wide
context to the first event loop that uses it (its notifier thread completes
request futures on that loop only), so every UCX operation here runs on one
loop in a daemon thread (:class:`_UcxLoop`), and callers on other loops (an
engine's, an embedded server's) hop to it and back. The hop costs a few
tens of microseconds; it also keeps UCX progress off the engine's loop.

UCX offers no authentication here: use it on trusted fabrics only (CURVE is
a ZeroMQ feature). ``ucxx`` is imported on first use; without it, building a
connector or server raises :class:`ConfigError` naming the package.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import struct
import threading
from collections import Counter
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from kvengine.chunks.keys import ChunkKey
from kvengine.config import PeersConfig
from kvengine.errors import ConfigError, TransportError
from kvengine.threads import start_thread
from kvengine.transport import Buffer

from .client import Answer, Connector, PeerTransport, client_from_config, client_from_section
from .connection_pool import ConnectionPool
from .placement import Peer, format_address, split_host_port
from .protocol import RECEIVE_BUFFERS, Limits, Op, ProtocolError, Status, decode_header, encode_request
from .service import PeerService, ServerOptions
from .store import RecordStore

_PREAMBLE = 8192
_LEN = struct.Struct("<I")
_HELLO = struct.Struct("<4sHQI")  # magic, version, tag this side receives on, worker address length
_HELLO_MAGIC = b"KVPU"
_HELLO_VERSION = 1
_MAX_ADDRESS = 1 << 16
_SHM_TLS = ("sm", "shm", "posix", "sysv", "cma", "knem", "xpmem")
#: Receive tags are matched by the process's one UCX worker, so they are unique per process.
_TAGS = itertools.count(1)


def _ucxx() -> ModuleType:
    os.environ.setdefault("UCX_LOG_FILE", "stderr")  # UCX logs to stdout by default (an engine's output)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_MEMTYPE_CACHE, unknown to UCX 1.21
    try:
        import ucxx
    except ImportError as exc:
        raise ConfigError(f"the UCX peer transport needs the 'ucxx-cu12' package (the 'ucx' extra): {exc}") from exc
    return ucxx


_T = TypeVar("_T")


class _UcxLoop:
    """The one event loop (in a daemon thread) that all of this process's UCX work runs on."""

    _instance: _UcxLoop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        start_thread(self.loop.run_forever, "kvengine-ucx")
        asyncio.run_coroutine_threadsafe(self._init(), self.loop).result()

    @staticmethod
    async def _init() -> None:
        """Initialise ucxx on this loop, with request futures completed by its notifier thread.

        ucxx's default waits for each request by yielding to the loop until
        it completes: a receive posted for the next request (a server always
        has one) spins the loop at ~70% of a core while idle. Python futures
        sleep instead. Left alone if ucxx was initialised already or
        ``UCXPY_ENABLE_PYTHON_FUTURE`` is set.
        """
        import ucxx.core

        if ucxx.core._ctx is None and "UCXPY_ENABLE_PYTHON_FUTURE" not in os.environ:
            ucxx.core.init(enable_python_future=True)

    @classmethod
    def get(cls) -> _UcxLoop:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _UcxLoop()
            return cls._instance

    async def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Await ``coro`` on the UCX loop from any loop (cancelling this cancels it there)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))


def _error_handling() -> bool:
    """UCX peer-failure handling, unless ``UCX_TLS`` asks for shared memory (which cannot do it)."""
    tls = [t.strip().lstrip("^") for t in os.environ.get("UCX_TLS", "").split(",") if t.strip()]
    return not any(t.startswith(_SHM_TLS) for t in tls)


@dataclass(frozen=True, slots=True, kw_only=True)
class UcxOptions:
    connections_per_peer: int = 4
    #: Control connection plus UCX endpoint set-up.
    connect_timeout: float = 2.0


def _inline(header_bytes: int, payload_bytes: int) -> bool:
    """Whether a message's records ride in its preamble, after the header (small messages: one UCX send)."""
    return _LEN.size + header_bytes + payload_bytes <= _PREAMBLE


async def _send_message(ep: Any, tag: int, header: bytes, records: Sequence[Buffer]) -> None:
    pre = bytearray(_PREAMBLE)
    _LEN.pack_into(pre, 0, len(header))
    if _inline(len(header), sum(len(r) for r in records)):
        parts, later = [header, *records], []
    else:
        parts, later = [header[: _PREAMBLE - _LEN.size]], [header[_PREAMBLE - _LEN.size :], *records]
    offset = _LEN.size
    for part in parts:
        pre[offset : offset + len(part)] = part
        offset += len(part)
    await ep.send(pre, tag=tag, force_tag=True)
    for part in later:
        if len(part):
            await ep.send(part, tag=tag, force_tag=True)


async def _recv_header(ep: Any, tag: int, limits: Limits) -> tuple[bytes, np.ndarray]:
    """A message's header, and its preamble (which may hold its records).

    Receives are posted on the endpoint (not the worker) so that closing the
    endpoint cancels any still pending and frees their buffers.
    """
    pre = np.empty(_PREAMBLE, dtype=np.uint8)
    await ep.recv(pre, tag=tag, force_tag=True)
    (n,) = _LEN.unpack_from(pre.data)
    if n > limits.max_header_bytes:
        raise ProtocolError(Status.TOO_LARGE, f"header of {n} bytes")
    fits = min(n, _PREAMBLE - _LEN.size)
    header = pre[_LEN.size : _LEN.size + fits].tobytes()
    if n > fits:
        rest = np.empty(n - fits, dtype=np.uint8)
        await ep.recv(rest, tag=tag, force_tag=True)
        header += rest.tobytes()
    return header, pre


async def _recv_records(ep: Any, tag: int, header: bytes, pre: np.ndarray, lengths: Sequence[int]) -> list[Buffer]:
    """The records announced by ``lengths``: from the preamble when inline, else one message each."""
    out: list[Buffer] = []
    if _inline(len(header), sum(lengths)):
        offset = _LEN.size + len(header)
        for n in lengths:
            out.append(pre.data[offset : offset + n].toreadonly() if n else b"")
            offset += n
        return out
    for n in lengths:
        if n == 0:
            out.append(b"")
            continue
        buf = RECEIVE_BUFFERS.take_array(n)
        await ep.recv(buf, tag=tag, force_tag=True)
        out.append(buf.data.toreadonly())
    return out


async def _hello(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tag: int, address: bytes
) -> tuple[int, bytes]:
    """Exchange hellos on a control connection; the other side's receive tag and worker address."""
    writer.write(_HELLO.pack(_HELLO_MAGIC, _HELLO_VERSION, tag, len(address)) + address)
    await writer.drain()
    magic, version, their_tag, n = _HELLO.unpack(await reader.readexactly(_HELLO.size))
    if magic != _HELLO_MAGIC or version != _HELLO_VERSION or n > _MAX_ADDRESS:
        raise ProtocolError(Status.UNSUPPORTED, f"bad UCX hello (magic {magic!r}, version {version})")
    return their_tag, await reader.readexactly(n)


class _Connection:
    """One control socket + one UCX endpoint; one request at a time."""

    def __init__(self, ucxx: ModuleType, limits: Limits, tag: int) -> None:
        self.ucxx = ucxx
        self.limits = limits
        self.tag = tag
        self.peer_tag = 0
        self.ep: Any = None
        self.writer: asyncio.StreamWriter | None = None
        self.lost = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None

    async def open(self, peer: Peer, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            reader, self.writer = await asyncio.open_connection(peer.host, peer.port)
            address = bytes(self.ucxx.get_worker_address())
            self.peer_tag, theirs = await _hello(reader, self.writer, self.tag, address)
            self.ep = await self.ucxx.create_endpoint_from_worker_address(
                self.ucxx.get_ucx_address_from_buffer(theirs), endpoint_error_handling=_error_handling())
        self._watch = asyncio.create_task(self._watch_control(reader))

    async def _watch_control(self, reader: asyncio.StreamReader) -> None:
        try:
            await reader.read(1)  # the server never writes after the hello: any return means it hung up
        finally:
            self.lost.set()

    async def request(self, header: bytes, records: Sequence[Buffer]) -> Answer:
        await _send_message(self.ep, self.peer_tag, header, records)
        reply, pre = await _recv_header(self.ep, self.tag, self.limits)
        msg = decode_header(reply, self.limits, reply=True)
        return msg, await _recv_records(self.ep, self.tag, reply, pre, msg.lengths)

    @property
    def closed(self) -> bool:
        """The control connection is gone: the peer died or hung up."""
        return self.lost.is_set()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.writer is not None:
            self.writer.close()
        if self.ep is not None:
            self.ep.abort()


class UcxConnector(Connector):
    """Client wire: a small pool of connections per peer, made on demand."""

    def __init__(self, limits: Limits | None = None, options: UcxOptions | None = None) -> None:
        self.ucxx = _ucxx()
        self.limits = limits or Limits()
        self.options = options or UcxOptions()
        self.counts: Counter[str] = Counter()
        self._ucx = _UcxLoop.get()
        # the pool's state lives on the UCX loop
        self._pool = ConnectionPool(self.options.connections_per_peer, self._connect, self.counts)
        self._ids = itertools.count(1)

    async def request(
        self, peer: Peer, op: Op, keys: Sequence[ChunkKey], records: Sequence[Buffer], timeout: float
    ) -> Answer | None:
        header = encode_request(op, next(self._ids), keys, [len(r) for r in records])
        return await self._ucx.run(self._pool.call(
            peer, timeout, lambda conn: self._race(conn, conn.request(header, records)),
            (OSError, ProtocolError, asyncio.IncompleteReadError, self.ucxx.exceptions.UCXError)))

    async def _connect(self, peer: Peer) -> _Connection:
        conn = _Connection(self.ucxx, self.limits, next(_TAGS))
        try:
            await conn.open(peer, self.options.connect_timeout)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _race(self, conn: _Connection, work: Any) -> Answer | None:
        """``work``'s result, or None as soon as the control connection is lost."""
        task = asyncio.ensure_future(work)
        lost = asyncio.ensure_future(conn.lost.wait())
        try:
            await asyncio.wait([task, lost], return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not task.done():
                task.cancel()
        if not task.done():
            self.counts["disconnects"] += 1
            return None
        return task.result()

    async def forget(self, peer: Peer) -> None:
        await self._ucx.run(self._pool.forget(peer))

    async def close(self) -> None:
        await self._ucx.run(self._pool.close())


class UcxPeerServer:
    """Serves a :class:`RecordStore` over UCX; the control socket listens on ``bind``."""

    def __init__(self, store: RecordStore, bind: str, options: ServerOptions | None = None) -> None:
        if options is not None and options.tenants is not None:
            raise ConfigError("tenants need a wire that proves client identity (ZeroMQ CURVE); UCX cannot")
        self.ucxx = _ucxx()
        self.service = PeerService(store, options)
        self.host, self.port = split_host_port(bind)
        self.address: str | None = None
        self._ucx = _UcxLoop.get()
        self._server: asyncio.Server | None = None  # this and below live on the UCX loop
        self._slots = asyncio.Semaphore(self.service.options.max_concurrent)
        self._conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @property
    def counts(self) -> Counter[str]:
        return self.service.counts

    async def start(self) -> None:
        await self._ucx.run(self._start())

    async def _start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._control, self.host, self.port)
        except OSError as exc:
            raise TransportError(f"cannot bind {format_address(self.host, self.port)}: {exc}") from exc
        port = self._server.sockets[0].getsockname()[1]
        self.address = format_address(self.host, port)

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = writer
        ep = None
        tag = next(_TAGS)
        try:
            address = bytes(self.ucxx.get_worker_address())
            client_tag, theirs = await asyncio.wait_for(_hello(reader, writer, tag, address), 5.0)
            ep = await self.ucxx.create_endpoint_from_worker_address(
                self.ucxx.get_ucx_address_from_buffer(theirs), endpoint_error_handling=_error_handling())
            serving = asyncio.create_task(self._serve(ep, tag, client_tag))
            hangup = asyncio.create_task(reader.read(1))
            await asyncio.wait([serving, hangup], return_when=asyncio.FIRST_COMPLETED)
            for t in (serving, hangup):
                t.cancel()
            await asyncio.gather(serving, hangup, return_exceptions=True)
        except (OSError, TimeoutError, ProtocolError, asyncio.IncompleteReadError) as exc:
            self.counts[f"connection_error_{type(exc).__name__}"] += 1
        finally:
            self._conns.pop(task, None)
            writer.close()
            if ep is not None:
                ep.abort()

    async def _serve(self, ep: Any, tag: int, client_tag: int) -> None:
        limits = self.service.options.limits
        while True:
            header, pre = await _recv_header(ep, tag, limits)
            try:
                lengths = decode_header(header, limits, reply=False).lengths
            except ProtocolError as exc:  # the stream cannot be re-synchronised: answer if possible, then hang up
                reply = await self.service.handle(header, ())
                if reply is not None:
                    await _send_message(ep, client_tag, reply.header, ())
                self.counts[f"dropped_connection_{exc.status.name.lower()}"] += 1
                return
            async with self._slots:
                records = await _recv_records(ep, tag, header, pre, lengths)
                reply = await self.service.handle(header, [r for r in records if len(r)])
                assert reply is not None, "a decodable request always gets a reply"
                try:  # a client that stops receiving loses its connection, not a slot for good
                    await asyncio.wait_for(_send_message(ep, client_tag, reply.header, reply.records),
                                           self.service.options.reply_timeout)
                except TimeoutError:
                    self.counts["reply_abandoned_slow_client"] += 1
                    return

    async def close(self) -> None:
        await self._ucx.run(self._close())

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = list(self._conns)
        for writer in self._conns.values():
            writer.close()  # the connection's hang-up watch fires and it winds down
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


def from_section(peers: PeersConfig) -> PeerTransport:
    """The peer tier of an engine's typed ``peers`` section (what :func:`kvengine.tiers.build_tiers` calls)."""
    membership, options = client_from_section(peers, encrypted=False)
    return PeerTransport(UcxConnector(options.limits), membership, options, name="peers_ucx")


def create_transport(config: Mapping[str, Any]) -> PeerTransport:
    """Entry-point factory (group ``kvengine.transports``, name ``peers_ucx``).

    Keys: those of :func:`client_from_config`, and ``connections_per_peer``
    / ``connect_timeout`` (:class:`UcxOptions`). ``UCX_TLS`` and the other
    ``UCX_*`` variables come from the environment, as UCX reads them.
    """
    cfg = dict(config)
    membership, options = client_from_config(cfg, "peers_ucx")
    try:
        ucx_options = UcxOptions(**cfg)
    except TypeError as exc:
        raise ConfigError(f"invalid peers_ucx transport config: {exc}") from None
    return PeerTransport(UcxConnector(options.limits, ucx_options), membership, options, name="peers_ucx")
