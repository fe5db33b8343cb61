"""What one chunk holds: the ordered tensors a model stores per chunk.

A :class:`ChunkLayout` is the contract between an integration (which knows
the model's cache structures) and the engine (which only moves bytes). It
fixes the order, dtype and shape of every tensor of a full chunk; the engine
refuses any store that does not match it exactly.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
import xxhash

from kvengine.errors import InvalidRequestError


class KVCategory(enum.IntEnum):
    """Kinds of per-layer cache state. Values are stored in record headers."""

    FULL_ATTENTION = 1
    MLA_LATENT = 2
    SLIDING_WINDOW = 3
    CHUNKED_LOCAL = 4
    ATTENTION_SINK = 5
    LINEAR_STATE = 6
    CROSS_ATTENTION = 7
    ENCODER_ONLY = 8
    OPAQUE = 15  # bytes whose meaning only the writer knows (e.g. engine pages)


_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.uint8: 1,
    torch.int8: 2,
    torch.int16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.float16: 6,
    torch.bfloat16: 7,
    torch.float32: 8,
    torch.float64: 9,
    torch.float8_e4m3fn: 10,
    torch.float8_e5m2: 11,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@lru_cache(maxsize=1024)
def _strides(shape: torch.Size) -> tuple[int, ...]:
    """Contiguous (row-major) strides of ``shape``."""
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise InvalidRequestError(
            f"dtype {dtype} is not storable; allowed: {sorted(str(d) for d in _DTYPE_CODES)}"
        ) from None


def dtype_from_code(code: int) -> torch.dtype:
    return _CODE_DTYPES[code]


def is_known_dtype_code(code: int) -> bool:
    return code in _CODE_DTYPES


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """One tensor of a chunk.

    ``shape`` is the shape for a full chunk. ``token_dim`` names the dimension
    that grows with the number of tokens (None for state snapshots, whose size
    does not depend on the chunk length).
    """

    name: str
    group: int
    category: KVCategory
    dtype: torch.dtype
    shape: tuple[int, ...]
    token_dim: int | None = 0

    def __post_init__(self) -> None:
        dtype_code(self.dtype)
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise InvalidRequestError(f"{self.name}: shape must be non-empty and positive, got {self.shape}")
        if self.token_dim is not None and not 0 <= self.token_dim < len(self.shape):
            raise InvalidRequestError(f"{self.name}: token_dim {self.token_dim} outside shape {self.shape}")
        if not 0 <= self.group < 2**16:
            raise InvalidRequestError(f"{self.name}: group must fit in 16 bits")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def shape_for(self, tokens: int, chunk_size: int) -> tuple[int, ...]:
        """Shape of this tensor in a chunk of ``tokens`` tokens."""
        if self.token_dim is None or tokens == chunk_size:
            return self.shape
        full = self.shape[self.token_dim]
        if full % chunk_size:
            raise InvalidRequestError(f"{self.name}: token dim {full} is not a multiple of chunk size {chunk_size}")
        shape = list(self.shape)
        shape[self.token_dim] = full // chunk_size * tokens
        return tuple(shape)


@dataclass(frozen=True)
class ChunkLayout:
    """Ordered tensors of one chunk of ``chunk_size`` tokens."""

    chunk_size: int
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise InvalidRequestError(f"chunk_size must be positive, got {self.chunk_size}")
        if not self.tensors:
            raise InvalidRequestError("a ChunkLayout needs at least one tensor")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tensor names in a ChunkLayout must be unique")
        offset = 0
        for spec, size in zip(self.tensors, self.full_sizes):
            # Typed views into host memory need each tensor at a multiple of its item size.
            if offset % spec.itemsize:
                raise InvalidRequestError(
                    f"{spec.name}: byte offset {offset} is not a multiple of its item size "
                    f"{spec.itemsize}; order tensors by decreasing item size"
                )
            offset += size

    def nbytes(self, tokens: int | None = None) -> int:
        """Payload bytes of a chunk (a full one unless ``tokens`` is given)."""
        if tokens is None or tokens == self.chunk_size:
            return self.full_nbytes
        return sum(self.sizes(tokens))

    @cached_property
    def full_nbytes(self) -> int:
        return sum(self.full_sizes)

    @cached_property
    def full_sizes(self) -> tuple[int, ...]:
        return tuple(self._sizes(self.chunk_size))

    def sizes(self, tokens: int | None = None) -> tuple[int, ...]:
        """Bytes of each tensor in a chunk of ``tokens`` tokens (full by default)."""
        if tokens is None or tokens == self.chunk_size:
            return self.full_sizes
        return tuple(self._sizes(tokens))

    @cached_property
    def full_shapes(self) -> tuple[torch.Size, ...]:
        return tuple(torch.Size(t.shape) for t in self.tensors)

    def shapes(self, tokens: int | None = None) -> tuple[torch.Size, ...]:
        """Shape of each tensor in a chunk of ``tokens`` tokens (full by default)."""
        if tokens is None or tokens == self.chunk_size:
            return self.full_shapes
        return tuple(torch.Size(t.shape_for(tokens, self.chunk_size)) for t in self.tensors)

    def _sizes(self, n: int) -> list[int]:
        out = []
        for spec in self.tensors:
            numel = 1
            for d in spec.shape_for(n, self.chunk_size):
                numel *= d
            out.append(numel * spec.itemsize)
        return out

    @cached_property
    def fingerprint(self) -> str:
        """Stable digest of the layout, for the namespace."""
        desc = [
            [t.name, t.group, int(t.category), str(t.dtype), list(t.shape), t.token_dim]
            for t in self.tensors
        ]
        raw = json.dumps([self.chunk_size, desc], separators=(",", ":")).encode()
        return xxhash.xxh3_128_hexdigest(raw)

    def uniform(self) -> bool:
        """True when every tensor has the same dtype and full-chunk shape (fast paths apply)."""
        first = self.tensors[0]
        return all(t.dtype == first.dtype and t.shape == first.shape and t.token_dim == first.token_dim
                   for t in self.tensors)

    def views(
        self, typed: Callable[[torch.dtype], torch.Tensor], byte_offset: int, tokens: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Typed views of a chunk stored at ``byte_offset`` of an arena.

        ``typed(dtype)`` returns the whole arena viewed as ``dtype``; each view
        is one ``as_strided`` call (this runs once per stored chunk).
        """
        shapes = self.shapes(tokens)
        if self._uniform:
            first = self.tensors[0]
            arena = typed(first.dtype)
            start = byte_offset // first.itemsize
            if len(self.tensors) == 1:
                return (arena.as_strided(shapes[0], _strides(shapes[0]), start),)
            shape = torch.Size((len(self.tensors), *shapes[0]))
            return arena.as_strided(shape, _strides(shape), start).unbind(0)
        out = []
        offset = byte_offset
        for spec, shape, size in zip(self.tensors, shapes, self.sizes(tokens)):
            out.append(typed(spec.dtype).as_strided(shape, _strides(shape), offset // spec.itemsize))
            offset += size
        return tuple(out)

    @cached_property
    def _uniform(self) -> bool:
        return self.uniform()

    def check(self, tensors: Sequence[torch.Tensor], tokens: int | None = None) -> None:
        """Raise :class:`InvalidRequestError` unless ``tensors`` match this layout."""
        if len(tensors) != len(self.tensors):
            raise InvalidRequestError(f"expected {len(self.tensors)} tensors per chunk, got {len(tensors)}")
        for spec, want, tensor in zip(self.tensors, self.shapes(tokens), tensors):
            if not isinstance(tensor, torch.Tensor):
                raise InvalidRequestError(f"{spec.name}: expected a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dtype != spec.dtype or tensor.shape != want:
                raise InvalidRequestError(
                    f"{spec.name}: expected {spec.dtype} {want}, got {tensor.dtype} {tuple(tensor.shape)}"
                )
            if tensor.is_meta:  # shaped right, but there are no bytes to copy
                raise InvalidRequestError(f"{spec.name}: a meta-device tensor holds no data to store")
