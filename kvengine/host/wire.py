"""The host service's control protocol: length-prefixed binary frames over a Unix socket.

A request is ``u32 length | u8 op | payload``, its answer ``u32 length | u8
status | payload``: one answer per request but the :data:`ONE_WAY` ones, in
order. Chunk bytes never cross the socket: they are in the shared arena
(:mod:`kvengine.host.arena`), whose descriptor travels once, beside the answer
to :attr:`Op.HELLO`.

Every frame is parsed strictly: a length above :data:`MAX_FRAME`, an unknown op
or a short payload is a :class:`WireError`, and the service drops the
connection that sent it (releasing everything the connection held).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import socket
import struct
from collections.abc import Sequence
from typing import Any

import torch

from kvengine.chunks.keys import DIGEST_BYTES, ChunkHash, ChunkKey, Namespace, NamespaceDigest
from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec, dtype_code, dtype_from_code, is_known_dtype_code
from kvengine.events import MEDIUM_MEMORY, BlockStored

VERSION = 2
#: No control frame is larger (a lookup of 32k chunks is 1 MiB).
MAX_FRAME = 4 * 2**20
KEY_BYTES = 2 * DIGEST_BYTES
#: A resident chunk, as :attr:`Op.PIN_PREFIX` answers it: offset, first token, token count, layout.
PINNED = struct.Struct(f"<QII{DIGEST_BYTES}s")
#: The arena, as :attr:`Op.HELLO` answers it: its bytes, whether clients map it in whole when they attach
#: (``kvengine host --prefault``) rather than page by page at their first copies, and the service's
#: :class:`Features`.
ARENA = struct.Struct("<QBB")
#: What :attr:`Op.STATS` answers of the client's pool: chunks, used and capacity bytes, this connection's
#: pins, every connection's pins.
STATS = struct.Struct("<QQQQQ")
_HEADER = struct.Struct("<IB")
_U32 = struct.Struct("<I")


class WireError(Exception):
    """A malformed frame, or a peer that went away mid-frame."""


class Op(enum.IntEnum):
    HELLO = 1  # u16 version, utf-8 tenant -> ARENA, with the arena's descriptor
    LAYOUT = 2  # layout JSON -> ok (the layout may be named by its fingerprint from now on)
    PIN_PREFIX = 3  # keys -> the resident prefix's PINNED records
    UNPIN = 4  # keys (one per pin)
    PREPARE = 5  # key, fingerprint, u32 start, u32 end -> u64 offset | PRESENT | NO_ROOM
    COMMIT = 6  # key, u8 keep_pin
    ABORT = 7  # key, u8 (unused): COMMIT's frame
    DISCARD = 8  # key -> u8 discarded
    CONTAINS = 9  # key -> u8 resident
    STATS = 10  # -> STATS
    BIND = 11  # BIND, namespace JSON -> ok | REFUSED (a lower tier's reads are verified against it)
    PROMOTE = 12  # PROMOTE, keys -> PROMOTED: the chunks the lower tiers brought into the arena, unpinned
    PROMOTE_EACH = 13  # digest, keys (keyed chunks) -> one byte per key: resident now (unpinned)
    ANNOUNCE = 14  # u32 count, then per chunk STORED_EVENT, tokens, lora name: publish its BlockStored


class Features(enum.IntFlag):
    """What a service does beyond its arena (``kvengine host --config``)."""

    #: Tiers below the arena: a lookup short in memory asks the service to promote the rest.
    LOWER_TIERS = 1
    #: KV events of the arena: clients send each stored chunk's BlockStored (its tokens) for it to publish.
    EVENTS = 2


#: Requests not answered: nothing the client does next waits on them, and the next request on the connection
#: sees their effect (one connection's requests are served in order). Each saves a round trip per chunk.
ONE_WAY = frozenset({Op.UNPIN, Op.COMMIT, Op.ABORT, Op.ANNOUNCE})


class Status(enum.IntEnum):
    OK = 0
    PRESENT = 1
    NO_ROOM = 2
    REFUSED = 3  # utf-8 reason: the request cannot be served (an unknown layout, one that never fits)
    FORBIDDEN = 4  # utf-8 reason: this caller may not use the service


PREPARE = struct.Struct(f"<{KEY_BYTES}s{DIGEST_BYTES}sII")
#: A binding: its digest (the keys' namespace) and its layout's fingerprint; the namespace follows as JSON.
BIND = struct.Struct(f"<{DIGEST_BYTES}s{DIGEST_BYTES}s")
#: Promote: the binding's digest, the first key's chunk number and the request's token count; keys follow.
PROMOTE = struct.Struct(f"<{DIGEST_BYTES}sII")
#: What a promotion brought into the arena: chunks (a prefix of those asked) and record bytes read.
PROMOTED = struct.Struct("<IQ")
DIGEST = struct.Struct(f"<{DIGEST_BYTES}s")
#: A stored chunk's event: its key, whether it has a parent, the parent's hash, block size, token bytes
#: (uint32 LE ids) and adapter name bytes that follow.
STORED_EVENT = struct.Struct(f"<{KEY_BYTES}sB{DIGEST_BYTES}sIIH")
COMMIT = struct.Struct(f"<{KEY_BYTES}sB")
KEY = struct.Struct(f"<{KEY_BYTES}s")
OFFSET = struct.Struct("<Q")
VERSION_FRAME = struct.Struct("<H")


def send_frame(sock: socket.socket, code: int, payload: bytes = b"", fds: Sequence[int] = ()) -> None:
    frame = _HEADER.pack(len(payload) + 1, code) + payload
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)


class FrameReader:
    """Frames from one socket, read in as few system calls as they arrive in (a release and the lookup
    after it are often one read)."""

    #: Bytes asked of the socket per read.
    CHUNK = 64 * 2**10

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def read(self, *, max_fds: int = 0) -> tuple[int, bytes, list[int]]:
        """The next frame: its op or status, payload and any descriptors that came with it.

        :raises WireError: the peer closed the connection, or sent a frame too large or empty.
        """
        buf, fds = self._buf, list[int]()
        while True:
            if len(buf) >= _HEADER.size:
                length, code = _HEADER.unpack_from(buf)
                if not 1 <= length <= MAX_FRAME:
                    raise WireError(f"frame length {length} outside 1..{MAX_FRAME}")
                end = _U32.size + length
                if len(buf) >= end:
                    payload = bytes(buf[_HEADER.size : end])
                    del buf[:end]
                    return code, payload, fds
            if max_fds:
                data, more, _flags, _addr = socket.recv_fds(self._sock, self.CHUNK, max_fds)
                fds += more
            else:
                data = self._sock.recv(self.CHUNK)
            if not data:
                raise WireError("connection closed" if not buf else "connection closed mid-frame")
            buf += data


def pack_keys(keys: Sequence[ChunkKey]) -> bytes:
    return _U32.pack(len(keys)) + b"".join(k.namespace + k.chunk_hash for k in keys)


def unpack_keys(payload: bytes) -> list[ChunkKey]:
    if len(payload) < _U32.size:
        raise WireError(f"a key list of {len(payload)} B")
    (n,) = _U32.unpack_from(payload)
    if len(payload) != _U32.size + n * KEY_BYTES:
        raise WireError(f"{n} keys need {_U32.size + n * KEY_BYTES} B, the frame has {len(payload)} B")
    return [key_from(payload[i : i + KEY_BYTES]) for i in range(_U32.size, len(payload), KEY_BYTES)]


def key_from(raw: bytes) -> ChunkKey:
    return ChunkKey(NamespaceDigest(raw[:DIGEST_BYTES]), ChunkHash(raw[DIGEST_BYTES:KEY_BYTES]))


def key_bytes(key: ChunkKey) -> bytes:
    return key.namespace + key.chunk_hash


def fingerprint_bytes(layout: ChunkLayout) -> bytes:
    return bytes.fromhex(layout.fingerprint)


def unpack(fmt: struct.Struct, payload: bytes) -> tuple[Any, ...]:
    """``fmt`` unpacked from exactly ``payload``; a short or long one is a :class:`WireError`."""
    if len(payload) != fmt.size:
        raise WireError(f"payload of {len(payload)} B, expected {fmt.size} B")
    return fmt.unpack(payload)


def unpack_head(fmt: struct.Struct, payload: bytes) -> tuple[tuple[Any, ...], bytes]:
    """``fmt`` unpacked from the start of ``payload``, and the rest; a short one is a :class:`WireError`."""
    if len(payload) < fmt.size:
        raise WireError(f"payload of {len(payload)} B, expected at least {fmt.size} B")
    return fmt.unpack_from(payload), payload[fmt.size :]


def layout_json(layout: ChunkLayout) -> bytes:
    specs = [[t.name, t.group, int(t.category), dtype_code(t.dtype), list(t.shape), t.token_dim]
             for t in layout.tensors]
    return json.dumps([layout.chunk_size, specs], separators=(",", ":")).encode()


def layout_from_json(raw: bytes) -> ChunkLayout:
    """The layout ``raw`` describes; anything but a well-formed one is a :class:`WireError`."""
    try:
        chunk_size, specs = json.loads(raw)
        tensors = []
        for name, group, category, code, shape, token_dim in specs:
            if not isinstance(code, int) or not is_known_dtype_code(code):
                raise ValueError(f"unknown dtype code {code!r}")
            dtype: torch.dtype = dtype_from_code(code)
            tensors.append(TensorSpec(name=str(name), group=int(group), category=KVCategory(category),
                                      dtype=dtype, shape=tuple(int(d) for d in shape),
                                      token_dim=None if token_dim is None else int(token_dim)))
        return ChunkLayout(int(chunk_size), tuple(tensors))
    except Exception as exc:  # any malformed description: JSON, arity, types, or the layout's own checks
        raise WireError(f"not a chunk layout: {type(exc).__name__}: {exc}") from None


def namespace_json(namespace: Namespace) -> bytes:
    return json.dumps(dataclasses.asdict(namespace), separators=(",", ":")).encode()


def namespace_from_json(raw: bytes) -> Namespace:
    """The namespace ``raw`` describes; anything but a well-formed one is a :class:`WireError`."""
    try:
        fields = json.loads(raw)
        if not isinstance(fields, dict):
            raise ValueError("not an object")
        fields["extra_keys"] = tuple(fields.get("extra_keys", ()))
        return Namespace(**fields)
    except Exception as exc:  # malformed JSON, unknown or missing fields, the namespace's own checks
        raise WireError(f"not a namespace: {type(exc).__name__}: {exc}") from None


def pack_stored(stored: Sequence[tuple[ChunkKey, BlockStored]]) -> bytes:
    """Chunks' BlockStored events, each of one chunk (hashes are its key's; the medium is the service's)."""
    parts = [_U32.pack(len(stored))]
    for key, event in stored:
        parent = event.parent_block_hash
        lora = (event.lora_name or "").encode()
        parts += [STORED_EVENT.pack(key_bytes(key), parent is not None, bytes(parent or b""), event.block_size,
                                    len(event.tokens), len(lora)), event.tokens, lora]
    return b"".join(parts)


def unpack_stored(payload: bytes) -> list[tuple[ChunkKey, BlockStored]]:
    """:func:`pack_stored`'s events, with the memory tier's medium; a malformed frame is a :class:`WireError`."""
    (count,), rest = unpack_head(_U32, payload)
    view, out = memoryview(rest), []
    for _ in range(count):
        (raw, has_parent, parent, block_size, n_tokens, n_lora), _ = unpack_head(STORED_EVENT, bytes(view[: STORED_EVENT.size]))
        end = STORED_EVENT.size + n_tokens + n_lora
        if len(view) < end or n_tokens % 4 or n_tokens > 4 * block_size:
            raise WireError(f"a stored chunk's event of {len(view)} B announces {n_tokens} token bytes")
        tokens = bytes(view[STORED_EVENT.size : STORED_EVENT.size + n_tokens])
        lora = bytes(view[STORED_EVENT.size + n_tokens : end]).decode(errors="replace") or None
        key = key_from(raw)
        out.append((key, BlockStored((key.chunk_hash,), parent if has_parent else None, tokens, block_size,
                                     MEDIUM_MEMORY, lora)))
        view = view[end:]
    if len(view):
        raise WireError(f"{len(view)} B after {count} stored chunks' events")
    return out
