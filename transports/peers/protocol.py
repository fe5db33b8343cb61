"""The peer wire format, shared by every peer transport (ZeroMQ, UCX).

The header is common to all wires. How records travel is the wire's: UCX
sends each record whole (see :mod:`.ucx`); ZeroMQ, whose throughput
drops with very large frames, uses frames. There, a request is one message:
a header followed by its payload frames; a reply is a header message
followed, when its payload exceeds one frame, by data messages, one per
payload frame (a smaller payload rides inline, after the header, as in a
request)::

    header   magic "KVPP", version, op, status, request id, item count
             request items: namespace (16 B), chunk hash (16 B), record length (u64; PUT only, else 0)
             reply items:   flag (u8: present / true), record length (u64; GET only, else 0)
    payload  the records (PUT requests, GET replies) in item order, each split
             into frames of at most ``frame_bytes``; a record always starts a
             new frame
    data     (streamed replies) a tag -- magic "KVPD", request id (u64),
             offset of the frame in the reply's payload (u64) -- and one
             frame; sent in order

Streaming replies lets a client copy frame *k* into place while frame
*k + 1* is still on the wire (:class:`RecordAssembler`), instead of joining a
32 MiB record after the fact on its event loop.

Requests: ``PING``, ``EXISTS``, ``GET``, ``PUT``, ``DELETE``, each batched.
A reply carries the request's op and id and one item per request item, or
no items and a non-OK :class:`Status` when the request was refused whole.

Decoding never trusts the sender: :func:`decode_header`,
:func:`gather_records` and :class:`RecordAssembler` check magic, version,
op, counts, every length against :class:`Limits` and against the bytes that
actually arrive (in order, no gaps, no overlap), and raise
:class:`ProtocolError` (carrying the :class:`Status` to answer with).
:func:`record_matches` is the cheap check a server runs before serving or
storing a record: its header is intact and names exactly the key asked for
(one hash of the header; clients check whole records, payload included).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvengine.buffers import BufferPool
from kvengine.chunks.keys import ChunkHash, ChunkKey, NamespaceDigest
from kvengine.chunks.record import peek_identity
from kvengine.errors import IntegrityError, IntegrityReason, TransportError
from kvengine.transport import Buffer

MAGIC = b"KVPP"
VERSION = 1

_HEAD = struct.Struct("<4sBBBxQI")
_REQ_ITEM = struct.Struct("<16s16sQ")
_REP_ITEM = struct.Struct("<BQ")
_TAG = struct.Struct("<4sQQ")
#: The pool the peer wires receive records into (one per process, like an allocator): up to 256 MiB of idle
#: buffers are kept warm, each reused once nothing refers to the record read into it.
RECEIVE_BUFFERS = BufferPool(256 << 20)
TAG_MAGIC = b"KVPD"


class Op(enum.IntEnum):
    PING = 0
    EXISTS = 1
    GET = 2
    PUT = 3
    DELETE = 4


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1  # malformed, truncated or inconsistent message
    TOO_LARGE = 2  # a record or the message exceeds the receiver's limits
    UNSUPPORTED = 3  # unknown version or op
    BUSY = 4  # the client has as many requests in flight as the server serves it at once


class ProtocolError(TransportError):
    """A message that cannot be decoded; ``status`` is what to answer with."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(f"{status.name}: {reason}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What a receiver accepts; anything larger is refused, never buffered."""

    max_items: int = 4096
    max_record_bytes: int = 1 << 30
    max_message_bytes: int = 1 << 31
    #: Size records are split into on the wire (~1 MiB keeps ZeroMQ at raw-TCP speed).
    frame_bytes: int = 1 << 20
    #: Largest frame accepted; a bigger one cuts the sender off (ZeroMQ ``MAXMSGSIZE``).
    max_frame_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if min(self.max_items, self.max_record_bytes, self.max_message_bytes, self.frame_bytes) < 1:
            raise ValueError("peer protocol limits must be positive")
        if not self.frame_bytes <= self.max_frame_bytes or self.max_header_bytes > self.max_frame_bytes:
            raise ValueError("frame_bytes and the largest header must not exceed max_frame_bytes")

    @property
    def max_header_bytes(self) -> int:
        return _HEAD.size + self.max_items * max(_REQ_ITEM.size, _REP_ITEM.size)


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded header. Requests fill ``keys``; replies fill ``flags``."""

    op: Op
    request_id: int
    status: Status
    keys: tuple[ChunkKey, ...] = ()
    flags: tuple[bool, ...] = ()
    lengths: tuple[int, ...] = ()

    @property
    def payload_bytes(self) -> int:
        return sum(self.lengths)


def encode_request(op: Op, request_id: int, keys: Sequence[ChunkKey], lengths: Sequence[int] = ()) -> bytes:
    lengths = lengths or (0,) * len(keys)
    assert len(lengths) == len(keys), "one length per key"
    parts = [_HEAD.pack(MAGIC, VERSION, op, Status.OK, request_id, len(keys))]
    parts += [_REQ_ITEM.pack(k.namespace, k.chunk_hash, n) for k, n in zip(keys, lengths)]
    return b"".join(parts)


def encode_reply(
    op: Op, request_id: int, status: Status = Status.OK, flags: Sequence[bool] = (), lengths: Sequence[int] = ()
) -> bytes:
    lengths = lengths or (0,) * len(flags)
    assert len(lengths) == len(flags), "one length per flag"
    parts = [_HEAD.pack(MAGIC, VERSION, op, status, request_id, len(flags))]
    parts += [_REP_ITEM.pack(bool(f), n) for f, n in zip(flags, lengths)]
    return b"".join(parts)


def peek_request_id(header: Buffer) -> int | None:
    """The request id of a header too broken to decode, if it has one (to address an error reply)."""
    if len(header) < _HEAD.size:
        return None
    magic, *_, request_id, _ = _HEAD.unpack_from(header)
    return request_id if magic == MAGIC else None


def decode_header(header: Buffer, limits: Limits, *, reply: bool) -> Message:
    """Parse and check a request (``reply=False``) or reply header."""
    if len(header) < _HEAD.size:
        raise ProtocolError(Status.BAD_REQUEST, f"header of {len(header)} bytes")
    magic, version, op, status, request_id, count = _HEAD.unpack_from(header)
    if magic != MAGIC:
        raise ProtocolError(Status.BAD_REQUEST, "bad magic")
    if version != VERSION:
        raise ProtocolError(Status.UNSUPPORTED, f"version {version}, speaking {VERSION}")
    if op not in Op._value2member_map_ or status not in Status._value2member_map_:
        raise ProtocolError(Status.UNSUPPORTED, f"op {op} status {status}")
    if count > limits.max_items:
        raise ProtocolError(Status.TOO_LARGE, f"{count} items > {limits.max_items}")
    item = _REP_ITEM if reply else _REQ_ITEM
    if len(header) != _HEAD.size + count * item.size:
        raise ProtocolError(Status.BAD_REQUEST, f"header of {len(header)} bytes for {count} items")
    items = list(item.iter_unpack(memoryview(header)[_HEAD.size:]))
    if reply:
        flags = tuple(bool(f) for f, _ in items)
        lengths = tuple(n for _, n in items)
        if Op(op) is not Op.GET and any(lengths):
            raise ProtocolError(Status.BAD_REQUEST, "lengths in a reply that carries no records")
        keys: tuple[ChunkKey, ...] = ()
    else:
        keys = tuple(ChunkKey(NamespaceDigest(ns), ChunkHash(h)) for ns, h, _ in items)
        lengths = tuple(n for _, _, n in items)
        flags = ()
        if Op(op) is not Op.PUT and any(lengths):
            raise ProtocolError(Status.BAD_REQUEST, "lengths in a request that carries no records")
    if any(n > limits.max_record_bytes for n in lengths):
        raise ProtocolError(Status.TOO_LARGE, f"a record exceeds {limits.max_record_bytes} bytes")
    if sum(lengths) > limits.max_message_bytes:
        raise ProtocolError(Status.TOO_LARGE, f"payload exceeds {limits.max_message_bytes} bytes")
    return Message(Op(op), request_id, Status(status), keys, flags, lengths)


def split_frames(records: Sequence[Buffer], frame_bytes: int) -> list[memoryview]:
    """Zero-copy frames of at most ``frame_bytes`` for ``records`` (each starts a new frame)."""
    frames: list[memoryview] = []
    for record in records:
        view = memoryview(record).cast("B")
        frames += [view[i : i + frame_bytes] for i in range(0, len(view), frame_bytes)]
    return frames


def gather_records(frames: Sequence[Buffer], lengths: Sequence[int]) -> list[Buffer]:
    """Reassemble records of ``lengths`` (0 = no record) from ``frames``; exact fit or ProtocolError."""
    assembler = RecordAssembler(lengths)
    for frame in frames:
        assembler.feed(assembler.received, frame)
    if not assembler.done:
        raise ProtocolError(Status.BAD_REQUEST, "truncated: fewer payload bytes than announced")
    return assembler.records()


def record_matches(key: ChunkKey, record: Buffer) -> IntegrityReason | None:
    """None if ``record`` has an intact header naming ``key`` and the right length, else the reason."""
    try:
        named = peek_identity(memoryview(record))
    except IntegrityError as exc:
        return exc.reason
    if named.key.namespace != key.namespace:
        return "other_namespace"
    if named.key != key:
        return "other_key"
    if named.record_length != len(record):
        return "wrong_length"
    return None


def encode_tag(request_id: int, offset: int) -> bytes:
    """The tag of a reply's data message carrying the frame at ``offset`` of its payload."""
    return _TAG.pack(TAG_MAGIC, request_id, offset)


def tagged(request_id: int, frames: Sequence[Buffer]) -> Iterator[tuple[bytes, Buffer]]:
    """``(tag, frame)`` for each data message of a reply."""
    offset = 0
    for frame in frames:
        yield encode_tag(request_id, offset), frame
        offset += len(frame)


def decode_tag(tag: Buffer) -> tuple[int, int]:
    """``(request id, offset)`` of a data message's tag."""
    if len(tag) != _TAG.size:
        raise ProtocolError(Status.BAD_REQUEST, f"data tag of {len(tag)} bytes")
    magic, request_id, offset = _TAG.unpack(tag)
    if magic != TAG_MAGIC:
        raise ProtocolError(Status.BAD_REQUEST, "bad data tag magic")
    return request_id, offset


class RecordAssembler:
    """Rebuilds records from their frames, which must arrive in order.

    A record that comes as one frame is that frame (no copy); a longer one
    gets one buffer of its announced length (taken from
    :data:`RECEIVE_BUFFERS` when its first frame arrives; every byte is
    written before the record is handed out). Records are handed out as
    read-only views. A
    frame that is out of order, crosses a record boundary, or overruns the
    payload raises :class:`ProtocolError`.
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)
        self.total = sum(self.lengths)
        self.received = 0
        self._records: list[Buffer] = [b""] * len(self.lengths)
        self._index = 0  # record being filled
        self._filled = 0  # bytes of it received
        self._buf: memoryview | None = None
        self._skip_empty()

    @property
    def done(self) -> bool:
        return self.received == self.total

    def feed(self, offset: int, frame: Buffer) -> bool:
        """Place one frame; True once every byte of the payload has arrived."""
        n = len(frame)
        if offset != self.received or n == 0:
            raise ProtocolError(Status.BAD_REQUEST, f"frame at {offset}, expected {self.received}")
        if self._index == len(self.lengths) or self._filled + n > self.lengths[self._index]:
            raise ProtocolError(Status.BAD_REQUEST, "frame crosses a record boundary or overruns the payload")
        if self._buf is None:
            if n == self.lengths[self._index]:  # the whole record in one frame: keep it, no copy
                self._records[self._index] = memoryview(frame).toreadonly()
            else:
                self._buf = RECEIVE_BUFFERS.take(self.lengths[self._index])
        if self._buf is not None:
            self._buf[self._filled : self._filled + n] = frame
        self._filled += n
        self.received += n
        if self._filled == self.lengths[self._index]:
            if self._buf is not None:
                self._records[self._index] = self._buf.toreadonly()
            self._index += 1
            self._filled = 0
            self._buf = None
            self._skip_empty()
        return self.done

    def records(self) -> list[Buffer]:
        """One buffer per announced length (``b""`` for 0); only once :attr:`done`."""
        assert self.done, "records() before the payload is complete"
        return self._records

    def _skip_empty(self) -> None:
        while self._index < len(self.lengths) and self.lengths[self._index] == 0:
            self._index += 1
