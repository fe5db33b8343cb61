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

import enum
import json
import socket
import struct
from collections.abc import Sequence
from typing import Any

import torch

from kvengine.chunks.keys import DIGEST_BYTES, ChunkHash, ChunkKey, NamespaceDigest
from kvengine.chunks.layout import ChunkLayout, KVCategory, TensorSpec, dtype_code, dtype_from_code, is_known_dtype_code

VERSION = 1
#: No control frame is larger (a lookup of 32k chunks is 1 MiB).
MAX_FRAME = 4 * 2**20
KEY_BYTES = 2 * DIGEST_BYTES
#: A resident chunk, as :attr:`Op.PIN_PREFIX` answers it: offset, first token, token count, layout.
PINNED = struct.Struct(f"<QII{DIGEST_BYTES}s")
#: The arena, as :attr:`Op.HELLO` answers it: its bytes, and whether clients map it in whole when they attach
#: (``kvengine host --prefault``) rather than page by page at their first copies.
ARENA = struct.Struct("<QB")
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


#: Requests not answered: nothing the client does next waits on them, and the next request on the connection
#: sees their effect (one connection's requests are served in order). Each saves a round trip per chunk.
ONE_WAY = frozenset({Op.UNPIN, Op.COMMIT, Op.ABORT})


class Status(enum.IntEnum):
    OK = 0
    PRESENT = 1
    NO_ROOM = 2
    REFUSED = 3  # utf-8 reason: the request cannot be served (an unknown layout, one that never fits)
    FORBIDDEN = 4  # utf-8 reason: this caller may not use the service


PREPARE = struct.Struct(f"<{KEY_BYTES}s{DIGEST_BYTES}sII")
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
