"""The 12-byte frame every codec of this package puts around its body.

Layout (little-endian)::

    codec id (u16) | frame version (u16) | xxh3-64 of the body (u64) | body

The checksum makes each codec self-verifying: a flipped bit in a stored body
is reported before any decoder runs, so a decoder that cannot detect
corruption by itself (LZ4 and zstd literals, quantized values) never turns
bad bytes into plausible tensors. Inside a record the payload checksum
already covers the same bytes; the frame keeps codecs safe when used alone.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import xxhash

from kvengine.errors import IntegrityError, InvalidRequestError

FRAME_VERSION = 1
_HEAD = struct.Struct("<HHQ")
HEADER_BYTES = _HEAD.size


def seal(codec_id: int, parts: Iterable[bytes | memoryview]) -> bytes:
    """Frame the concatenation of ``parts`` (one copy of the body)."""
    parts = list(parts)
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return b"".join([_HEAD.pack(codec_id, FRAME_VERSION, digest.intdigest()), *parts])


def open_frame(codec_id: int, stored: bytes | memoryview) -> memoryview:
    """The verified body of ``stored``.

    :raises IntegrityError: ``codec_truncated``, ``codec_mismatch``,
        ``codec_version`` or ``codec_checksum``.
    """
    view = memoryview(stored).cast("B")
    if len(view) < HEADER_BYTES:
        raise IntegrityError("codec_truncated", f"{len(view)} B is shorter than the codec frame header")
    found_id, version, checksum = _HEAD.unpack_from(view)
    if found_id != codec_id:
        raise IntegrityError("codec_mismatch", f"frame written by codec {found_id}, decoding with {codec_id}")
    if version != FRAME_VERSION:
        raise IntegrityError("codec_version", f"frame version {version}, reader {FRAME_VERSION}")
    body = view[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise IntegrityError("codec_checksum", "codec body does not match its checksum")
    return body


def expect_length(raw: bytes | memoryview, tensors_nbytes: int) -> memoryview:
    """``raw`` as a flat byte view, checked against the descriptors' total."""
    view = memoryview(raw).cast("B")
    if len(view) != tensors_nbytes:
        raise InvalidRequestError(f"payload is {len(view)} B but its tensors describe {tensors_nbytes} B")
    return view
