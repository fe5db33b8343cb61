"""The chunk record: the one binary format every tier and transport stores.

Layout (all little-endian)::

    fixed header   magic "KVCR", version, flags, header length, namespace
                   digest, chunk hash, token range, codec id, tensor count,
                   raw (decoded) payload length, stored payload length,
                   payload checksum (xxh3-64)
    descriptors    per tensor: group, category, dtype, ndim, token dim (version
                   3; 255: none), byte length, dims
    padding        zero bytes (versions 2 and 3): a large payload starts at a
                   multiple of 4 KiB, so direct I/O can write and read it in place
    header check   xxh3-64 of everything above
    payload        the tensors' bytes in descriptor order, encoded by the codec

Readers accept version 1 (never padded), 2 and 3; versions 1 and 2 carry no
token dims (their descriptors read with ``token_dim`` None).

:func:`unpack_record` is the only parser. It checks, in order: length,
magic, version, header checksum, expected namespace/key, descriptor sanity,
payload length, payload checksum, and only then returns the payload.
Every failure raises :class:`IntegrityError` with a short machine-readable
``reason`` that callers count as a miss.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvengine.chunks.keys import ChunkHash, ChunkKey, NamespaceDigest
from kvengine.chunks.layout import ChunkLayout, KVCategory, dtype_code, is_known_dtype_code
from kvengine.errors import IntegrityError

MAGIC = b"KVCR"
FORMAT_VERSION = 3
READABLE_VERSIONS = frozenset({1, 2, 3})
MAX_DIMS = 8
#: Payloads of at least this many bytes start at a multiple of PAYLOAD_ALIGN into the record.
ALIGNED_PAYLOAD_MIN = 64 * 1024
PAYLOAD_ALIGN = 4096

_FIXED = struct.Struct("<4sHHI16s16sQQHHQQQ")
_TENSOR = struct.Struct("<HBBBB2xQ")
#: Descriptors of versions 1 and 2: the token dim byte was padding.
_TENSOR_V2 = struct.Struct("<HBBB3xQ")
#: The token dim byte of a tensor without one.
_NO_TOKEN_DIM = 255
_DIM = struct.Struct("<Q")
_CHECK = struct.Struct("<Q")


class RecordFlag(enum.IntFlag):
    NONE = 0
    #: Written under the explicit debug override of attach verification.
    UNVERIFIED = 1
    #: Followed by a MAC_BYTES keyed MAC over header and payload (records that cross a trust boundary).
    AUTHENTICATED = 2


#: Length of the trailer of an AUTHENTICATED record: HMAC-SHA256 over the header and the payload.
MAC_BYTES = 32


@dataclass(frozen=True, slots=True)
class TensorDescriptor:
    group: int
    category: KVCategory
    dtype_code: int
    shape: tuple[int, ...]
    nbytes: int
    #: The dimension that grows with the chunk's tokens (``TensorSpec.token_dim``); None for tensors
    #: without one, and for every tensor of a record written before format version 3.
    token_dim: int | None = None


@dataclass(frozen=True, slots=True)
class RecordHeader:
    key: ChunkKey
    token_start: int
    token_end: int
    codec_id: int
    tensors: tuple[TensorDescriptor, ...]
    raw_length: int
    payload_length: int
    payload_checksum: int
    flags: RecordFlag = RecordFlag.NONE
    header_length: int = 0

    @property
    def record_length(self) -> int:
        trailer = MAC_BYTES if self.flags & RecordFlag.AUTHENTICATED else 0
        return self.header_length + self.payload_length + trailer


def descriptors_for(layout: ChunkLayout, tokens: int) -> tuple[TensorDescriptor, ...]:
    return tuple(
        TensorDescriptor(spec.group, spec.category, dtype_code(spec.dtype), tuple(shape), size, spec.token_dim)
        for spec, shape, size in zip(layout.tensors, layout.shapes(tokens), layout.sizes(tokens))
    )


def encode_header(
    key: ChunkKey,
    token_range: tuple[int, int],
    tensors: Sequence[TensorDescriptor],
    *,
    codec_id: int,
    raw_length: int,
    payload: bytes | memoryview,
    flags: RecordFlag = RecordFlag.NONE,
) -> bytes:
    """Header bytes for ``payload`` (already encoded by ``codec_id``)."""
    body = bytearray()
    for t in tensors:
        if len(t.shape) > MAX_DIMS:
            raise IntegrityError("too_many_dims", f"{len(t.shape)} > {MAX_DIMS}")
        if t.token_dim is not None and not 0 <= t.token_dim < len(t.shape):
            raise IntegrityError("bad_descriptor", f"token_dim {t.token_dim} outside shape {t.shape}")
        token_dim = _NO_TOKEN_DIM if t.token_dim is None else t.token_dim
        body += _TENSOR.pack(t.group, int(t.category), t.dtype_code, len(t.shape), token_dim, t.nbytes)
        for d in t.shape:
            body += _DIM.pack(d)
    header_length = _FIXED.size + len(body) + _CHECK.size
    if len(payload) >= ALIGNED_PAYLOAD_MIN:
        padded = -(-header_length // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        body += bytes(padded - header_length)
        header_length = padded
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, int(flags), header_length, key.namespace, key.chunk_hash,
        token_range[0], token_range[1], codec_id, len(tensors), raw_length, len(payload),
        xxhash.xxh3_64_intdigest(payload),
    )
    head = fixed + bytes(body)
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def peek_header_length(buf: bytes | memoryview) -> int:
    """Header length announced by the fixed part (for readers that read twice)."""
    if len(buf) < _FIXED.size:
        raise IntegrityError("truncated_header", f"{len(buf)} < {_FIXED.size} bytes")
    magic, version, _, header_length = struct.unpack_from("<4sHHI", buf)
    if magic != MAGIC:
        raise IntegrityError("bad_magic", repr(bytes(magic)))
    if version not in READABLE_VERSIONS:
        raise IntegrityError("other_version", f"version {version}, reader {FORMAT_VERSION}")
    return header_length


def sealed_by_another_version(buf: bytes | memoryview) -> bool:
    """Whether a record this reader cannot read was written whole by another format version (its
    header checksum verifies) rather than damaged in its version field (it does not).

    Records of other versions are left for the writers that can read them; damaged ones are corrupt.
    """
    if len(buf) < 12:
        return False
    magic, version, _, header_length = struct.unpack_from("<4sHHI", buf)
    if magic != MAGIC or version in READABLE_VERSIONS or not 12 + _CHECK.size <= header_length <= len(buf):
        return False
    (stored,) = _CHECK.unpack_from(buf, header_length - _CHECK.size)
    return xxhash.xxh3_64_intdigest(memoryview(buf)[: header_length - _CHECK.size]) == stored


def _checked_header(buf: bytes | memoryview) -> memoryview:
    """The header at the start of ``buf``, whole and matching its checksum (not parsed further)."""
    header_length = peek_header_length(buf)
    if header_length < _FIXED.size + _CHECK.size or len(buf) < header_length:
        raise IntegrityError("truncated_header", f"header {header_length} bytes, have {len(buf)}")
    view = memoryview(buf)[:header_length]
    (stored_check,) = _CHECK.unpack_from(view, header_length - _CHECK.size)
    if xxhash.xxh3_64_intdigest(view[: header_length - _CHECK.size]) != stored_check:
        raise IntegrityError("header_checksum", "header bytes do not match their checksum")
    return view


@dataclass(frozen=True, slots=True)
class RecordIdentity:
    """What a record's checked header says it is and holds, its descriptors left unparsed
    (:func:`peek_identity`)."""

    key: ChunkKey
    header_length: int
    payload_length: int
    payload_checksum: int
    authenticated: bool

    @property
    def record_length(self) -> int:
        return self.header_length + self.payload_length + (MAC_BYTES if self.authenticated else 0)


def peek_identity(buf: bytes | memoryview) -> RecordIdentity:
    """The key and lengths the header at the start of ``buf`` names, its checksum verified; the descriptor
    table is left unparsed (:func:`decode_header` checks it), so this costs one hash of the header whatever
    the record's tensor count. For stores and wires that pass records on (:func:`verify_record`)."""
    view = _checked_header(buf)
    (_, _, flags, _, ns, chunk_hash, _, _, _, _, _, payload_length, checksum) = _FIXED.unpack_from(view)
    return RecordIdentity(ChunkKey(NamespaceDigest(bytes(ns)), ChunkHash(bytes(chunk_hash))), len(view),
                          payload_length, checksum, bool(flags & RecordFlag.AUTHENTICATED))


def verify_record(buf: bytes | memoryview, *, expect_key: ChunkKey) -> None:
    """Check that ``buf`` is a whole, intact record of ``expect_key`` (the checks of :func:`unpack_record`
    but the descriptor table's, which its reader parses: :class:`IntegrityError` with the same reasons)."""
    named = peek_identity(buf)
    if named.key.namespace != expect_key.namespace:
        raise IntegrityError("other_namespace", "record belongs to another namespace")
    _checked_payload(buf, named, expect_key)


def decode_header(buf: bytes | memoryview, *, expect_namespace: NamespaceDigest | None = None) -> RecordHeader:
    """Parse and verify the header at the start of ``buf`` (payload not checked)."""
    view = _checked_header(buf)
    header_length = len(view)
    (_, version, flags, _, ns, chunk_hash, start, end, codec_id, n_tensors, raw_length, payload_length,
     payload_checksum) = _FIXED.unpack_from(view)
    if expect_namespace is not None and ns != expect_namespace:
        raise IntegrityError("other_namespace", "record belongs to another namespace")
    tensors = []
    offset = _FIXED.size
    for _ in range(n_tensors):
        if offset + _TENSOR.size > header_length - _CHECK.size:
            raise IntegrityError("bad_descriptor", "descriptor table overruns header")
        if version >= 3:
            group, category, dcode, ndim, token_dim, nbytes = _TENSOR.unpack_from(view, offset)
        else:
            group, category, dcode, ndim, nbytes = _TENSOR_V2.unpack_from(view, offset)
            token_dim = _NO_TOKEN_DIM
        offset += _TENSOR.size
        if ndim > MAX_DIMS or not is_known_dtype_code(dcode) or category not in KVCategory._value2member_map_:
            raise IntegrityError("bad_descriptor", f"ndim={ndim} dtype={dcode} category={category}")
        if token_dim != _NO_TOKEN_DIM and token_dim >= ndim:
            raise IntegrityError("bad_descriptor", f"token_dim={token_dim} ndim={ndim}")
        shape = tuple(_DIM.unpack_from(view, offset + 8 * i)[0] for i in range(ndim))
        offset += 8 * ndim
        tensors.append(TensorDescriptor(group, KVCategory(category), dcode, shape, nbytes,
                                        None if token_dim == _NO_TOKEN_DIM else token_dim))
    padding = view[offset : header_length - _CHECK.size]  # zero bytes up to the check (versions 2, 3)
    if (offset > header_length - _CHECK.size or (version == 1 and padding.nbytes)
            or padding.nbytes >= PAYLOAD_ALIGN or padding.tobytes().strip(b"\0")):
        raise IntegrityError("bad_descriptor", "descriptor table length mismatch")
    if sum(t.nbytes for t in tensors) != raw_length or end < start:
        raise IntegrityError("bad_descriptor", "tensor sizes do not add up to the payload")
    return RecordHeader(
        key=ChunkKey(NamespaceDigest(bytes(ns)), ChunkHash(bytes(chunk_hash))),
        token_start=start, token_end=end, codec_id=codec_id, tensors=tuple(tensors),
        raw_length=raw_length, payload_length=payload_length, payload_checksum=payload_checksum,
        flags=RecordFlag(flags), header_length=header_length,
    )


def verify_payload(header: RecordHeader | RecordIdentity, payload: bytes | memoryview) -> None:
    if len(payload) != header.payload_length:
        raise IntegrityError("truncated_payload", f"{len(payload)} of {header.payload_length} bytes")
    if xxhash.xxh3_64_intdigest(payload) != header.payload_checksum:
        raise IntegrityError("payload_checksum", "payload bytes do not match their checksum")


def unpack_record(
    buf: bytes | memoryview, *, expect_key: ChunkKey | None = None
) -> tuple[RecordHeader, memoryview]:
    """Verify a whole record and return its header and (still encoded) payload."""
    header = decode_header(buf, expect_namespace=expect_key.namespace if expect_key else None)
    return header, _checked_payload(buf, header, expect_key)


def _checked_payload(buf: bytes | memoryview, header: RecordHeader | RecordIdentity,
                     expect_key: ChunkKey | None) -> memoryview:
    """The payload of ``buf``, a whole record whose checked header says ``header``: of ``expect_key`` (if
    given), exactly its length, its payload matching its checksum."""
    if expect_key is not None and header.key != expect_key:
        raise IntegrityError("other_key", "record holds a different chunk")
    if len(buf) != header.record_length:
        raise IntegrityError("truncated_payload" if len(buf) < header.record_length else "trailing_bytes",
                             f"record {len(buf)} bytes, header says {header.record_length}")
    payload = memoryview(buf)[header.header_length : header.header_length + header.payload_length]
    verify_payload(header, payload)
    return payload


def _mac(secret: bytes, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    mac.update(header)
    mac.update(payload)
    return mac.digest()


def seal_record(buf: bytes | memoryview, secret: bytes) -> bytes:
    """``buf`` (a verified record) as an AUTHENTICATED one: flagged header, then payload, then the MAC.

    The MAC covers every byte of header and payload (a payload checksum alone is not a commitment:
    xxh3 is fast, not collision resistant), so a holder of ``secret`` vouches for the whole record.
    """
    header, payload = unpack_record(buf)
    head = encode_header(header.key, (header.token_start, header.token_end), header.tensors,
                         codec_id=header.codec_id, raw_length=header.raw_length, payload=payload,
                         flags=header.flags | RecordFlag.AUTHENTICATED)
    return b"".join((head, payload, _mac(secret, head, payload)))


def verify_seal(buf: bytes | memoryview, secret: bytes, *, expect_key: ChunkKey | None = None) -> RecordHeader:
    """Verify a record and its MAC; :class:`IntegrityError` (``unauthenticated``, ``bad_mac``, or any
    structural reason) if it was not sealed with ``secret``."""
    header, payload = unpack_record(buf, expect_key=expect_key)
    if not header.flags & RecordFlag.AUTHENTICATED:
        raise IntegrityError("unauthenticated", "record carries no MAC")
    view = memoryview(buf)
    trailer = view[header.header_length + header.payload_length :]
    if not hmac.compare_digest(_mac(secret, view[: header.header_length], payload), bytes(trailer)):
        raise IntegrityError("bad_mac", "record MAC does not verify (another writer, or tampered with)")
    return header
