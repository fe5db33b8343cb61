"""Peer sharing over ZeroMQ (pyzmq, ``zmq.asyncio``).

* :class:`ZmqConnector` -- the client wire for :class:`PeerTransport`: one
  DEALER socket per peer, many requests in flight on it, replies matched by
  request id. ``IMMEDIATE`` (nothing queues for a peer that is not
  connected), high-water marks on both directions, ``MAXMSGSIZE`` (a peer
  sending an oversized frame is cut off; libzmq applies it to each part,
  so it does not bound a multipart message), ``LINGER 0``. A disconnect seen by
  the socket monitor fails that peer's requests at once instead of at their
  deadline.
* :class:`ZmqPeerServer` -- a ROUTER socket in front of a
  :class:`PeerService`; at most ``max_concurrent`` requests at once, after
  which it stops reading (the high-water marks push back to the senders).
  Runs on any event loop: embedded next to an engine, or standalone
  (``kvengine serve --transport zmq``; its default is the tcp wire).

Records travel as frames of ``Limits.frame_bytes`` (~1 MiB; one 64 MiB frame
is several times slower through libzmq) sent with ``copy=False``.

CURVE (:class:`CurveConfig`): servers need their key pair; clients need a
key pair and the servers' public key. With ``allowed_clients`` a server
admits only those client keys (a ZAP handler on the server's own context);
without it, any client that knows the server's public key. Off loopback a
server must have ``allowed_clients``: libzmq assembles each message whole
before the server sees it, so bounds on frames and bytes cannot be enforced
before buffering (:mod:`.tcp` can), and only admission keeps a
stranger from stalling the server. A client without
the right keys never completes the handshake: its requests time out (misses).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import itertools
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvengine.addresses import is_loopback
from kvengine.chunks.keys import ChunkKey
from kvengine.config import PeersConfig
from kvengine.errors import ConfigError, TransportError
from kvengine.transport import Buffer

from .client import Answer, Connector, PeerTransport, client_from_config, client_from_section
from .placement import Peer, format_address, split_host_port
from .protocol import (
    TAG_MAGIC,
    Limits,
    Message,
    Op,
    ProtocolError,
    RecordAssembler,
    Status,
    decode_header,
    decode_tag,
    encode_request,
    gather_records,
    split_frames,
    tagged,
)
from .service import PeerService, Reply, ServerOptions
from .store import RecordStore

log = logging.getLogger(__name__)

#: Receive queue of a client, in messages: a whole streamed reply (max_reply_bytes / frame) fits.
_STREAM_HWM = 1024
#: First and longest pause while a reply waits for a client whose queue is full.
_RETRY_FIRST, _RETRY_MAX = 0.0005, 0.05
#: Fewest bytes a request's payload frame carries (except a record's last): with the header's announced
#: payload it bounds how many frames a request may have. Clients send ``Limits.frame_bytes`` (1 MiB).
_MIN_FRAME_BYTES = 64 << 10
#: After dropping a flood of this many frames, hand the memory libzmq held for them back to the OS.
_TRIM_AFTER_FRAMES = 1 << 16


async def _released(tracker: zmq.MessageTracker) -> None:
    """Wait until libzmq has let go of a tracked message: written to the kernel, or dropped with its client."""
    pause = _RETRY_FIRST
    while not tracker.done:
        await asyncio.sleep(pause)
        pause = min(2 * pause, _RETRY_MAX)


def _release_freed_memory() -> None:
    """glibc keeps freed small blocks (libzmq's ~64 B per queued frame) in its arenas; return them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveConfig:
    """CURVE keys, Z85-encoded (40 bytes each), as made by :func:`zmq.curve_keypair`."""

    public_key: bytes
    secret_key: bytes
    #: Clients: the public key of the peer servers.
    server_key: bytes | None = None
    #: Servers: the client public keys admitted; None admits any client that knows the server key.
    allowed_clients: frozenset[bytes] | None = None

    def __post_init__(self) -> None:
        keys = [self.public_key, self.secret_key, *([self.server_key] if self.server_key else []),
                *(self.allowed_clients or ())]
        if any(len(k) != 40 for k in keys):
            raise ConfigError("CURVE keys must be 40-byte Z85 strings (zmq.curve_keypair())")
        if not zmq.has("curve"):
            raise ConfigError("this libzmq was built without CURVE support")

    @classmethod
    def generate(cls, **extra: Any) -> CurveConfig:
        public, secret = zmq.curve_keypair()
        return cls(public_key=public, secret_key=secret, **extra)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZmqOptions:
    #: Messages queued per direction per socket before senders wait.
    hwm: int = 16
    #: Requests in flight per peer; more wait (within their timeout). At most the server's
    #: ``max_inflight_per_client`` (4 by default), which answers ``BUSY`` beyond it.
    max_inflight: int = 4
    curve: CurveConfig | None = None

    def __post_init__(self) -> None:
        if self.hwm < 1 or self.max_inflight < 1:
            raise ConfigError("zmq hwm and max_inflight must be >= 1")


def _socket_options(sock: zmq.Socket[Any], host: str, limits: Limits, options: ZmqOptions) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, options.hwm)
    sock.setsockopt(zmq.RCVHWM, options.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
    sock.setsockopt(zmq.IPV6, ":" in host)


class _Pending:
    __slots__ = ("future", "message", "assembler")

    def __init__(self, future: asyncio.Future[Answer | None]) -> None:
        self.future = future
        self.message: Message | None = None
        self.assembler: RecordAssembler | None = None

    def finish(self, answer: Answer | None) -> None:
        if not self.future.done():
            self.future.set_result(answer)


class _Connection:
    """One DEALER socket to one peer; requests multiplexed by id."""

    def __init__(self, ctx: zmq.asyncio.Context, peer: Peer, limits: Limits, options: ZmqOptions) -> None:
        self.limits = limits
        self.sock = ctx.socket(zmq.DEALER)
        _socket_options(self.sock, peer.host, limits, options)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.RCVHWM, _STREAM_HWM)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if options.curve is not None:
            if options.curve.server_key is None:
                raise ConfigError("a CURVE client needs curve.server_key")
            self.sock.curve_publickey = options.curve.public_key
            self.sock.curve_secretkey = options.curve.secret_key
            self.sock.curve_serverkey = options.curve.server_key
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(f"tcp://{peer.address}")
        self.pending: dict[int, _Pending] = {}
        self.slots = asyncio.Semaphore(options.max_inflight)
        self.ids = itertools.count(1)
        self.counts: Counter[str] = Counter()
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def request(
        self, op: Op, keys: Sequence[ChunkKey], records: Sequence[Buffer], timeout: float
    ) -> Answer | None:
        request_id = next(self.ids)
        header = encode_request(op, request_id, keys, [len(r) for r in records])
        frames = [header, *split_frames(records, self.limits.frame_bytes)]
        pending = self.pending[request_id] = _Pending(asyncio.get_running_loop().create_future())
        try:
            async with asyncio.timeout(timeout), self.slots:
                await self.sock.send_multipart(frames, copy=False)
                return await pending.future
        except TimeoutError:
            self.counts["timeouts"] += 1
            return None
        except zmq.ZMQError as exc:
            self.counts[f"send_error_{exc.errno}"] += 1
            return None
        finally:
            del self.pending[request_id]

    async def _read(self) -> None:
        while True:
            msg = await self.sock.recv_multipart(copy=False)
            try:
                first = msg[0].buffer
                if first[:4] == TAG_MAGIC and len(msg) == 2:
                    self._on_data(first, msg[1].buffer)
                else:
                    self._on_header(first, [f.buffer for f in msg[1:]])
            except ProtocolError as exc:
                self.counts["bad_replies"] += 1
                log.debug("kvengine: malformed reply from a peer: %s", exc)

    def _on_header(self, buf: memoryview, inline: list[memoryview]) -> None:
        head = decode_header(buf, self.limits, reply=True)
        pending = self.pending.get(head.request_id)
        if pending is None or pending.message is not None:
            self.counts["late_replies"] += 1
            return
        pending.message = head
        if inline or head.payload_bytes == 0:
            try:
                pending.finish((head, gather_records(inline, head.lengths)))
            except ProtocolError:
                pending.finish(None)
                raise
        else:
            pending.assembler = RecordAssembler(head.lengths)

    def _on_data(self, tag: memoryview, frame: memoryview) -> None:
        request_id, offset = decode_tag(tag)
        pending = self.pending.get(request_id)
        if pending is None or pending.assembler is None or pending.future.done():
            self.counts["late_replies"] += 1
            return
        try:
            done = pending.assembler.feed(offset, frame)
        except ProtocolError:
            pending.finish(None)
            raise
        if done:
            assert pending.message is not None
            pending.finish((pending.message, pending.assembler.records()))

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.counts["disconnects"] += 1
                for pending in self.pending.values():
                    pending.finish(None)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for pending in self.pending.values():
            pending.finish(None)
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class ZmqConnector(Connector):
    """Client wire: lazily one :class:`_Connection` per peer, on the loop that first uses it."""

    def __init__(self, limits: Limits | None = None, options: ZmqOptions | None = None) -> None:
        self.limits = limits or Limits()
        self.options = options or ZmqOptions()
        self._ctx: zmq.asyncio.Context | None = None
        self._conns: dict[Peer, _Connection] = {}

    async def request(
        self, peer: Peer, op: Op, keys: Sequence[ChunkKey], records: Sequence[Buffer], timeout: float
    ) -> Answer | None:
        conn = self._conns.get(peer)
        if conn is None:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            conn = self._conns[peer] = _Connection(self._ctx, peer, self.limits, self.options)
        return await conn.request(op, keys, records, timeout)

    async def forget(self, peer: Peer) -> None:
        conn = self._conns.pop(peer, None)
        if conn is not None:
            await conn.close()

    async def close(self) -> None:
        for peer in list(self._conns):
            await self.forget(peer)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for conn in self._conns.values():
            total.update(conn.counts)
        return total


class _AllowList:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class ZmqPeerServer:
    """Serves a :class:`RecordStore` to peers on ``bind`` (``host:port``; port 0 picks one)."""

    def __init__(
        self, store: RecordStore, bind: str, options: ServerOptions | None = None,
        zmq_options: ZmqOptions | None = None,
    ) -> None:
        self.service = PeerService(store, options)
        self.host, self.port = split_host_port(bind)
        self.zmq_options = zmq_options or ZmqOptions()
        self.address: str | None = None  # host:port actually bound, once started
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: Any = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight: Counter[bytes] = Counter()  # requests being served, per client routing id
        self._blamed: set[str] = set()
        self._loop_task: asyncio.Task[None] | None = None
        curve = self.zmq_options.curve
        if not is_loopback(self.host) and (curve is None or curve.allowed_clients is None):
            raise ConfigError(
                f"a ZeroMQ peer server on {bind} (off loopback) must admit only listed clients (CURVE with "
                "allowed_clients): libzmq buffers each message whole before kvengine can check it, so any client "
                "that connects could stall the server. For clients you do not all trust, use the tcp wire")
        if self.service.options.tenants is not None and (
                self.zmq_options.curve is None or self.zmq_options.curve.allowed_clients is None):
            raise ConfigError("tenants need CURVE with an allow-list (the wire must prove each client's key); "
                              "set curve.allowed_clients to the tenants' keys")

    @property
    def counts(self) -> Counter[str]:
        return self.service.counts

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        _socket_options(sock, self.host, self.service.options.limits, self.zmq_options)
        sock.setsockopt(zmq.SNDHWM, _STREAM_HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        curve = self.zmq_options.curve
        if curve is not None:
            if curve.allowed_clients is not None:
                from zmq.auth.asyncio import AsyncioAuthenticator

                self._auth = AsyncioAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback("*", _AllowList(curve.allowed_clients))
            sock.curve_server = True
            sock.curve_publickey = curve.public_key
            sock.curve_secretkey = curve.secret_key
        endpoint = f"tcp://{format_address(self.host, self.port)}"
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            await self.close()
            raise TransportError(f"cannot bind {endpoint}: {exc}") from exc
        _, port = split_host_port(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self.address = format_address(self.host, port)
        self._loop_task = asyncio.create_task(self._serve(sock), name="kvengine-peer-server")

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        slots = asyncio.Semaphore(self.service.options.max_concurrent)
        reader: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)  # reads the parts after a message's first without futures
        while True:
            await slots.acquire()
            try:
                request = await self._receive(sock, reader)
            except BaseException:
                slots.release()
                raise
            if request is None:
                slots.release()
                continue
            ident = request[0]
            self._inflight[ident] += 1
            task = asyncio.create_task(self._answer_and_hold(sock, slots, *request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer_and_hold(self, sock: zmq.asyncio.Socket, slots: asyncio.Semaphore, ident: bytes,
                               client: bytes | None, msg: Message, frames: list[memoryview]) -> None:
        """Answer one request, then hold the client's in-flight slot until libzmq has let go of the reply.

        libzmq queues a client's replies (up to ``_STREAM_HWM`` messages) whatever the client reads, so a
        reply "sent" may still be in memory: a client that never reads would pin a thousand replies (a
        GiB of 1 MiB records, copies when they came from disk) while its slots freed as fast as they were
        queued. Holding its own slot until the reply's last buffer is released bounds what it pins to
        ``max_inflight_per_client`` replies; the server-wide slot is freed as soon as the reply is queued,
        so a client that never reads costs others nothing."""
        sent: zmq.MessageTracker | None = None
        try:
            try:
                sent = await self._answer(sock, ident, client, msg, frames)
            finally:
                slots.release()
            if sent is not None:
                await _released(sent)
        finally:
            self._inflight[ident] -= 1
            if not self._inflight[ident]:
                del self._inflight[ident]

    async def _receive(self, sock: zmq.asyncio.Socket,
                       reader: zmq.Socket[Any]) -> tuple[bytes, bytes | None, Message, list[memoryview]] | None:
        """Read one request part by part: (routing id, client key, header, payload frames), or None when it
        was refused or dropped. Nothing beyond what the header announces is kept: the parts of a request
        that breaks its own header (too many, too large), or of a client over its in-flight limit, are
        read and dropped one at a time, so a flood of frames costs time, not memory."""
        first = await sock.recv(copy=False)
        ident = first.bytes
        if not first.more:
            self.counts["dropped_no_header"] += 1
            return None
        header = await self._next(sock, reader)
        msg = self.service.admit(header.buffer)
        more = header.more
        frames: list[memoryview] | None = None  # set only for a request that is served
        refusal: Reply | None = None
        if not isinstance(msg, Message):
            refusal = msg
        elif self._inflight[ident] >= self.service.options.max_inflight_per_client:
            refusal = self.service.refuse(msg.request_id, Status.BUSY)
        else:
            frames, more = await self._payload(sock, reader, msg, more)
            if frames is None:
                refusal = self.service.refuse(msg.request_id, Status.BAD_REQUEST)
                self._blame(header, "sent a payload larger than its header announces")
        if more:
            await self._discard(sock, reader)
        if frames is None or not isinstance(msg, Message):
            if refusal is not None:
                self._reply_now(reader, ident, refusal)
            return None
        client = str(header.get("User-Id")) if self.service.options.tenants is not None else ""
        return ident, client.encode() or None, msg, frames

    async def _payload(self, sock: zmq.asyncio.Socket, reader: zmq.Socket[Any], msg: Message,
                       more: bool) -> tuple[list[memoryview] | None, bool]:
        """The payload frames ``msg`` announces, read while they stay within it: (frames or None when the
        payload breaks the header, whether parts of the message remain unread)."""
        max_frames = sum(1 for n in msg.lengths if n) + msg.payload_bytes // min(
            _MIN_FRAME_BYTES, self.service.options.limits.frame_bytes)
        frames: list[memoryview] = []
        received = 0
        while more and len(frames) < max_frames and received < msg.payload_bytes:
            frame = await self._next(sock, reader)
            frames.append(frame.buffer)
            received += len(frame.buffer)
            more = frame.more
        if more or received > msg.payload_bytes:
            return None, more
        return frames, more

    def _blame(self, frame: zmq.Frame, what: str) -> None:
        """Log, once per client, a client that breaks the protocol on purpose or by a bug (an operator
        removes its key from the allow-list; libzmq offers no way to cut one client off)."""
        who = f"{frame.get('Peer-Address')}" + (f" (key {frame.get('User-Id')})" if self._auth is not None else "")
        if who not in self._blamed and len(self._blamed) < 1024:
            self._blamed.add(who)
            log.warning("kvengine peer server: client %s %s; its requests are refused", who, what)

    async def _next(self, sock: zmq.asyncio.Socket, reader: zmq.Socket[Any]) -> zmq.Frame:
        """The next part of the message being read (its parts arrive together: libzmq delivers whole messages)."""
        while True:
            try:
                return reader.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # not expected; wait rather than block the loop
                await sock.poll(zmq.POLLIN)

    async def _discard(self, sock: zmq.asyncio.Socket, reader: zmq.Socket[Any]) -> None:
        """Read and drop the rest of the message being read, yielding to other work now and then.

        Each part is taken as a frame (no copy) and its ``more`` flag read from it: one call into libzmq per
        part, about 0.5 µs, where a copy plus a ``RCVMORE`` query cost 0.85 µs. Other clients' requests wait
        meanwhile (libzmq hands over the parts of one message before the next message), so this is what a
        flood of tiny frames costs them."""
        dropped = 0
        recv, noblock = reader.recv, zmq.NOBLOCK
        while True:
            try:
                more = recv(noblock, copy=False).more
            except zmq.Again:  # not expected (whole messages); wait rather than block the loop
                await sock.poll(zmq.POLLIN)
                continue
            dropped += 1
            if not more:
                break
            if dropped % 8192 == 0:
                await asyncio.sleep(0)
        self.counts["frames_dropped"] += dropped
        if dropped >= _TRIM_AFTER_FRAMES:
            _release_freed_memory()

    def _reply_now(self, raw: zmq.Socket[Any], ident: bytes, reply: Reply) -> None:
        """Send a small refusal if the client's queue has room; else drop it (the client's timeout answers)."""
        try:
            raw.send_multipart([ident, reply.header], flags=zmq.DONTWAIT)
        except zmq.ZMQError:
            self.counts["refusal_dropped"] += 1

    async def _answer(self, sock: zmq.asyncio.Socket, ident: bytes, client: bytes | None, msg: Message,
                      frames: list[memoryview]) -> zmq.MessageTracker | None:
        """Serve ``msg`` and queue its reply: the tracker of the reply's last message, or None when nothing
        was queued. (libzmq sends a client's messages in order, so the last one's release is the whole
        reply's.)"""
        reply = await self.service.serve(msg, frames, client)
        if reply is None:
            return None
        frame_bytes = self.service.options.limits.frame_bytes
        deadline = asyncio.get_running_loop().time() + self.service.options.reply_timeout
        try:
            if reply.payload_bytes <= frame_bytes:  # small: inline, one message
                return await self._send(sock, [ident, reply.header, *reply.records], deadline, track=True)
            await self._send(sock, [ident, reply.header], deadline)
            parts = list(tagged(reply.request_id, split_frames(reply.records, frame_bytes)))
            for tag, frame in parts[:-1]:
                await self._send(sock, [ident, tag, frame], deadline)
            tag, frame = parts[-1]
            return await self._send(sock, [ident, tag, frame], deadline, track=True)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client is gone
            self.counts[f"reply_abandoned_{errno.errorcode.get(exc.errno or 0, exc.errno)}"] += 1
        except TimeoutError:
            self.counts["reply_abandoned_slow_client"] += 1
        return None

    async def _send(self, sock: zmq.asyncio.Socket, parts: list[Any], deadline: float, *,
                    track: bool = False) -> zmq.MessageTracker | None:
        """Send one message (its tracker when ``track``); wait (bounded) while this client's queue is full
        (ROUTER_MANDATORY)."""
        pause = _RETRY_FIRST
        while True:
            try:
                return await sock.send_multipart(parts, flags=zmq.DONTWAIT, copy=False, track=track)
            except zmq.Again:
                if asyncio.get_running_loop().time() + pause > deadline:
                    raise TimeoutError from None
                await asyncio.sleep(pause)
                pause = min(2 * pause, _RETRY_MAX)

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._auth is not None:
            self._auth.stop()
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = self._auth = None


def from_section(peers: PeersConfig) -> PeerTransport:
    """The peer tier of an engine's typed ``peers`` section (what :func:`kvengine.tiers.build_tiers` calls)."""
    curve = _curve(peers.curve_public_key, peers.curve_secret_key, peers.curve_server_key)
    membership, options = client_from_section(peers, encrypted=curve is not None)
    return PeerTransport(ZmqConnector(options.limits, ZmqOptions(curve=curve)), membership, options, name="peers_zmq")


def _curve(*keys: str | bytes | None) -> CurveConfig | None:
    """A client's CURVE settings from its public, secret and server keys (all or none)."""
    if not any(keys):
        return None
    public, secret, server = (k.encode() if isinstance(k, str) else k for k in keys)
    if public is None or secret is None or server is None:
        raise ConfigError("CURVE needs curve_public_key, curve_secret_key and curve_server_key")
    return CurveConfig(public_key=public, secret_key=secret, server_key=server)


def create_transport(config: Mapping[str, Any]) -> PeerTransport:
    """Entry-point factory (group ``kvengine.transports``, name ``peers_zmq``).

    Keys: those of :func:`client_from_config`, ``hwm``, and
    ``curve_public_key`` / ``curve_secret_key`` / ``curve_server_key`` (Z85
    strings) to turn CURVE on.
    """
    cfg = dict(config)
    curve_keys = [cfg.pop(k, None) for k in ("curve_public_key", "curve_secret_key", "curve_server_key")]
    membership, options = client_from_config(cfg, "peers_zmq", encrypted=all(curve_keys))
    curve = _curve(*curve_keys)
    zmq_options = ZmqOptions(hwm=int(cfg.pop("hwm", ZmqOptions().hwm)), curve=curve)
    if cfg:
        raise ConfigError(f"unknown peers_zmq transport config keys: {sorted(cfg)}")
    return PeerTransport(ZmqConnector(options.limits, zmq_options), membership, options, name="peers_zmq")
