"""The chunk record format: round trip and detection of every kind of damage."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace
from kvengine.chunks.layout import KVCategory, dtype_code
from kvengine.chunks.record import (
    ALIGNED_PAYLOAD_MIN,
    FORMAT_VERSION,
    PAYLOAD_ALIGN,
    READABLE_VERSIONS,
    RecordFlag,
    TensorDescriptor,
    decode_header,
    descriptors_for,
    encode_header,
    peek_identity,
    unpack_record,
    verify_record,
)
from kvengine.errors import IntegrityError

from ..conftest import make_layout

NS = Namespace(model="m").digest()
KEY = ChunkKey(NS, ChunkHash(b"\x01" * 16))


def _record(payload: bytes = b"x" * 2048, key: ChunkKey = KEY) -> bytes:
    layout = make_layout(chunk=16, layers=2, heads=2, dim=4)  # 2 tensors of 1 KiB
    desc = descriptors_for(layout, 16)
    head = encode_header(key, (32, 48), desc, codec_id=0, raw_length=layout.nbytes(), payload=payload)
    return head + payload


def test_round_trip():
    """Header fields and payload survive encode -> unpack."""
    blob = _record()
    header, payload = unpack_record(blob, expect_key=KEY)
    assert header.key == KEY and (header.token_start, header.token_end) == (32, 48)
    assert bytes(payload) == b"x" * 2048 and header.raw_length == 2048
    assert [t.shape for t in header.tensors] == [(2, 2, 16, 4)] * 2
    assert header.flags == RecordFlag.NONE


@pytest.mark.parametrize("position", [0, 5, 40, 60, 100, 200, -1, -500])
def test_any_bit_flip_is_detected(position):
    """A single flipped bit anywhere (magic, header, descriptors, payload) is an IntegrityError."""
    blob = bytearray(_record())
    blob[position] ^= 0x10
    with pytest.raises(IntegrityError):
        unpack_record(bytes(blob), expect_key=KEY)


@pytest.mark.parametrize("cut", [0, 3, 20, 120, -1, -1000])
def test_truncation_is_detected(cut):
    """A record cut at any length is an IntegrityError (truncated or bad magic), never data."""
    blob = _record()
    with pytest.raises(IntegrityError) as err:
        unpack_record(blob[:cut], expect_key=KEY)
    assert err.value.reason.startswith(("truncated", "bad_magic"))


def test_trailing_bytes_rejected():
    """Bytes after the end of a record make it malformed ("trailing")."""
    with pytest.raises(IntegrityError, match="trailing"):
        unpack_record(_record() + b"\0", expect_key=KEY)


def test_other_version_rejected():
    """A record written by another format version is a miss, not data."""
    blob = bytearray(_record())
    struct.pack_into("<H", blob, 4, FORMAT_VERSION + 1)
    with pytest.raises(IntegrityError) as err:
        decode_header(bytes(blob))
    assert err.value.reason == "other_version"


def test_other_namespace_and_key_rejected():
    """A valid record read under another namespace or another chunk hash is refused, naming which differs."""
    other = ChunkKey(Namespace(model="other").digest(), ChunkHash(b"\x01" * 16))
    with pytest.raises(IntegrityError) as err:
        unpack_record(_record(), expect_key=other)
    assert err.value.reason == "other_namespace"
    with pytest.raises(IntegrityError) as err:
        unpack_record(_record(), expect_key=ChunkKey(NS, ChunkHash(b"\x02" * 16)))
    assert err.value.reason == "other_key"


def _reason(check, blob: bytes, key: ChunkKey = KEY) -> str | None:
    try:
        check(blob, expect_key=key)
    except IntegrityError as exc:
        return exc.reason
    return None


def _flipped(position: int) -> bytes:
    blob = bytearray(_record())
    blob[position] ^= 0x10
    return bytes(blob)


@pytest.mark.parametrize("blob, key", [
    *((_flipped(p), KEY) for p in (0, 5, 40, 60, 100, 200, -1, -500)),
    *((_record()[:cut], KEY) for cut in (0, 3, 20, 120, -1, -1000)),
    (_record() + b"\0", KEY),
    (_record(), ChunkKey(Namespace(model="other").digest(), ChunkHash(b"\x01" * 16))),
    (_record(), ChunkKey(NS, ChunkHash(b"\x02" * 16))),
    (_record(), KEY),
])
def test_verify_record_refuses_what_unpack_record_refuses_for_the_same_reason(blob, key):
    """The wire's check (no descriptor parse: one hash of the header) names every damage as the parser does."""
    assert _reason(verify_record, blob, key) == _reason(unpack_record, blob, key)


def test_peek_identity_names_key_and_length_without_parsing_descriptors():
    blob = _record()
    named = peek_identity(blob)
    header, _ = unpack_record(blob, expect_key=KEY)
    assert (named.key, named.record_length, named.payload_checksum) == (KEY, len(blob), header.payload_checksum)
    assert not named.authenticated


def test_descriptors_follow_layout_dtype():
    """Descriptors take the layout's dtype and the chunk's token count: a partial chunk has a halved token dim."""
    layout = make_layout(dtype=torch.bfloat16)
    desc = descriptors_for(layout, 8)  # partial chunk: token dim halves
    assert desc[0].shape == (2, 2, 8, 4) and desc[0].nbytes == 2 * 2 * 8 * 4 * 2


# -- format version 2: padded headers ------------------------------------------------
def _large_record(payload_bytes: int = 2 * ALIGNED_PAYLOAD_MIN) -> tuple[bytes, bytes]:
    layout = make_layout(chunk=16, layers=2, heads=2, dim=payload_bytes // 512)  # 2 tensors
    payload = bytes(range(256)) * (layout.nbytes() // 256)
    head = encode_header(KEY, (0, 16), descriptors_for(layout, 16), codec_id=0, raw_length=layout.nbytes(),
                         payload=payload)
    return head, payload


def _reseal(head: bytearray) -> bytes:
    """Recompute the header checksum after editing the header (what a writer of that content would do)."""
    struct.pack_into("<Q", head, len(head) - 8, xxhash.xxh3_64_intdigest(bytes(head[:-8])))
    return bytes(head)


def test_large_payloads_start_on_a_page_boundary():
    """A payload of >= 64 KiB starts at a multiple of 4 KiB into the record (direct I/O writes it in
    place); a small one is not padded. Both round trip."""
    head, payload = _large_record()
    assert len(head) % PAYLOAD_ALIGN == 0 and len(payload) >= ALIGNED_PAYLOAD_MIN
    header, body = unpack_record(head + payload, expect_key=KEY)
    assert header.header_length == len(head) and bytes(body) == payload
    assert len(_record()) - 2048 < PAYLOAD_ALIGN // 4


def test_padding_must_be_zero_and_version_1_never_padded():
    """Non-zero padding (even under a valid checksum) and a padded version-1 header are malformed;
    an unpadded version-1 record, as older writers wrote it, still reads."""
    head, payload = _large_record()
    dirty = bytearray(head)
    dirty[-100] = 1
    with pytest.raises(IntegrityError) as err:
        unpack_record(_reseal(dirty) + payload, expect_key=KEY)
    assert err.value.reason == "bad_descriptor"
    old_padded = bytearray(head)
    struct.pack_into("<H", old_padded, 4, 1)
    with pytest.raises(IntegrityError) as err:
        unpack_record(_reseal(old_padded) + payload, expect_key=KEY)
    assert err.value.reason == "bad_descriptor"
    small = bytearray(_record())
    n = decode_header(bytes(small)).header_length
    old = bytearray(small[:n])
    struct.pack_into("<H", old, 4, 1)
    header, body = unpack_record(_reseal(old) + bytes(small[n:]), expect_key=KEY)
    assert bytes(body) == b"x" * 2048 and header.token_start == 32


# -- format version 3: token dims ----------------------------------------------------
#: Byte offset of the first descriptor's token dim: the 88-byte fixed header, then group (u16), category,
#: dtype, ndim.
_FIRST_TOKEN_DIM = 88 + 5


def _token_dim_record() -> tuple[bytes, tuple[TensorDescriptor, ...]]:
    f32 = dtype_code(torch.float32)
    desc = (TensorDescriptor(0, KVCategory.FULL_ATTENTION, f32, (3, 4, 8), 384, token_dim=1),
            TensorDescriptor(1, KVCategory.LINEAR_STATE, f32, (4, 8), 128, token_dim=None),
            TensorDescriptor(2, KVCategory.FULL_ATTENTION, f32, (4, 2, 2, 2), 128, token_dim=3))
    payload = bytes(640)
    return encode_header(KEY, (0, 4), desc, codec_id=0, raw_length=640, payload=payload) + payload, desc


def test_token_dims_round_trip():
    """Each descriptor's token dim, None included, survives encode -> unpack in a version-3 record, and
    descriptors_for takes them from the layout's TensorSpecs."""
    assert FORMAT_VERSION == 3 and READABLE_VERSIONS == {1, 2, 3}
    blob, desc = _token_dim_record()
    assert struct.unpack_from("<H", blob, 4)[0] == 3
    header, _ = unpack_record(blob, expect_key=KEY)
    assert header.tensors == desc and [t.token_dim for t in header.tensors] == [1, None, 3]
    assert [t.token_dim for t in descriptors_for(make_layout(), 8)] == [2, 2]


@pytest.mark.parametrize("token_dim", [3, 7, 254])
def test_token_dim_outside_the_shape_is_a_bad_descriptor(token_dim):
    """A version-3 descriptor whose token dim is not below its ndim (checksum intact) is refused as
    bad_descriptor; a writer cannot produce one."""
    blob, desc = _token_dim_record()
    n = decode_header(blob).header_length
    head = bytearray(blob[:n])
    assert head[_FIRST_TOKEN_DIM] == 1
    head[_FIRST_TOKEN_DIM] = token_dim
    with pytest.raises(IntegrityError) as err:
        unpack_record(_reseal(head) + blob[n:], expect_key=KEY)
    assert err.value.reason == "bad_descriptor"
    with pytest.raises(IntegrityError) as err:
        encode_header(KEY, (0, 4), (TensorDescriptor(0, KVCategory.FULL_ATTENTION, dtype_code(torch.float32),
                                                     (3, 4, 8), 384, token_dim=3),),
                      codec_id=0, raw_length=384, payload=bytes(384))
    assert err.value.reason == "bad_descriptor"


@pytest.mark.parametrize("version", [1, 2])
def test_records_of_versions_1_and_2_read_without_token_dims(version):
    """A version-1 or -2 record (token dim byte was padding, written as zero) still parses, every token
    dim None, whatever the former padding byte holds."""
    blob, desc = _token_dim_record()
    n = decode_header(blob).header_length
    head = bytearray(blob[:n])
    struct.pack_into("<H", head, 4, version)
    for offset in (_FIRST_TOKEN_DIM, _FIRST_TOKEN_DIM + 16 + 3 * 8, _FIRST_TOKEN_DIM + 2 * 16 + 5 * 8):
        head[offset] = 0
    header, payload = unpack_record(_reseal(head) + blob[n:], expect_key=KEY)
    assert [t.token_dim for t in header.tensors] == [None] * 3
    assert [t.shape for t in header.tensors] == [t.shape for t in desc] and bytes(payload) == bytes(640)


def test_integrity_reasons_are_a_closed_set_because_each_is_a_metric_label() -> None:
    """A reason outside IntegrityReason is a programming error caught where it is raised (mypy catches
    literal ones statically), so the integrity-failure metric's label values are known in advance."""
    from kvengine.errors import INTEGRITY_REASONS, IntegrityError

    assert {"bad_mac", "payload_checksum", "wrong_position", "trailing_bytes"} <= INTEGRITY_REASONS
    assert IntegrityError("bad_mac", "x").reason == "bad_mac"
    with pytest.raises(ValueError, match="unknown integrity reason 'typo'"):
        IntegrityError("typo")  # type: ignore[arg-type]
