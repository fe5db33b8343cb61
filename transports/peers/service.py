"""The server side of the peer protocol, independent of the wire (ZeroMQ, UCX).

:meth:`PeerService.handle` turns one request (header + payload frames) into
one reply (header + payload frames) against a :class:`RecordStore`:

* a message that cannot be decoded is answered with an error status when it
  carries a request id, otherwise dropped (``None``); either way counted;
* keys of namespaces outside ``ServerOptions.namespaces`` are misses, and
  puts of them are refused;
* with ``ServerOptions.tenants`` (:mod:`.tenants`), the same for every
  namespace the requesting client's tenant does not own (reads) or may not
  write (puts, deletes; a writer's first put claims an unowned namespace);
* a put record is stored only if it verifies under its key (header always;
  payload checksum too with ``verify_puts``), so a server never holds bytes
  under a key they do not belong to;
* a get never returns a record whose header names another key, and stops
  adding records once the reply would exceed ``max_reply_bytes`` (the rest
  are misses);
* a store that raises is a fault of this node: logged once, counted, and
  answered as misses.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from kvengine.chunks.keys import ChunkKey, NamespaceDigest
from kvengine.chunks.record import verify_record, verify_seal
from kvengine.errors import IntegrityError
from kvengine.threads import start_thread
from kvengine.transport import Buffer

from .protocol import (
    Limits,
    Message,
    Op,
    ProtocolError,
    Status,
    decode_header,
    encode_reply,
    gather_records,
    peek_request_id,
    record_matches,
)
from .store import RecordStore
from .tenants import Access, Gatekeeper

log = logging.getLogger(__name__)

#: Payloads above this are joined and verified in a worker thread, not on the event loop.
_THREAD_BYTES = 256 * 1024
#: the counter each op's requests are counted under
_OP_COUNTS = {op: f"op_{op.name.lower()}" for op in Op}


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply to send: its header and the records it carries (each whole; the wire frames them)."""

    request_id: int
    header: bytes
    records: list[Buffer] = field(default_factory=list)

    @property
    def payload_bytes(self) -> int:
        return sum(len(r) for r in self.records)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    limits: Limits = field(default_factory=Limits)
    #: Namespaces served; None serves every namespace.
    namespaces: frozenset[NamespaceDigest] | None = None
    #: Check each put record's payload checksum too (the header is always checked).
    verify_puts: bool = True
    #: Requests served at once; beyond it the server stops reading (backpressure).
    max_concurrent: int = 32
    #: Requests of one client served at once; beyond it that client's requests are refused ``BUSY`` (so a
    #: client that floods, or stops reading its replies, holds at most this many of ``max_concurrent``).
    max_inflight_per_client: int = 4
    #: Records of one get reply, in bytes; later records are answered as misses.
    max_reply_bytes: int = 512 << 20
    #: How long a reply may wait for a client that does not read; then it is abandoned and its slot freed.
    reply_timeout: float = 5.0
    #: The peer group's shared secret: puts must carry a record MAC that verifies under it, so no one
    #: without it can plant a record here (None: puts are checked for integrity only).
    secret: bytes | None = field(default=None, repr=False)
    #: Per-tenant access control by client identity (needs a wire that proves it: ZeroMQ CURVE).
    tenants: Gatekeeper | None = None

    def __post_init__(self) -> None:
        if min(self.max_concurrent, self.max_inflight_per_client, self.max_reply_bytes) < 1 or self.reply_timeout <= 0:
            raise ValueError("max_concurrent, max_inflight_per_client, max_reply_bytes and reply_timeout must be "
                             "positive")


class PeerService:
    def __init__(self, store: RecordStore, options: ServerOptions | None = None) -> None:
        self.store = store
        self.options = options or ServerOptions()
        self.counts: Counter[str] = Counter()

    async def handle(self, header: Buffer, frames: Sequence[Buffer], client: bytes | None = None) -> Reply | None:
        """The reply to one request from ``client`` (its proven identity, if the wire has one), or None to
        drop it unanswered."""
        msg = self.admit(header)
        if not isinstance(msg, Message):
            return msg
        return await self.serve(msg, frames, client)

    def admit(self, header: Buffer) -> Message | Reply | None:
        """A request's decoded header, or the error reply to send (None: drop it, it names no request)."""
        try:
            return decode_header(header, self.options.limits, reply=False)
        except ProtocolError as exc:
            return self.refuse(peek_request_id(header), exc.status)

    def refuse(self, request_id: int | None, status: Status) -> Reply | None:
        """A whole-request refusal (counted); None when there is no request id to address it to."""
        self.counts[f"refused_{status.name.lower()}"] += 1
        if request_id is None:
            return None
        return Reply(request_id, encode_reply(Op.PING, request_id, status))

    async def serve(self, msg: Message, frames: Sequence[Buffer], client: bytes | None = None) -> Reply | None:
        """The reply to an admitted request whose payload came as ``frames``."""
        payload = msg.payload_bytes
        try:
            if payload > _THREAD_BYTES:
                records = await asyncio.to_thread(gather_records, frames, msg.lengths)
            elif payload or frames:
                records = gather_records(frames, msg.lengths)
            else:  # no record (every get, exists, delete)
                records = [b""] * len(msg.lengths)
        except ProtocolError as exc:
            return self.refuse(msg.request_id, exc.status)
        self.counts[_OP_COUNTS[msg.op]] += 1
        try:
            return await self._dispatch(msg, records, client)
        except Exception as exc:  # the store broke its no-raise contract: a miss, counted and logged
            self.counts["store_error"] += 1
            if self.counts["store_error"] == 1:
                log.warning("kvengine peer server: store failed (%s: %s); answering misses", type(exc).__name__, exc)
            return Reply(msg.request_id, encode_reply(msg.op, msg.request_id, Status.OK, [False] * len(msg.keys)))

    async def _dispatch(self, msg: Message, records: list[Buffer], client: bytes | None) -> Reply:
        keys = msg.keys
        if msg.op is Op.PING:
            return Reply(msg.request_id, encode_reply(msg.op, msg.request_id, Status.OK, [True] * len(keys)))
        allowed = await self._allowed(msg.op, keys, client)
        if msg.op is Op.PUT:
            stored = await self._put(keys, records, allowed)
            return Reply(msg.request_id, encode_reply(msg.op, msg.request_id, Status.OK, stored))
        wanted = [k for k, ok in zip(keys, allowed) if ok]
        if msg.op is Op.GET:
            return await self._get(msg, wanted, allowed)
        if msg.op is Op.DELETE and self.options.secret is not None:
            failing = set(await self._failing(wanted))
            allowed = [ok and k in failing for k, ok in zip(keys, allowed)]
            wanted = [k for k, ok in zip(keys, allowed) if ok]
        call = self.store.exists if msg.op is Op.EXISTS else self.store.delete
        answers = iter(await call(wanted) if wanted else [])
        flags = [ok and next(answers) for ok in allowed]
        return Reply(msg.request_id, encode_reply(msg.op, msg.request_id, Status.OK, flags))

    async def _allowed(self, op: Op, keys: Sequence[ChunkKey], client: bytes | None) -> list[bool]:
        """Per key: served here, and (with tenants) the client's tenant may do ``op`` to its namespace."""
        allowed = [self._serves(k) for k in keys]
        gate = self.options.tenants
        if gate is None:
            return allowed
        access = Access.WRITE if op in (Op.PUT, Op.DELETE) else Access.READ
        verdicts: dict[NamespaceDigest, bool] = {}
        for ns in {k.namespace for k, ok in zip(keys, allowed) if ok}:
            verdicts[ns] = gate.permits(client, access, ns)
            if not verdicts[ns] and op is Op.PUT and gate.owner(ns) is None:  # a writer's first put claims it
                verdicts[ns] = await asyncio.to_thread(gate.claim, client, ns)
        denied = sum(ok and not verdicts[k.namespace] for k, ok in zip(keys, allowed))
        if denied:
            self.counts[f"denied_{access.value}"] += denied
        return [ok and verdicts[k.namespace] for k, ok in zip(keys, allowed)]

    async def _failing(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        """Of ``keys``, those whose stored record no longer verifies under the secret.

        With a secret, a DELETE is a report of a bad copy, checked here: only a record that fails its
        MAC is removed, so a client without the secret cannot starve others by deleting their chunks.
        """
        bad = []
        for key, record in zip(keys, await self.store.get(keys) if keys else []):
            if record is not None and not await self._verifies(key, record, counted=False):
                bad.append(key)
        self.counts["delete_refused_record_valid"] += len(keys) - len(bad)
        return bad

    def _serves(self, key: ChunkKey) -> bool:
        return self.options.namespaces is None or key.namespace in self.options.namespaces

    async def _get(self, msg: Message, wanted: list[ChunkKey], allowed: list[bool]) -> Reply:
        found = iter(await self.store.get(wanted) if wanted else [])
        budget = self.options.max_reply_bytes
        flags: list[bool] = []
        lengths: list[int] = []
        out: list[Buffer] = []
        for key, ok in zip(msg.keys, allowed):
            record = next(found) if ok else None
            if record is not None and record_matches(key, record) is not None:
                self.counts["stored_record_bad"] += 1
                record = None
            if record is not None and len(record) > budget:
                self.counts["reply_budget_exceeded"] += 1
                record = None
            flags.append(record is not None)
            lengths.append(0 if record is None else len(record))
            if record is not None:
                budget -= len(record)
                out.append(record)
        self.counts["get_hits"] += len(out)
        return Reply(msg.request_id, encode_reply(msg.op, msg.request_id, Status.OK, flags, lengths), out)

    async def _put(self, keys: Sequence[ChunkKey], records: list[Buffer], allowed: list[bool]) -> list[bool]:
        valid = [ok and await self._verifies(k, r) for k, r, ok in zip(keys, records, allowed)]
        items = [(k, r) for k, r, ok in zip(keys, records, valid) if ok]
        stored = iter(await self.store.put(items) if items else [])
        result = [ok and next(stored) for ok in valid]
        self.counts["put_stored"] += sum(result)
        self.counts["put_refused"] += len(result) - sum(result)
        return result

    async def _verifies(self, key: ChunkKey, record: Buffer, *, counted: bool = True) -> bool:
        reason = record_matches(key, record)
        secret = self.options.secret
        if reason is None and (self.options.verify_puts or secret is not None):
            check = partial(verify_seal, secret=secret) if secret is not None else verify_record
            try:
                view = memoryview(record)
                if len(view) > _THREAD_BYTES:
                    await asyncio.to_thread(check, view, expect_key=key)
                else:
                    check(view, expect_key=key)
            except IntegrityError as exc:
                reason = exc.reason
        if reason is not None and counted:
            self.counts[f"put_invalid_{reason}"] += 1
        return reason is None


class PeerServer(Protocol):
    """A wire's server (:class:`ZmqPeerServer`, :class:`UcxPeerServer`)."""

    #: ``host:port`` actually bound, once started.
    address: str | None

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class ServerThread:
    """Runs a :class:`PeerServer` on an event loop of its own in a daemon thread.

    For embedding next to the blocking :class:`kvengine.KVEngine` (whose
    loop is private): ``address = ServerThread(server).start()`` ...
    ``stop()``. An :class:`EngineStore` may be used from this thread.
    """

    def __init__(self, server: PeerServer) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Start serving; returns the bound ``host:port``. Raises what the server's ``start`` raises."""
        self._thread = start_thread(self._loop.run_forever, "kvengine-peer-server")
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result()
        except BaseException:
            self._halt()
            raise
        assert self.server.address is not None
        return self.server.address

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result()
            self._halt()

    def _halt(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join()
        self._loop.close()
