"""Codecs of kvengine.compression: exactness, error bounds, corruption, registry."""

from __future__ import annotations

import dataclasses
import math
import struct
from concurrent.futures import ThreadPoolExecutor

import blosc2
import numpy as np
import pytest
import torch

from kvengine.chunks.codecs import Codec, RawCodec
from kvengine.chunks.keys import ChunkHash, ChunkKey, Namespace, NamespaceDigest
from kvengine.chunks.layout import KVCategory, dtype_code
from kvengine.chunks.record import TensorDescriptor, encode_header, unpack_record
from kvengine.compression import (
    LOSSLESS_FAMILY,
    Format,
    Grouping,
    QuantCodec,
    QuantScheme,
    codec_family,
    default_codecs,
    lossless,
    lossless_codecs,
    lossy_codecs,
)
from kvengine.compression._frame import HEADER_BYTES, seal
from kvengine.compression.entropy import entropy_bound
from kvengine.compression.quality import synthetic_kv
from kvengine.errors import IntegrityError, InvalidRequestError

REGISTRY = default_codecs(threads=2)
LOSSLESS = lossless_codecs(threads=2)
LOSSY = lossy_codecs()
OURS: list[Codec] = [*LOSSLESS, *LOSSY]


def payload(tensors: list[torch.Tensor]) -> tuple[bytes, list[TensorDescriptor]]:
    tensors = [t.contiguous() for t in tensors]
    raw = b"".join(t.view(torch.uint8).reshape(-1).numpy().tobytes() for t in tensors)
    descs = [TensorDescriptor(i, KVCategory.FULL_ATTENTION, dtype_code(t.dtype), tuple(t.shape),
                              t.numel() * t.element_size()) for i, t in enumerate(tensors)]
    return raw, descs


def tensors_of(raw: bytes | memoryview, descs: list[TensorDescriptor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, pos, buf = [], 0, bytearray(raw)
    for d, t in zip(descs, like):
        out.append(torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=pos).reshape(t.shape))
        pos += d.nbytes
    return out


def rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    return torch.randint(-128, 128, shape, generator=gen).to(dtype)


def roundtrip(codec: Codec, raw: bytes, descs: list[TensorDescriptor]) -> tuple[bytes, bytes]:
    stored = bytes(codec.encode(memoryview(raw), descs))
    return stored, bytes(codec.decode(memoryview(stored), descs))


# ---------------------------------------------------------------- lossless


ODD_SHAPES = [(1,), (3,), (7, 3, 5), (33, 2, 17), (1000, 3)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


@pytest.mark.parametrize("codec", LOSSLESS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_lossless_roundtrip_is_bit_exact(codec: Codec, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Every lossless codec returns the exact bytes, for every dtype and odd sizes."""
    raw, descs = payload([rand(shape, dtype)])
    _, decoded = roundtrip(codec, raw, descs)
    assert decoded == raw


@pytest.mark.parametrize("codec", LOSSLESS, ids=lambda c: c.name)
def test_lossless_mixed_dtypes_and_special_values(codec: Codec) -> None:
    """Scenario: one chunk mixing dtypes (runs of item sizes 4,4,2,2,1,8,2), NaN/inf/-0/subnormals."""
    special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-40, 3.0e38, 1.0])
    tensors = [rand((5, 4, 3), torch.float32), special, rand((9, 3), torch.bfloat16),
               special.to(torch.float16), rand((11,), torch.uint8), rand((4, 2), torch.float64),
               rand((2, 8, 16), torch.bfloat16, seed=2)]
    raw, descs = payload(tensors)
    _, decoded = roundtrip(codec, raw, descs)
    assert decoded == raw


@pytest.mark.parametrize("codec", LOSSLESS, ids=lambda c: c.name)
def test_lossless_segments_longer_than_the_cut(codec: Codec, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs longer than MAX_SEGMENT_BYTES are cut into several blosc2 chunks and reassembled."""
    monkeypatch.setattr(lossless, "MAX_SEGMENT_BYTES", 1000)
    raw, descs = payload([rand((700, 3), torch.bfloat16), rand((333,), torch.float32)])
    assert len(list(lossless.segments(descs))) > 3
    _, decoded = roundtrip(codec, raw, descs)
    assert decoded == raw


@pytest.mark.parametrize("scheme", lossless.SCHEMES, ids=lambda s: s.name)
def test_encoder_knobs_are_not_part_of_the_format(scheme: lossless.BloscScheme) -> None:
    """Records written with other block sizes or split modes still decode: retuning breaks no stored data."""
    raw, descs = payload([synthetic_kv(tokens=300), rand((64, 8), torch.float32)])
    for split in blosc2.SplitMode:
        for blocksize in (0, 1 << 16, 1 << 21):
            old = lossless.BloscCodec(dataclasses.replace(scheme, blocksize=blocksize, split=split))
            current = lossless.BloscCodec(scheme)
            assert bytes(current.decode(memoryview(old.encode(memoryview(raw), descs)), descs)) == raw


@pytest.mark.parametrize("codec", LOSSLESS, ids=lambda c: c.name)
def test_lossless_empty_payload(codec: Codec) -> None:
    """An empty payload round trips to empty bytes, stored as the header alone."""
    raw, descs = payload([torch.empty((0, 4), dtype=torch.bfloat16)])
    stored, decoded = roundtrip(codec, raw, descs)
    assert decoded == b"" and len(stored) == HEADER_BYTES


def test_zstd_byteshuffle_reaches_the_entropy_bound_on_kv_like_bf16() -> None:
    """The dense codec gets within 5% of the order-0 per-byte-plane bound (note: bound ~1.43)."""
    raw, descs = payload([synthetic_kv(1024, 8, 128, dtype=torch.bfloat16)])
    bound = entropy_bound(raw, descs)
    stored, decoded = roundtrip(REGISTRY.by_name("zstd-byteshuffle"), raw, descs)
    assert decoded == raw
    assert 1.3 < bound < 1.6
    assert len(raw) / len(stored) >= 0.95 * bound
    lz4_stored, _ = roundtrip(REGISTRY.by_name("lz4-bitshuffle"), raw, descs)
    assert len(raw) / len(lz4_stored) > 1.05


def test_entropy_bound_definition() -> None:
    """Two equiprobable symbols per byte cost 1 bit: bound 8. Uniform bytes: bound ~1."""
    two = np.tile(np.array([0, 255], np.uint8), 4096).tobytes()
    desc = [TensorDescriptor(0, KVCategory.OPAQUE, dtype_code(torch.uint8), (len(two),), len(two))]
    assert entropy_bound(two, desc) == pytest.approx(8.0)
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    desc = [TensorDescriptor(0, KVCategory.OPAQUE, dtype_code(torch.uint8), (len(noise),), len(noise))]
    assert entropy_bound(noise, desc) == pytest.approx(1.0, abs=0.01)


def test_codecs_are_thread_safe() -> None:
    """Scenario: four threads encode and decode different payloads with one codec object."""
    codec = REGISTRY.by_name("zstd-byteshuffle")
    payloads = [payload([rand((512, 64), torch.bfloat16, seed=s)]) for s in range(8)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: roundtrip(codec, *p)[1] == p[0], payloads * 4))
    assert all(results)


# ---------------------------------------------------------------- lossy


def group_amax(x: torch.Tensor, codec: QuantCodec, token_dim: int = 0) -> torch.Tensor:
    """Per-element amax of its quantization group (independent of the codec's code)."""
    x = x.float().abs()
    if codec.scheme.grouping is Grouping.CHANNEL:
        return x.amax(dim=token_dim if token_dim < x.dim() else 0, keepdim=True).expand_as(x)
    g = codec.scheme.group or x.shape[-1]
    cols = x.shape[-1]
    pad = -cols % g
    padded = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, g)
    return padded.amax(-1, keepdim=True).expand_as(padded).reshape(*x.shape[:-1], cols + pad)[..., :cols]


STEP = {Format.INT8: 0.5 / 127, Format.INT4: 0.5 / 7}
EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-24}


@pytest.mark.parametrize("codec", LOSSY, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(64, 4, 32), (17, 3, 40), (5, 7), (9,)], ids=str)
def test_lossy_error_is_bounded_by_the_group_scale(codec: QuantCodec, dtype: torch.dtype,
                                                   shape: tuple[int, ...]) -> None:
    """|x - x'| <= half a quantization step of the group (plus scale and output rounding)."""
    x = synthetic_kv(shape[0], 1, int(np.prod(shape[1:])), dtype=dtype).reshape(shape)
    raw, descs = payload([x])
    stored, decoded = roundtrip(codec, raw, descs)
    (y,) = tensors_of(decoded, descs, [x])
    assert y.dtype == x.dtype and y.shape == x.shape
    err = (y.double() - x.double()).abs()
    amax = group_amax(x, codec).double()
    if codec.scheme.fmt is Format.FP8:
        bound = x.double().abs() * 2.0**-4 + amax / 448 * 2.0**-9
    else:
        bound = amax * STEP[codec.scheme.fmt] * (1 + 2.0**-7)
    bound = bound + x.double().abs() * 2 * EPS[dtype] + 1e-30
    assert bool((err <= bound).all()), float((err / bound).max())
    if x.numel() >= 1024:
        assert len(stored) < len(raw)


CHANNEL_SCHEMES = [c.scheme for c in LOSSY if c.scheme.grouping is Grouping.CHANNEL]


def with_token_dims(descs: list[TensorDescriptor], dims: list[int | None]) -> list[TensorDescriptor]:
    """``descs`` carrying the given token dims (as ``descriptors_for`` fills them from a layout)."""
    return [dataclasses.replace(d, token_dim=dim) for d, dim in zip(descs, dims)]


def legacy_channel_body(codec: QuantCodec, raw: bytes, descs: list[TensorDescriptor], axis: int) -> bytes:
    """What a writer before per-tensor axes stored: one prefix byte, ``axis``, for every tensor (axis 0
    for tensors with fewer dimensions), then the same scales and codes."""
    dims = [axis if axis < max(len(d.shape), 1) else None for d in descs]
    body = bytes(codec.encode(memoryview(raw), with_token_dims(descs, dims)))[HEADER_BYTES:]
    assert body[0] == 0xFF and len(body) > len(descs)
    return reseal(codec, bytes([axis]) + body[1 + len(descs) :])


@pytest.mark.parametrize("scheme", CHANNEL_SCHEMES, ids=lambda s: s.name)
def test_channel_codecs_reduce_over_each_tensors_token_dim(scheme: QuantScheme) -> None:
    """Scenario: a [2 (K/V), heads, tokens, head_dim] tensor whose descriptor says token_dim=2. Each
    (kv, head, dim) channel gets its own scale over the tokens, a reader whose descriptors carry no
    token dim still decodes it (the body records the axes), and a 1-D tensor without one uses axis 0."""
    codec = QuantCodec(scheme)
    kv = synthetic_kv(48, 2 * 4, 16, dtype=torch.float32).reshape(48, 2, 4, 16).permute(1, 2, 0, 3).contiguous()
    small = torch.randn(5) * 100  # no token dim: axis 0
    raw, plain = payload([kv, small])
    descs = with_token_dims(plain, [2, None])
    stored = codec.encode(memoryview(raw), descs)
    y, y_small = tensors_of(REGISTRY.by_id(scheme.codec_id).decode(memoryview(stored), plain), plain, [kv, small])
    step = STEP[scheme.fmt] * (1 + 2.0**-7)
    assert bool(((y - kv).abs() <= group_amax(kv, codec, token_dim=2) * step + 1e-6).all())
    assert bool(((y_small - small).abs() <= small.abs().max() * step + 1e-6).all())
    token_first = codec.encode(memoryview(raw), plain)
    assert len(stored) < len(token_first)  # 2*4*16 channel scales, not 4*48*16


@pytest.mark.parametrize("scheme", CHANNEL_SCHEMES, ids=lambda s: s.name)
def test_channel_codecs_take_one_scale_per_head_and_dim_in_the_hf_layout(scheme: QuantScheme) -> None:
    """Scenario: the Hugging Face chunk layout, [kv_heads, tokens, head_dim] bf16 with token_dim=1. The
    body holds heads*head_dim scales (one per (head, dim) over the tokens), not one per 3 values across
    heads, and every value is within half a step of its channel's scale."""
    heads, tokens, dim = 3, 64, 16
    x = synthetic_kv(tokens, heads, dim, dtype=torch.bfloat16).permute(1, 0, 2).contiguous()
    raw, descs = payload([x])
    descs = with_token_dims(descs, [1])
    codec = QuantCodec(scheme)
    stored = codec.encode(memoryview(raw), descs)
    codes = x.numel() if scheme.fmt is Format.INT8 else (x.numel() + 1) // 2
    assert len(stored) == HEADER_BYTES + 2 + 2 * heads * dim + codes  # 0xFF, one axis, bf16 scales, codes
    (y,) = tensors_of(codec.decode(memoryview(stored), descs), descs, [x])
    bound = group_amax(x, codec, token_dim=1).double() * STEP[scheme.fmt] * (1 + 2.0**-7)
    bound = bound + x.double().abs() * 2 * EPS[torch.bfloat16] + 1e-30
    assert bool(((y.double() - x.double()).abs() <= bound).all())


@pytest.mark.parametrize("scheme", CHANNEL_SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("axis", [0, 2])
def test_channel_bodies_of_older_writers_still_decode(scheme: QuantScheme, axis: int) -> None:
    """A body with the former one-byte prefix (one axis for all tensors, axis 0 for those with fewer
    dimensions) decodes to the same tensors as the per-tensor body of the same axes."""
    codec = QuantCodec(scheme)
    tensors = [rand((4, 8, 16), torch.bfloat16), rand((6, 10), torch.float32, seed=1), rand((9,), torch.float16)]
    raw, descs = payload(tensors)
    legacy = legacy_channel_body(codec, raw, descs, axis)
    dims = [axis if axis < len(d.shape) else None for d in descs]
    current = codec.encode(memoryview(raw), with_token_dims(descs, dims))
    assert len(legacy) == len(current) - len(descs)
    assert bytes(codec.decode(memoryview(legacy), descs)) == bytes(codec.decode(memoryview(current), descs))


@pytest.mark.parametrize("scheme", CHANNEL_SCHEMES, ids=lambda s: s.name)
def test_tensors_of_one_record_each_use_their_own_token_dim(scheme: QuantScheme) -> None:
    """Tensors with token dims 0, 1 and 2 (and none) in one body each take their scales over their own
    axis: the error of each is bounded by its own channels' amax, and the body stores their axes."""
    codec = QuantCodec(scheme)
    kv = synthetic_kv(32, 4, 8, dtype=torch.float32)  # [tokens, heads, dim]
    tensors = [kv, kv.permute(1, 0, 2).contiguous(), kv.permute(1, 2, 0).contiguous(), torch.randn(7) * 10]
    dims: list[int | None] = [0, 1, 2, None]
    raw, descs = payload(tensors)
    descs = with_token_dims(descs, dims)
    stored = codec.encode(memoryview(raw), descs)
    assert bytes(stored)[HEADER_BYTES : HEADER_BYTES + 5] == bytes([0xFF, 0, 1, 2, 0])
    got = tensors_of(codec.decode(memoryview(stored), descs), descs, tensors)
    step = STEP[scheme.fmt] * (1 + 2.0**-7)
    for y, x, dim in zip(got, tensors, dims):
        assert bool(((y - x).abs() <= group_amax(x, codec, token_dim=dim or 0) * step + 1e-6).all())
    token_first = codec.encode(memoryview(raw), with_token_dims(descs, [0, 0, 0, None]))
    assert len(stored) == len(token_first) - 2 * (32 * 8 - 4 * 8) - 2 * (32 * 8 - 4 * 8)  # fewer scales


@pytest.mark.parametrize("scheme", CHANNEL_SCHEMES, ids=lambda s: s.name)
def test_channel_axes_outside_the_shapes_raise(scheme: QuantScheme) -> None:
    """A per-tensor axis forged beyond its tensor's dimensions (valid checksum) is an IntegrityError, as
    is an empty body."""
    codec = QuantCodec(scheme)
    raw, descs = payload([rand((8, 4, 16), torch.float32)])
    body = bytearray(bytes(codec.encode(memoryview(raw), descs))[HEADER_BYTES:])
    body[1] = 3
    for bad in (bytes(body), b""):
        with pytest.raises(IntegrityError):
            codec.decode(memoryview(reseal(codec, bad)), descs)


@pytest.mark.parametrize("codec", LOSSY, ids=lambda c: c.name)
def test_lossy_passes_non_float_tensors_and_zeros_through(codec: QuantCodec) -> None:
    """Lossy codecs return integer tensors and all-zero tensors exactly."""
    tensors = [rand((8, 4), torch.int8), torch.zeros(6, 8, dtype=torch.bfloat16), rand((3, 5), torch.int32),
               rand((16, 2, 8), torch.float16)]
    raw, descs = payload(tensors)
    _, decoded = roundtrip(codec, raw, descs)
    got = tensors_of(decoded, descs, tensors)
    assert torch.equal(got[0], tensors[0]) and torch.equal(got[2], tensors[2])
    assert torch.equal(got[1], tensors[1])


@pytest.mark.parametrize("codec", LOSSY, ids=lambda c: c.name)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_lossy_refuses_non_finite_values(codec: QuantCodec, bad: float) -> None:
    """A NaN or infinity in the payload makes a lossy encode raise InvalidRequestError."""
    x = rand((4, 8), torch.float32)
    x[1, 3] = bad
    raw, descs = payload([x])
    with pytest.raises(InvalidRequestError):
        codec.encode(memoryview(raw), descs)


def test_fp8_codes_match_torch_rounding() -> None:
    """The chunked fp8 conversion equals torch's e4m3fn rounding, subnormals and +-448 included."""
    from kvengine.compression.quantize import _FP8_VALUES, _SERIAL_ELEMENTS, _fp8_codes

    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(3 * _SERIAL_ELEMENTS + 5, generator=gen) * s for s in (1e-3, 1.0, 100.0)])
    x = torch.cat([x.clamp(-448, 448), torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-9, 2.0**-10])])
    codes = np.frombuffer(_fp8_codes(x.numpy()), np.uint8)
    assert np.array_equal(codes, x.to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    assert np.array_equal(_FP8_VALUES[codes], x.to(torch.float8_e4m3fn).float().numpy())


def test_lossy_ratios_on_bf16_kv() -> None:
    """Stored size per bf16 value: int8/fp8 ~8 bits, int4 ~4.5 (g32) or ~4 (channel) bits."""
    raw, descs = payload([synthetic_kv(256, 8, 128, dtype=torch.bfloat16)])
    ratios = {c.name: len(raw) / len(c.encode(memoryview(raw), descs)) for c in LOSSY}
    assert ratios["int8-token"] > 1.95 and ratios["fp8-token"] > 1.95 and ratios["int8-channel"] > 1.95
    assert ratios["int4-token-g32"] > 3.4 and ratios["int4-channel"] > 3.9


# ---------------------------------------------------------------- corruption


def reseal(codec: Codec, body: bytes) -> bytes:
    """A frame with a valid checksum around a tampered body (defeats the checksum)."""
    return seal(codec.codec_id, [body])


@pytest.mark.parametrize("codec", OURS, ids=lambda c: c.name)
def test_corrupted_or_truncated_input_raises_integrity_error(codec: Codec) -> None:
    """Empty, truncated, extended or bit-flipped stored bytes raise IntegrityError on decode, never return data."""
    raw, descs = payload([rand((64, 4, 16), torch.bfloat16), rand((10,), torch.int8)])
    stored = bytes(codec.encode(memoryview(raw), descs))
    bad_inputs = [b"", stored[:5], stored[:HEADER_BYTES], stored[:-1], stored + b"\0"]
    for pos in [0, 2, 5, HEADER_BYTES, HEADER_BYTES + 10, len(stored) // 2, len(stored) - 1]:
        flipped = bytearray(stored)
        flipped[pos] ^= 0x40
        bad_inputs.append(bytes(flipped))
    for bad in bad_inputs:
        with pytest.raises(IntegrityError):
            codec.decode(memoryview(bad), descs)


@pytest.mark.parametrize("codec", OURS, ids=lambda c: c.name)
def test_structural_checks_hold_without_the_checksum(codec: Codec) -> None:
    """Scenario: bytes with a forged checksum but a body of the wrong length, or
    descriptors that do not match, still raise IntegrityError, never return data."""
    raw, descs = payload([rand((64, 4, 16), torch.bfloat16)])
    body = bytes(codec.encode(memoryview(raw), descs))[HEADER_BYTES:]
    for tampered in [body[:-3], body + b"xyz", body[: len(body) // 2], b""]:
        with pytest.raises(IntegrityError):
            codec.decode(memoryview(reseal(codec, tampered)), descs)
    other = [TensorDescriptor(0, KVCategory.FULL_ATTENTION, descs[0].dtype_code, (32, 4, 16), descs[0].nbytes // 2)]
    with pytest.raises(IntegrityError):
        codec.decode(memoryview(bytes(codec.encode(memoryview(raw), descs))), other)


@pytest.mark.parametrize("codec", LOSSLESS, ids=lambda c: c.name)
def test_forged_blosc_header_sizes_raise(codec: Codec) -> None:
    """Blosc sizes forged under a valid checksum (nbytes, cbytes) raise IntegrityError."""
    raw, descs = payload([rand((64, 4, 16), torch.bfloat16)])
    body = bytearray(bytes(codec.encode(memoryview(raw), descs))[HEADER_BYTES:])
    for offset, value in [(4, len(raw) + 2), (12, len(body) + 100), (12, 3)]:  # nbytes, cbytes
        forged = bytearray(body)
        struct.pack_into("<i", forged, offset, value)
        with pytest.raises(IntegrityError):
            codec.decode(memoryview(reseal(codec, bytes(forged))), descs)


@pytest.mark.parametrize("codec", LOSSY, ids=lambda c: c.name)
@pytest.mark.parametrize("scale_bits", [0x7F80, 0x7FC0, 0x0000, 0xBF80])  # inf, nan, 0, -1
def test_forged_invalid_scales_raise(codec: QuantCodec, scale_bits: int) -> None:
    """A scale forged to inf, NaN, zero or a negative value under a valid checksum raises IntegrityError."""
    raw, descs = payload([rand((8, 4, 16), torch.float32)])
    body = bytearray(bytes(codec.encode(memoryview(raw), descs))[HEADER_BYTES:])
    struct.pack_into("<H", body, 2 if codec.scheme.grouping is Grouping.CHANNEL else 0, scale_bits)  # 0xFF, axis
    with pytest.raises(IntegrityError):
        codec.decode(memoryview(reseal(codec, bytes(body))), descs)


def test_decoding_with_another_codec_raises() -> None:
    """Bytes encoded by one codec are a codec_mismatch IntegrityError when decoded by another."""
    raw, descs = payload([rand((64, 8), torch.bfloat16)])
    stored = REGISTRY.by_name("zstd-byteshuffle").encode(memoryview(raw), descs)
    for name in ("lz4-byteshuffle", "int8-token"):
        with pytest.raises(IntegrityError, match="codec_mismatch"):
            REGISTRY.by_name(name).decode(memoryview(stored), descs)


def test_encode_rejects_a_payload_that_does_not_match_its_descriptors() -> None:
    """Every codec refuses to encode a payload shorter than its descriptors say."""
    raw, descs = payload([rand((8, 8), torch.float16)])
    for codec in OURS:
        with pytest.raises(InvalidRequestError):
            codec.encode(memoryview(raw[:-2]), descs)


# ---------------------------------------------------------------- registry


def test_default_registry_ids_names_and_unknown_id() -> None:
    """Raw plus every codec; stable id ranges; an unknown id is an IntegrityError (a miss)."""
    ids = {REGISTRY.by_name(n).codec_id: n for n in REGISTRY.names()}
    assert ids == {0: "raw", 1: "lz4-byteshuffle", 2: "lz4-bitshuffle", 3: "zstd-byteshuffle", 4: "zstd-bitshuffle",
                   16: "int8-token", 17: "int8-channel", 18: "int4-token-g32", 19: "int4-channel", 20: "fp8-token"}
    for codec_id, name in ids.items():
        assert REGISTRY.by_name(name).lossless == (codec_id < 16)
    assert isinstance(REGISTRY.by_id(0), RawCodec)
    with pytest.raises(IntegrityError) as info:
        REGISTRY.by_id(99)
    assert info.value.reason == "unknown_codec"
    assert default_codecs(threads=1).by_name("zstd-byteshuffle").threads == 1  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        lossless_codecs(threads=0)


def test_codec_family_separates_lossy_chunks() -> None:
    """Lossless codecs share the default family; each lossy codec gets its own namespace."""
    families = {codec_family(REGISTRY.by_name(n)) for n in REGISTRY.names() if REGISTRY.by_name(n).lossless}
    assert families == {LOSSLESS_FAMILY} == {Namespace(model="m").codec_family}
    lossy = [codec_family(c) for c in LOSSY]
    assert len(set(lossy)) == len(lossy) and LOSSLESS_FAMILY not in lossy
    base = Namespace(model="m")
    assert base.with_updates(codec_family=lossy[0]).digest() != base.digest()


@pytest.mark.parametrize("name", ["zstd-byteshuffle", "lz4-bitshuffle", "int4-channel"])
def test_record_roundtrip_through_the_registry(name: str) -> None:
    """Scenario: write a record with a codec, read it back, decode by the header's codec id."""
    codec = REGISTRY.by_name(name)
    tensors = [rand((32, 2, 16), torch.bfloat16), rand((32, 2, 16), torch.bfloat16, seed=1)]
    raw, descs = payload(tensors)
    stored = codec.encode(memoryview(raw), descs)
    key = ChunkKey(NamespaceDigest(b"n" * 16), ChunkHash(b"h" * 16))
    header = encode_header(key, (0, 32), descs, codec_id=codec.codec_id, raw_length=len(raw), payload=stored)
    got_header, body = unpack_record(header + bytes(stored), expect_key=key)
    decoded = bytes(REGISTRY.by_id(got_header.codec_id).decode(body, got_header.tensors))
    if codec.lossless:
        assert decoded == raw
    else:
        got = tensors_of(decoded, descs, tensors)
        assert all(((g.float() - t.float()).abs() <= t.float().abs().max() / 7).all() for g, t in zip(got, tensors))


# ---------------------------------------------------------------- model quality


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_cache_keeps_the_model_close_and_lossless_is_exact(family: str) -> None:
    """Tiny random fp32 models: int8-token KV keeps greedy decoding (measured 0.96-1.0
    agreement, <= 0.05 max logit diff over 4 families); lossless changes nothing."""
    from kvengine.compression.quality import cache_quality, tiny_model

    model = tiny_model(family)
    exact = cache_quality(model, REGISTRY.by_name("zstd-byteshuffle"), steps=30)
    assert exact.max_abs_logit_diff == 0.0 and exact.greedy_agreement == 1.0 and exact.free_run_prefix == 30
    int8 = cache_quality(model, REGISTRY.by_name("int8-token"), steps=30)
    assert int8.greedy_agreement >= 0.9
    assert 0 < int8.max_abs_logit_diff < 0.15
    assert abs(int8.ppl_codec - int8.ppl_exact) / int8.ppl_exact < 0.01
    int4 = cache_quality(model, REGISTRY.by_name("int4-token-g32"), steps=30)
    assert int4.kv_rel_rms_error > 5 * int8.kv_rel_rms_error


def test_without_blosc2_raw_and_lossy_codecs_run_and_lossless_ones_name_the_extra(tmp_path):
    """blosc2 is the ``[compression]`` extra. In a process without it, an engine with raw or lossy tier codecs
    starts and round-trips a chunk through its disk tier, and one configured with a lossless codec is refused
    at start-up with a ConfigError naming the setting and the pip command."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        sys.modules["blosc2"] = None  # as if not installed
        import torch
        from kvengine import ChunkLayout, ConfigError, KVCategory, KVEngine, Namespace, TensorSpec
        from kvengine.compression import HAVE_BLOSC2
        assert not HAVE_BLOSC2
        layout = ChunkLayout(4, (TensorSpec(name="kv", group=0, category=KVCategory.FULL_ATTENTION,
                                            dtype=torch.float32, shape=(4, 8), token_dim=0),))
        for codec in ("raw", "int8-token"):
            cfg = {{"chunk_size": 4, "write_mode": "write_through",
                   "disk": {{"path": r"{tmp_path}/" + codec, "codec": codec, "fsync": "never"}}}}
            lossy = codec != "raw"
            with KVEngine(cfg) as eng:
                ns = Namespace(model="m", codec_family="lossy:" + codec if lossy else "lossless")
                b = eng.bind(ns, layout)
                assert eng.store(b, list(range(8)), lambda i, s, e: [torch.ones(4, 8) * i]).stored_chunks == 2
        try:
            KVEngine({{"disk": {{"path": r"{tmp_path}/z", "codec": "zstd-byteshuffle"}}}})
        except ConfigError as exc:
            print("REFUSED", exc)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "REFUSED disk.codec: codec 'zstd-byteshuffle' is not available here" in out.stdout
    assert "pip install 'kvengine[compression]'" in out.stdout
