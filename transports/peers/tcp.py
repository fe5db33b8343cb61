"""Peer sharing over plain TCP (optionally TLS) with kvengine's own framing.

Why a wire of our own next to ZeroMQ: libzmq assembles a whole multipart
message before the application sees its first part, so a server cannot
refuse a message of a million frames, or of more bytes than its header
announces, before libzmq has buffered it. Here each message is::

    length   u32: the header's size (refused above ``Limits.max_header_bytes``)
    header   protocol's header (op, request id, keys, record lengths)
    records  exactly the bytes the header announces, record after record

so the server knows, before it reads a payload byte, how much will come,
and reads exactly that into buffers of exactly that size
(:class:`asyncio.BufferedProtocol`: the kernel copies a large record
straight into its buffer; a small message is read whole in one go, see
:class:`_Framed`). Bytes beyond the announced payload are the next message,
whose length then fails its check: the connection is closed, having
buffered at most the read-ahead (32 KiB) of it. A connection carries one
request at a time; while a request is served its next bytes are not parsed,
and once the read-ahead is full not read (TCP pushes back on the sender).
A client keeps up to ``connections_per_peer`` connections per peer.

Server bounds (:class:`TcpServerOptions`): connections in all and per
client, a deadline for each message once its first byte arrived (a client
that trickles bytes loses its connection), an idle time, and a budget of
payload bytes being received at once, shared by the clients
(:class:`SharedByteBudget`): a client holds at most its share of it (the
budget divided among the connected clients, at most half of it), so one that
announces a huge payload and sends nothing holds its share until its
deadline, never the others' bytes. A payload beyond the client's share is refused at once
(``TOO_LARGE``, connection closed); one within it that does not fit now
waits, unread, within its deadline.

TLS (:class:`TlsConfig`): servers present a certificate; clients verify it
against the group's CA (peers are addressed by IP, so the chain is checked,
not the host name) and may present a certificate of their own. A server
given a client CA admits only clients with a certificate it signed, and
identifies each client by the SHA-256 fingerprint of its certificate: what
a tenants file grants (:mod:`.tenants`). Without TLS a client is identified
by its IP address, for the per-client limits only.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import ssl
import struct
from collections import Counter
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvengine.chunks.keys import ChunkKey
from kvengine.config import PeersConfig
from kvengine.errors import ConfigError, TransportError
from kvengine.transport import Buffer

from .byte_budget import Grant, SharedByteBudget
from .client import Answer, Connector, PeerTransport, client_from_config, client_from_section
from .connection_pool import ConnectionPool
from .placement import Peer, format_address, split_host_port
from .protocol import (
    RECEIVE_BUFFERS,
    Limits,
    Message,
    Op,
    ProtocolError,
    Status,
    decode_header,
    encode_request,
    peek_request_id,
)
from .service import PeerService, Reply, ServerOptions
from .store import RecordStore

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
#: Payloads up to this size are read into one buffer and handed out as views of it (one read, not one per record).
_SMALL_PAYLOAD = 256 << 10
#: Large records are written in pieces of this size, each once the socket has taken the previous ones
#: (asyncio copies what a socket does not take at once; a whole 32 MiB record would be copied and shifted).
_WRITE_PIECE = 1 << 20
_WRITE_HIGH, _WRITE_LOW = 2 << 20, 512 << 10
#: Bytes read at once between messages (per connection): a small message and its reply take one read each.
_READ_AHEAD = 32 << 10
#: A message whose records total at most this is written with its header in one write (one send).
_ONE_WRITE = 64 << 10
#: A connection's timer that fires this close to its deadline closes it (timers may fire a clock tick early).
_TIMER_SLACK = 1e-3


def fingerprint(der: bytes) -> bytes:
    """How a tenants file names a TLS client: ``sha256:`` and the hex digest of its DER certificate."""
    return b"sha256:" + hashlib.sha256(der).hexdigest().encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    """Certificate files (PEM). ``cert``/``key``: this side's; ``ca``: who to trust on the other side."""

    cert: Path | None = None
    key: Path | None = None
    #: Clients: the CA that signed the servers' certificates (required). Servers: the CA that signed the
    #: admitted clients' certificates (clients without one are refused); None admits any client.
    ca: Path | None = None

    def server_context(self) -> ssl.SSLContext:
        if self.cert is None:
            raise ConfigError("a TLS server needs its certificate (tls cert and key)")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._load(ctx)
        if self.ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        if self.ca is None:
            raise ConfigError("a TLS client needs the CA of its peers' certificates (tls_ca)")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # peers are addressed by IP; the chain to the group's CA is what is checked
        self._load(ctx)
        return ctx

    def _load(self, ctx: ssl.SSLContext) -> None:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            if self.cert is not None:
                ctx.load_cert_chain(self.cert, self.key)
            if self.ca is not None:
                ctx.load_verify_locations(self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"TLS certificate files {self.cert}, {self.key}, {self.ca}: {exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class TcpOptions:
    """Client side."""

    #: Requests in flight per peer (one per connection). At most the server's ``max_inflight_per_client``.
    connections_per_peer: int = 4
    connect_timeout: float = 2.0
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        if self.connections_per_peer < 1 or self.connect_timeout <= 0:
            raise ConfigError("tcp connections_per_peer must be >= 1 and connect_timeout > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class TcpServerOptions:
    max_connections: int = 512
    #: Per client (TLS certificate, else IP address); beyond it new connections are closed at once.
    max_connections_per_client: int = 16
    #: Once a message's first byte has arrived, all of it must within this time, or the connection is closed.
    message_timeout: float = 5.0
    #: A connection with no request for this long is closed (clients reconnect on demand).
    idle_timeout: float = 60.0
    #: Payload bytes being received at once, over all connections, shared by the clients: each holds at most
    #: ``receive_budget_bytes // clients connected``, at least ``min_client_share_bytes``, at most half of it.
    #: A request beyond its client's share is refused ``TOO_LARGE``; one within it waits unread for room.
    receive_budget_bytes: int = 1 << 30
    #: The share a client keeps however many clients connect (capped at half the budget): a kvengine
    #: client's largest batch (``PeerClientOptions.max_request_bytes``, 64 MiB) always fits.
    min_client_share_bytes: int = 64 << 20
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_connections_per_client, self.receive_budget_bytes,
               self.min_client_share_bytes) < 1 or min(self.message_timeout, self.idle_timeout) <= 0:
            raise ConfigError("tcp server limits and timeouts must be positive")
        if self.receive_budget_bytes < 2 * self.min_client_share_bytes:  # a share is at most half the budget
            raise ConfigError(
                f"tcp server: receive_budget_bytes ({self.receive_budget_bytes}) must be at least twice "
                f"min_client_share_bytes ({self.min_client_share_bytes}): a client holds at most half the budget, "
                "so a smaller one would refuse a client's largest batch")


class _Framed(asyncio.BufferedProtocol):
    """Reads messages (length, header, records) into exactly sized buffers; writes them in pieces.

    Between messages the socket is read into a read-ahead buffer (:data:`_READ_AHEAD` bytes), so a
    small message (length, header and payload in one segment) takes one read and one loop turn; its
    bytes are copied from there into the buffers the header sizes, and a large record's rest is read
    straight into its own buffer.

    A stalled stream (:meth:`stall`: a request being served, or waiting for receive budget) is not
    parsed: what arrives meanwhile is kept in the read-ahead buffer, and reading pauses only once that
    is full (no pause and resume, two system calls, per request of a client that waits for its reply);
    :meth:`unstall` parses what was kept, then reads on.

    Subclasses get :meth:`on_header` (may stall the stream: call :meth:`stall` and return False, then
    call :meth:`proceed` and :meth:`unstall`), :meth:`on_message` and :meth:`on_lost`. A message that
    breaks the framing closes the connection.
    """

    def __init__(self, limits: Limits, *, reply: bool) -> None:
        self.limits = limits
        self.reply = reply
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._writable = asyncio.Event()
        self._writable.set()
        self._ahead = bytearray(_READ_AHEAD)
        self._kept = (0, 0)  # bytes of the read-ahead buffer read while stalled, not parsed yet
        self._stalled = False  # not parsing: a request being served, or waiting for receive budget
        self._paused = False  # reading paused (stalled with a full read-ahead buffer)
        self._reset()

    def _reset(self) -> None:
        self._target: memoryview = memoryview(bytearray(_LEN.size))
        self._filled = 0
        self._stage = "length"
        self._header = b""
        self._msg: Message | None = None
        self._records: list[Buffer] = []
        self._pending: list[int] = []  # lengths of records still to read (large payloads)

    # -- asyncio callbacks ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(_WRITE_HIGH, _WRITE_LOW)

    @property
    def _between_messages(self) -> bool:
        return self._filled == 0 and self._stage == "length"

    # The transport calls get_buffer, reads into it, then buffer_updated, with no callback between: both see
    # the same state, so which buffer was handed out need not be remembered.
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._stalled:  # kept for unstall: never full here (reading pauses when it fills)
            return memoryview(self._ahead)[self._kept[1]:]
        return memoryview(self._ahead) if self._between_messages else self._target[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._stalled:
            self._keep(self._kept[0], self._kept[1] + nbytes)
            return
        if self._between_messages:
            self._feed(0, nbytes)
            return
        self._filled += nbytes
        if self._filled < len(self._target) or self.closed:
            return
        self._step()

    @property
    def mid_message(self) -> bool:
        """Part of a message has been read, not all of it."""
        return not self._between_messages or self._kept[1] > self._kept[0]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._writable.set()
        self.on_lost()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- reading ---------------------------------------------------------------------------------------------
    def stall(self) -> None:
        """Parse nothing more until :meth:`unstall` (what arrives meanwhile is kept, see the class docs)."""
        self._stalled = True

    def unstall(self) -> None:
        """Parse on: first what was kept, then what the socket brings."""
        self._stalled = False
        start, end = self._kept
        self._kept = (0, 0)
        if start < end:
            self._feed(start, end)
        if self._paused and not self._stalled and not self.closed and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _feed(self, start: int, end: int) -> None:
        """Hand the read-ahead buffer's bytes ``start:end`` to the messages they belong to, stage by stage,
        until they are used up or the stream stalls (the rest is kept for :meth:`unstall`)."""
        data = memoryview(self._ahead)
        while start < end and not self.closed and not self._stalled:
            if self._between_messages:
                self.on_message_start()
            take = min(end - start, len(self._target) - self._filled)
            self._target[self._filled:self._filled + take] = data[start:start + take]
            self._filled += take
            start += take
            if self._filled == len(self._target):
                self._step()
        if start < end and not self.closed:
            self._keep(start, end)

    def _keep(self, start: int, end: int) -> None:
        """Keep bytes ``start:end`` of the read-ahead buffer (stalled); a full buffer pauses reading."""
        self._kept = (start, end)
        if end == len(self._ahead) and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _step(self) -> None:
        """The current stage's buffer is full: on to the next stage (a bad message closes the connection)."""
        try:
            self._advance()
        except ProtocolError as exc:
            self.on_bad(self._header, exc)
            self.abort()

    def _advance(self) -> None:
        if self._stage == "length":
            (n,) = _LEN.unpack(self._target)
            if n > self.limits.max_header_bytes:
                raise ProtocolError(Status.TOO_LARGE, f"header of {n} bytes")
            self._expect("header", n)
        elif self._stage == "header":
            self._header = bytes(self._target)
            self._msg = decode_header(self._header, self.limits, reply=self.reply)
            if self.on_header(self._msg):
                self.proceed()
        else:
            self._take_record()

    def proceed(self) -> None:
        """Read the payload of the header just decoded (after :meth:`on_header` returned False)."""
        assert self._msg is not None
        total = self._msg.payload_bytes
        if total == 0:
            self._deliver()
        elif total <= _SMALL_PAYLOAD:
            self._pending = []
            self._expect("small", total)
        else:
            self._pending = [n for n in self._msg.lengths if n]
            self._expect_record()

    def _take_record(self) -> None:
        assert self._msg is not None
        if self._stage == "small":
            whole, offset = self._target.toreadonly(), 0
            for n in self._msg.lengths:
                self._records.append(whole[offset:offset + n] if n else b"")
                offset += n
        else:
            self._records.append(self._target.toreadonly())
        if self._pending:
            self._expect_record()
        else:
            self._deliver()

    def _expect_record(self) -> None:
        assert self._msg is not None
        while len(self._records) < len(self._msg.lengths) and self._msg.lengths[len(self._records)] == 0:
            self._records.append(b"")
        n = self._pending.pop(0)
        self._stage, self._target, self._filled = "record", RECEIVE_BUFFERS.take(n), 0

    def _expect(self, stage: str, n: int) -> None:
        self._stage, self._target, self._filled = stage, memoryview(bytearray(n)), 0
        if n == 0:
            self._advance()

    def _deliver(self) -> None:
        assert self._msg is not None
        msg, records = self._msg, self._records
        records += [b""] * (len(msg.lengths) - len(records))
        self._reset()
        self.on_message(msg, records)

    # -- writing ---------------------------------------------------------------------------------------------
    def write_at_once(self, header: bytes, records: Sequence[Buffer]) -> bool:
        """Hand a small message (records of at most :data:`_ONE_WRITE` bytes) to the socket in one write
        (copying it costs less than a send more); whether the socket took it without back-pressure."""
        assert self.transport is not None
        self.transport.write(b"".join((_LEN.pack(len(header)), header, *records)))
        return not self.closed and self._writable.is_set()

    async def write(self, header: bytes, records: Sequence[Buffer]) -> None:
        """Send one message; returns once the socket has taken all but a bounded tail of it."""
        assert self.transport is not None
        if sum(len(r) for r in records) <= _ONE_WRITE:
            self.write_at_once(header, records)
            records = ()
        else:
            self.transport.write(_LEN.pack(len(header)) + header)
        for record in records:
            view = memoryview(record).cast("B")
            for i in range(0, len(view), _WRITE_PIECE):
                await self.drained()
                self.transport.write(view[i:i + _WRITE_PIECE])
        await self.drained()

    async def drained(self) -> None:
        """Wait until the socket takes more (it took all but a bounded tail of what was written)."""
        await self._writable.wait()
        if self.closed:
            raise ConnectionResetError("connection closed while writing")

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True

    # -- hooks -----------------------------------------------------------------------------------------------
    def on_message_start(self) -> None: ...

    def on_header(self, msg: Message) -> bool:
        return True

    def on_message(self, msg: Message, records: list[Buffer]) -> None: ...

    def on_bad(self, header: bytes, exc: ProtocolError) -> None: ...

    def on_lost(self) -> None: ...


# -- client ------------------------------------------------------------------------------------------------------
class _ClientConnection(_Framed):
    def __init__(self, limits: Limits) -> None:
        super().__init__(limits, reply=True)
        self.answer: asyncio.Future[Answer] | None = None

    def on_message(self, msg: Message, records: list[Buffer]) -> None:
        if self.answer is None or self.answer.done():
            self.abort()  # a reply nobody asked for: the peer is broken
        else:
            self.answer.set_result((msg, records))

    def on_bad(self, header: bytes, exc: ProtocolError) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)

    def on_lost(self) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionResetError("peer closed the connection"))

    async def close(self) -> None:
        self.abort()

    async def request(self, header: bytes, records: Sequence[Buffer]) -> Answer:
        self.answer = asyncio.get_running_loop().create_future()
        await self.write(header, records)
        msg, got = await self.answer
        self.answer = None
        return msg, got


class TcpConnector(Connector):
    """Client wire: up to ``connections_per_peer`` connections per peer, made on demand, one request each."""

    def __init__(self, limits: Limits | None = None, options: TcpOptions | None = None) -> None:
        self.limits = limits or Limits()
        self.options = options or TcpOptions()
        self.counts: Counter[str] = Counter()
        self._ssl = self.options.tls.client_context() if self.options.tls is not None else None
        self._pool = ConnectionPool(self.options.connections_per_peer, self._connect, self.counts)
        self._ids = itertools.count(1)

    async def request(
        self, peer: Peer, op: Op, keys: Sequence[ChunkKey], records: Sequence[Buffer], timeout: float
    ) -> Answer | None:
        header = encode_request(op, next(self._ids), keys, [len(r) for r in records])
        return await self._pool.call(peer, timeout, lambda conn: conn.request(header, records),
                                     (OSError, ProtocolError))  # ssl.SSLError is an OSError

    async def _connect(self, peer: Peer) -> _ClientConnection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.options.connect_timeout):
            _, conn = await loop.create_connection(lambda: _ClientConnection(self.limits), peer.host, peer.port,
                                                   ssl=self._ssl)
        return conn

    async def forget(self, peer: Peer) -> None:
        await self._pool.forget(peer)

    async def close(self) -> None:
        await self._pool.close()


# -- server ------------------------------------------------------------------------------------------------------
class _ServerConnection(_Framed):
    def __init__(self, server: TcpPeerServer) -> None:
        super().__init__(server.service.options.limits, reply=False)
        self.server = server
        self.client: bytes = b""  # identity for limits: certificate fingerprint, else IP address
        self.identity: bytes | None = None  # proven identity (TLS client certificate), for tenants
        #: the connection's one timer; it closes the connection at ``_due`` (None: nothing due), see :meth:`_arm`
        self._timer: asyncio.TimerHandle | None = None
        self._due: float | None = None
        self._why = ""
        self._held = 0  # receive budget held by the request being read
        self._waiting: asyncio.Task[None] | None = None  # waiting for receive budget (reading paused)
        self._broken = False  # closed for breaking the protocol (counted once, as that)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        ssl_object = transport.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if der:
            self.identity = self.client = fingerprint(der)
        else:
            peername = transport.get_extra_info("peername")
            self.client = str(peername[0] if peername else "?").encode()
        if not self.server.admit(self):
            self.abort()
            return
        self._arm(self.server.options.idle_timeout, "idle")

    def _arm(self, seconds: float, why: str) -> None:
        """Close the connection in ``seconds`` (counted as ``closed_{why}``) unless armed again or disarmed.

        One timer per connection, moved only when the deadline comes sooner than it fires: a deadline moved
        later is found when the timer fires, which then waits on. So a request costs no timer of its own
        (a message deadline, then an idle one, per request, were two timers made and three cancelled)."""
        loop = asyncio.get_running_loop()
        self._due, self._why = loop.time() + seconds, why
        if self._timer is None or self._timer.when() > self._due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(self._due, self._on_timer)

    def _disarm(self) -> None:
        self._due = None  # the timer, if any, finds nothing due

    def _on_timer(self) -> None:
        self._timer = None
        if self._due is None:
            return
        loop = asyncio.get_running_loop()
        if self._due - loop.time() > _TIMER_SLACK:  # moved later since: wait on
            self._timer = loop.call_at(self._due, self._on_timer)
        else:
            self._expire(self._why)

    def _expire(self, why: str) -> None:
        self.server.counts[f"closed_{why}"] += 1
        self.abort()

    def on_message_start(self) -> None:
        self._arm(self.server.options.message_timeout, "message_timeout")

    def on_header(self, msg: Message) -> bool:
        nbytes = msg.payload_bytes
        if nbytes == 0:
            return True
        budget = self.server.budget
        if nbytes > budget.share():
            raise self._over_share(nbytes)
        if budget.try_take(self.client, nbytes):
            self._held = nbytes
            return True
        self.stall()
        self._waiting = self.server.spawn(self._wait_for_budget(nbytes))
        return False

    def _over_share(self, nbytes: int) -> ProtocolError:
        self.server.counts["refused_over_client_share"] += 1
        return ProtocolError(Status.TOO_LARGE, f"a payload of {nbytes} bytes, beyond this client's share of the "
                                               f"receive budget ({self.server.budget.share()} bytes)")

    async def _wait_for_budget(self, nbytes: int) -> None:
        # The message timer bounds the wait too (it closes the connection, which cancels this task).
        grant = await self.server.budget.take(self.client, nbytes, self.server.options.message_timeout)
        self._waiting = None
        if grant is Grant.TAKEN:
            self._held = nbytes
        if self.closed or self.transport is None:
            self._give_back()
            return
        if grant is Grant.OVER_SHARE:  # clients joined while it waited: its share shrank below it
            self.on_bad(self._header, self._over_share(nbytes))
            self.abort()
        elif grant is Grant.TIMED_OUT:
            self._expire("message_timeout")
        else:
            self.proceed()
            self.unstall()

    def _give_back(self) -> None:
        if self._held:
            self.server.budget.give(self.client, self._held)
            self._held = 0

    def on_message(self, msg: Message, records: list[Buffer]) -> None:
        self._disarm()  # serving is bounded by the service, the reply by reply_timeout
        self.stall()  # one request at a time per connection
        self.server.spawn(self._serve(msg, records), leaves_itself=True)

    async def _serve(self, msg: Message, records: list[Buffer]) -> None:
        try:
            await self._answer(msg, records)
        finally:
            self.server.leave()

    async def _answer(self, msg: Message, records: list[Buffer]) -> None:
        server = self.server
        try:
            reply = await server.serve(self, msg, records)
        finally:
            del records
            self._give_back()  # its payload was held from its header until it was served
        if self.closed:
            return
        small = reply.payload_bytes <= _ONE_WRITE
        try:  # a client that stops reading loses its connection, not a slot for good
            if not (small and self.write_at_once(reply.header, reply.records)):  # taken at once: no timer
                async with asyncio.timeout(server.service.options.reply_timeout):
                    await (self.drained() if small else self.write(reply.header, reply.records))
        except TimeoutError:
            server.counts["reply_abandoned_slow_client"] += 1
            self.abort()
            return
        except ConnectionError:
            return
        self._arm(server.options.idle_timeout, "idle")
        self.unstall()

    def on_bad(self, header: bytes, exc: ProtocolError) -> None:
        self._broken = True
        self.server.counts[f"dropped_connection_{exc.status.name.lower()}"] += 1
        self.server.blame(self, exc.reason)
        reply = self.server.service.refuse(peek_request_id(header), exc.status)  # None before a header
        if reply is not None and self.transport is not None:  # best effort, then the connection is closed
            self.transport.write(_LEN.pack(len(reply.header)) + reply.header)

    def on_lost(self) -> None:
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._waiting is not None:  # a request waiting for receive budget leaves the line
            self._waiting.cancel()
            self._waiting = None
        if self.mid_message and not self._broken:  # the sender hung up part-way through a message
            self.server.counts["dropped_partial_message"] += 1
        self._give_back()
        self.server.forget(self)


class TcpPeerServer:
    """Serves a :class:`RecordStore` to peers on ``bind`` (``host:port``; port 0 picks one)."""

    def __init__(self, store: RecordStore, bind: str, options: ServerOptions | None = None,
                 tcp_options: TcpServerOptions | None = None) -> None:
        self.service = PeerService(store, options)
        self.options = tcp_options or TcpServerOptions()
        self.host, self.port = split_host_port(bind)
        self.address: str | None = None
        self._per_client: Counter[bytes] = Counter()  # connections per client
        self.budget = SharedByteBudget(self.options.receive_budget_bytes,
                                       min_share=self.options.min_client_share_bytes,
                                       clients=lambda: len(self._per_client))
        tls = self.options.tls
        if self.service.options.tenants is not None:
            if tls is None or tls.ca is None:
                raise ConfigError("tenants need TLS with a client CA (the wire must prove each client's "
                                  "certificate): set the tls cert, key and client ca")
            if any(not k.startswith(b"sha256:") for k in self.service.options.tenants.policy.grants):
                raise ConfigError("over TLS, tenants are granted by certificate fingerprint ('sha256:<hex>', "
                                  "see `kvengine.transports.peers.tcp.fingerprint`), not CURVE keys")
        self._ssl = tls.server_context() if tls is not None else None
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self._inflight: Counter[bytes] = Counter()
        self._slots = asyncio.Semaphore(self.service.options.max_concurrent)
        self._tasks: set[asyncio.Task[None]] = set()
        self._blamed: set[bytes] = set()

    @property
    def counts(self) -> Counter[str]:
        return self.service.counts

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(lambda: _ServerConnection(self), self.host, self.port,
                                                    ssl=self._ssl, ssl_handshake_timeout=self.options.message_timeout
                                                    if self._ssl else None)
        except OSError as exc:
            raise TransportError(f"cannot bind {format_address(self.host, self.port)}: {exc}") from exc
        self.address = format_address(self.host, self._server.sockets[0].getsockname()[1])

    def admit(self, conn: _ServerConnection) -> bool:
        if len(self._connections) >= self.options.max_connections:
            self.counts["refused_connection_limit"] += 1
            return False
        if self._per_client[conn.client] >= self.options.max_connections_per_client:
            self.counts["refused_connection_client_limit"] += 1
            return False
        self._connections.add(conn)
        self._per_client[conn.client] += 1
        if self._per_client[conn.client] == 1:
            self.budget.reshare()  # one more client: shares shrink
        return True

    def forget(self, conn: _ServerConnection) -> None:
        if conn in self._connections:
            self._connections.discard(conn)
            self._per_client[conn.client] -= 1
            if not self._per_client[conn.client]:
                del self._per_client[conn.client]
                self.budget.reshare()  # one client fewer: shares grow

    def spawn(self, work: Coroutine[Any, Any, None], *, leaves_itself: bool = False) -> asyncio.Task[None]:
        """Run ``work`` as a task this server cancels when it closes. ``leaves_itself``: ``work`` calls
        :meth:`leave` when it ends (a done callback would cost a loop turn more per request)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        if not leaves_itself:
            task.add_done_callback(self._tasks.discard)
        return task

    def leave(self) -> None:
        """The running task (spawned ``leaves_itself``) ends."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.discard(task)

    def blame(self, conn: _ServerConnection, what: str) -> None:
        if conn.client not in self._blamed:
            self._blamed.add(conn.client)
            log.warning("kvengine peer server: client %s broke the protocol (%s); its connection is closed",
                        conn.client.decode(errors="replace"), what)

    async def serve(self, conn: _ServerConnection, msg: Message, records: list[Buffer]) -> Reply:
        """The reply to one whole request; ``BUSY`` beyond the client's in-flight share."""
        limit = self.service.options.max_inflight_per_client
        if self._inflight[conn.client] >= limit:
            busy = self.service.refuse(msg.request_id, Status.BUSY)
            assert busy is not None
            return busy
        self._inflight[conn.client] += 1
        try:
            async with self._slots:
                reply = await self.service.serve(msg, [r for r in records if len(r)], conn.identity)
        finally:
            self._inflight[conn.client] -= 1
            if not self._inflight[conn.client]:
                del self._inflight[conn.client]
        assert reply is not None, "an admitted request always gets a reply"
        return reply

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


def from_section(peers: PeersConfig) -> PeerTransport:
    """The peer tier of an engine's typed ``peers`` section (what :func:`kvengine.tiers.build_tiers` calls)."""
    tls = _tls({"tls_ca": peers.tls_ca, "tls_cert": peers.tls_cert, "tls_key": peers.tls_key})
    membership, options = client_from_section(peers, encrypted=tls is not None)
    return PeerTransport(TcpConnector(options.limits, TcpOptions(tls=tls)), membership, options, name="peers_tcp")


def _tls(config: dict[str, Any]) -> TlsConfig | None:
    """TLS settings from (and popped out of) ``tls_ca`` / ``tls_cert`` / ``tls_key``; None without any."""
    paths = {k: config.pop(f"tls_{k}", None) for k in ("cert", "key", "ca")}
    if not any(paths.values()):
        return None
    if paths["ca"] is None:
        raise ConfigError("peers_tcp: tls_cert/tls_key need tls_ca (the CA of the peers' certificates)")
    return TlsConfig(**{k: Path(v) if v is not None else None for k, v in paths.items()})


def create_transport(config: Mapping[str, Any]) -> PeerTransport:
    """Entry-point factory (group ``kvengine.transports``, name ``peers_tcp``).

    Keys: those of :func:`client_from_config`, ``connections_per_peer`` /
    ``connect_timeout`` (:class:`TcpOptions`), and ``tls_ca`` (turns TLS on)
    with ``tls_cert`` / ``tls_key`` (this client's certificate, for servers
    that require one).
    """
    cfg = dict(config)
    tls = _tls(cfg)
    membership, options = client_from_config(cfg, "peers_tcp", encrypted=tls is not None)
    try:
        tcp_options = TcpOptions(**cfg, tls=tls)
    except TypeError as exc:
        raise ConfigError(f"invalid peers_tcp transport config: {exc}") from None
    return PeerTransport(TcpConnector(options.limits, tcp_options), membership, options, name="peers_tcp")

