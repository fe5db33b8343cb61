"""Lossy, opt-in KV codecs: int8, fp8 and 4-bit quantization with bf16 scales.

Every floating-point tensor (fp16, bf16, fp32, fp64) is quantized
symmetrically, ``q = round(x / scale)``, with one scale per group:

* ``TOKEN`` grouping: groups of ``group`` consecutive elements along the last
  dimension (the whole last dimension when ``group`` is 0): one scale per
  token and head, since every KV layout here ends with ``head_dim``;
* ``CHANNEL`` grouping: one scale per channel, taken over the chunk's tokens,
  i.e. over each tensor's token dimension: its descriptor's ``token_dim``
  (the layout's ``TensorSpec.token_dim``; axis 0 when it has none). The body
  records the axis of every tensor, so a body decodes by itself, whatever
  its descriptors carry (records written before format version 3 carry no
  token dims).

Scales are stored as bf16, rounded up so that no value clips. Other tensors
(integers, fp8) pass through unchanged. Decoding returns the original dtype
and shape, dequantized. Body: for ``CHANNEL`` codecs the byte 0xFF and one
byte per tensor in descriptor order, the axis its scales were taken over
(older writers wrote a single byte other than 0xFF instead, one axis for all
tensors, axis 0 for those with fewer dimensions; such bodies still decode);
then per tensor in descriptor order its scales, then its codes (int4: two per
byte, low nibble first, ``q + 8``).

Lossy chunks must never be served to a reader that expects exact KV: the
engine keeps them in their own namespace (``Namespace.codec_family``, see
:func:`kvengine.compression.codec_family`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvengine.chunks.layout import dtype_code, dtype_from_code
from kvengine.chunks.record import TensorDescriptor
from kvengine.errors import IntegrityError, InvalidRequestError

from ._frame import expect_length, open_frame, seal

_BF16 = dtype_code(torch.bfloat16)
_NUMPY_FLOATS = {dtype_code(torch.float16): np.float16, dtype_code(torch.float32): np.float32,
                 dtype_code(torch.float64): np.float64}
_FP8_MAX = 448.0
#: float32 value of every e4m3fn code (decoding is a table lookup).
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
#: First body byte of CHANNEL codecs that record one axis per tensor (any other byte: the single axis
#: older writers used for every tensor).
_PER_TENSOR_AXES = 0xFF
#: Elements per torch conversion call when encoding fp8: below torch's parallel
#: grain size, so it runs on the calling thread instead of waking (and, on a
#: busy machine, waiting for) torch's intra-op pool.
_SERIAL_ELEMENTS = 1 << 14


class Format(enum.Enum):
    INT8 = "int8"
    INT4 = "int4"
    FP8 = "fp8"  # float8 e4m3fn

    @property
    def qmax(self) -> float:
        return {"int8": 127.0, "int4": 7.0, "fp8": _FP8_MAX}[self.value]


class Grouping(enum.Enum):
    TOKEN = "token"
    CHANNEL = "channel"


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantScheme:
    """One stable lossy format."""

    codec_id: int
    fmt: Format
    grouping: Grouping
    #: TOKEN grouping only: elements per scale along the last dim (0: all).
    group: int = 0

    def __post_init__(self) -> None:
        if not 16 <= self.codec_id < 256:
            raise ValueError(f"lossy codec ids are 16..255, got {self.codec_id}")
        if self.group < 0 or (self.group and self.grouping is not Grouping.TOKEN):
            raise ValueError("group applies to TOKEN grouping only and must be >= 0")

    @property
    def name(self) -> str:
        suffix = f"-g{self.group}" if self.group else ""
        return f"{self.fmt.value}-{self.grouping.value}{suffix}"


#: The stable lossy formats. Never renumber: ids are stored in records.
SCHEMES: tuple[QuantScheme, ...] = (
    QuantScheme(codec_id=16, fmt=Format.INT8, grouping=Grouping.TOKEN),
    QuantScheme(codec_id=17, fmt=Format.INT8, grouping=Grouping.CHANNEL),
    QuantScheme(codec_id=18, fmt=Format.INT4, grouping=Grouping.TOKEN, group=32),
    QuantScheme(codec_id=19, fmt=Format.INT4, grouping=Grouping.CHANNEL),
    QuantScheme(codec_id=20, fmt=Format.FP8, grouping=Grouping.TOKEN),
)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Where one tensor's bytes go, derived from its descriptor (and, CHANNEL grouping, its axis) only.

    A quantized tensor is viewed as ``(outer, group, inner)``, padded where
    TOKEN groups do not divide the last dim; each ``(outer, inner)`` pair
    has one scale over its ``group`` values.
    """

    quantized: bool
    stored_bytes: int
    view: tuple[int, int, int] = (0, 0, 0)
    #: TOKEN grouping: the unpadded ``(rows, last dim)`` and the padded width.
    rows: int = 0
    cols: int = 0
    padded_cols: int = 0

    @property
    def scale_count(self) -> int:
        return self.view[0] * self.view[2]

    @property
    def code_count(self) -> int:
        return self.view[0] * self.view[1] * self.view[2]


def _channel_axis(t: TensorDescriptor, dim: int | None) -> int:
    """The axis CHANNEL grouping reduces ``t`` over for a requested ``dim``: axis 0 when None or when
    ``t`` has fewer dimensions."""
    return dim if dim is not None and dim < max(len(t.shape), 1) else 0


def _plan(t: TensorDescriptor, scheme: QuantScheme, axis: int, *, decoding: bool) -> _Plan:
    """``axis``: CHANNEL grouping's, already resolved (:func:`_channel_axis`); ignored by TOKEN grouping."""
    numel = math.prod(t.shape)
    quantized = t.dtype_code == _BF16 or t.dtype_code in _NUMPY_FLOATS
    if quantized and numel * dtype_from_code(t.dtype_code).itemsize != t.nbytes:
        detail = f"shape {t.shape} does not match {t.nbytes} B"
        raise IntegrityError("codec_layout", detail) if decoding else InvalidRequestError(detail)
    if not quantized or numel == 0:
        return _Plan(False, t.nbytes)
    shape = t.shape or (1,)
    rows = cols = padded = 0
    if scheme.grouping is Grouping.TOKEN:
        cols = shape[-1]
        width = min(scheme.group or cols, cols)
        padded = -(-cols // width) * width
        rows = numel // cols
        view = (rows * padded // width, width, 1)
    else:
        view = (math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :]))
    count = view[0] * view[1] * view[2]
    code_bytes = (count + 1) // 2 if scheme.fmt is Format.INT4 else count
    return _Plan(True, 2 * view[0] * view[2] + code_bytes, view, rows, cols, padded)


def _to_f32(buf: memoryview, code: int) -> np.ndarray:
    """A fresh, writable float32 copy of a float tensor's bytes."""
    if code == _BF16:
        bits = np.frombuffer(buf, np.uint16).astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    return np.frombuffer(buf, _NUMPY_FLOATS[code]).astype(np.float32)


def _from_f32(x: np.ndarray, code: int) -> np.ndarray:
    if code == _BF16:  # round to nearest even, as torch does (values are finite here)
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
        return ((bits + ((bits >> 16) & 1) + np.uint32(0x7FFF)) >> 16).astype(np.uint16)
    return np.ascontiguousarray(x, _NUMPY_FLOATS[code])


def _grouped(x: np.ndarray, plan: _Plan) -> np.ndarray:
    if plan.padded_cols > plan.cols:
        x = np.pad(x.reshape(plan.rows, plan.cols), ((0, 0), (0, plan.padded_cols - plan.cols)))
    return x.reshape(plan.view)


def _ungrouped(m: np.ndarray, plan: _Plan) -> np.ndarray:
    if plan.padded_cols > plan.cols:
        m = m.reshape(plan.rows, plan.padded_cols)[:, : plan.cols]
    return m.reshape(-1)


def _bf16_ceil(x: np.ndarray) -> np.ndarray:
    """Smallest bf16-representable float32 >= x (x >= 0)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)).view(np.float32)


class QuantCodec:
    """A lossy :class:`~kvengine.chunks.codecs.Codec` (``lossless = False``; stateless, thread-safe).

    CHANNEL codecs reduce each tensor over its descriptor's ``token_dim`` when
    encoding, and read the axes back from the body when decoding.
    """

    lossless = False

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme
        self.codec_id = scheme.codec_id
        self.name = scheme.name
        self._channel = scheme.grouping is Grouping.CHANNEL

    def __repr__(self) -> str:
        return f"QuantCodec({self.name!r}, id={self.codec_id})"

    def encode(self, raw: memoryview, tensors: Sequence[TensorDescriptor]) -> bytes:
        """Framed scales and codes.

        :raises InvalidRequestError: on a length/shape mismatch or non-finite values.
        """
        view = expect_length(raw, sum(t.nbytes for t in tensors))
        axes = [_channel_axis(t, t.token_dim) if self._channel else 0 for t in tensors]
        parts: list[bytes | memoryview] = [bytes([_PER_TENSOR_AXES, *axes]) if self._channel else b""]
        pos = 0
        for t, axis in zip(tensors, axes):
            plan, chunk = _plan(t, self.scheme, axis, decoding=False), view[pos : pos + t.nbytes]
            pos += t.nbytes
            parts.extend(self._quantize(chunk, t.dtype_code, plan) if plan.quantized else [chunk])
        return seal(self.codec_id, parts)

    def decode(self, stored: memoryview, tensors: Sequence[TensorDescriptor]) -> memoryview:
        """Dequantized raw bytes in the original dtypes.

        :raises IntegrityError: on a bad frame, a body whose length disagrees
            with the descriptors, or invalid scales (``codec_layout``).
        """
        body = open_frame(self.codec_id, stored)
        axes, prefix = self._axes(body, tensors)
        plans = [_plan(t, self.scheme, axis, decoding=True) for t, axis in zip(tensors, axes)]
        need = prefix + sum(p.stored_bytes for p in plans)
        if need != len(body):
            raise IntegrityError("codec_layout", f"body is {len(body)} B, descriptors need {need} B")
        out = bytearray(sum(t.nbytes for t in tensors))
        target = memoryview(out)
        src, dst = prefix, 0
        for t, plan in zip(tensors, plans):
            chunk = body[src : src + plan.stored_bytes]
            if plan.quantized:
                target[dst : dst + t.nbytes] = self._dequantize(chunk, t.dtype_code, plan).view(np.uint8).data
            else:
                target[dst : dst + t.nbytes] = chunk
            src, dst = src + plan.stored_bytes, dst + t.nbytes
        return target

    def _axes(self, body: memoryview, tensors: Sequence[TensorDescriptor]) -> tuple[list[int], int]:
        """Each tensor's CHANNEL axis as the body records it, and the length of that prefix."""
        if not self._channel:
            return [0] * len(tensors), 0
        if not body:
            raise IntegrityError("codec_layout", "body is shorter than its prefix")
        if body[0] != _PER_TENSOR_AXES:  # an older writer's: one axis for every tensor
            return [_channel_axis(t, body[0]) for t in tensors], 1
        prefix = 1 + len(tensors)
        if len(body) < prefix:
            raise IntegrityError("codec_layout", "body is shorter than its prefix")
        axes = list(body[1:prefix])
        if any(axis >= max(len(t.shape), 1) for t, axis in zip(tensors, axes)):
            raise IntegrityError("codec_layout", f"{self.name}: axes {axes} outside the tensors' shapes")
        return axes, prefix

    def _quantize(self, chunk: memoryview, code: int, plan: _Plan) -> list[bytes]:
        m = _grouped(_to_f32(chunk, code), plan)  # a fresh array: worked on in place
        fmt = self.scheme.fmt
        amax = np.maximum(m.max(axis=1, keepdims=True), -m.min(axis=1, keepdims=True))
        scale = _bf16_ceil(amax / np.float32(fmt.qmax))
        if not np.isfinite(scale).all():
            raise InvalidRequestError(f"{self.name}: tensor holds non-finite or out-of-range values")
        scale[scale == 0] = 1.0
        np.divide(m, scale, out=m)
        if fmt is Format.FP8:
            np.clip(m, -_FP8_MAX, _FP8_MAX, out=m)
            codes = _fp8_codes(m.reshape(-1))
        else:
            np.clip(np.rint(m, out=m), -fmt.qmax, fmt.qmax, out=m)
            q = m.astype(np.int8)
            codes = q.tobytes() if fmt is Format.INT8 else _pack4(q.reshape(-1))
        return [(scale.view(np.uint32) >> 16).astype(np.uint16).tobytes(), codes]

    def _dequantize(self, chunk: memoryview, code: int, plan: _Plan) -> np.ndarray:
        split = 2 * plan.scale_count
        scale = (np.frombuffer(chunk[:split], np.uint16).astype(np.uint32) << 16).view(np.float32)
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise IntegrityError("codec_layout", f"{self.name}: invalid scale")
        codes = chunk[split:]
        fmt = self.scheme.fmt
        if fmt is Format.INT8:
            q = np.frombuffer(codes, np.int8).astype(np.float32)
        elif fmt is Format.INT4:
            q = _unpack4(codes, plan.code_count).astype(np.float32)
        else:
            q = _FP8_VALUES[np.frombuffer(codes, np.uint8)]
        m = q.reshape(plan.view)
        np.multiply(m, scale.reshape(plan.view[0], 1, plan.view[2]), out=m)
        return _from_f32(_ungrouped(m, plan), code)


def _fp8_codes(x: np.ndarray) -> bytes:
    """e4m3fn codes of finite float32 values within +-448 (round to nearest even)."""
    src = torch.from_numpy(x)
    out = torch.empty(src.numel(), dtype=torch.float8_e4m3fn)
    for start in range(0, src.numel(), _SERIAL_ELEMENTS):
        out[start : start + _SERIAL_ELEMENTS].copy_(src[start : start + _SERIAL_ELEMENTS])
    return out.view(torch.uint8).numpy().tobytes()


def _pack4(q: np.ndarray) -> bytes:
    nib = (q + 8).astype(np.uint8)
    if nib.size % 2:
        nib = np.append(nib, np.uint8(8))
    return (nib[0::2] | (nib[1::2] << 4)).tobytes()


def _unpack4(codes: memoryview, count: int) -> np.ndarray:
    packed = np.frombuffer(codes, np.uint8)
    nib = np.empty(2 * packed.size, np.int8)
    nib[0::2] = packed & 0x0F
    nib[1::2] = packed >> 4
    return nib[:count] - 8


def lossy_codecs() -> list[QuantCodec]:
    """One codec per stable lossy scheme (CHANNEL codecs reduce over each tensor's ``token_dim``)."""
    return [QuantCodec(scheme) for scheme in SCHEMES]
