"""Lossless codecs: a byte or bit shuffle, then LZ4 or zstd, via python-blosc2.

Shuffling groups the bytes (or bits) of equal significance of every element,
so the exponent bytes of float KV, the only compressible part, sit together.
blosc2 does this with SIMD and splits the work over ``threads`` threads.

Body layout: one blosc2 chunk per *segment*, back to back. Segments are
derived from the descriptors alone: consecutive tensors of equal item size
form one run (the shuffle's typesize), and runs longer than
:data:`MAX_SEGMENT_BYTES` are cut. The decoder derives the same segments and
checks each chunk's announced sizes before decompressing into place.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import blosc2

from kvengine.chunks.layout import dtype_from_code
from kvengine.chunks.record import TensorDescriptor
from kvengine.errors import IntegrityError, InvalidRequestError

from ._frame import expect_length, open_frame, seal

#: Largest raw span compressed as one blosc2 chunk (blosc2's limit is ~2 GiB).
MAX_SEGMENT_BYTES = 1 << 30
_BLOSC_HEADER_BYTES = 32


class Shuffle(enum.Enum):
    BYTE = "byteshuffle"
    BIT = "bitshuffle"


@dataclass(frozen=True, slots=True, kw_only=True)
class BloscScheme:
    """One stable lossless format: which compressor, which shuffle."""

    codec_id: int
    compressor: str  # "lz4" or "zstd"
    shuffle: Shuffle
    #: blosc2 block size in bytes (0: blosc2 chooses), and whether a block is
    #: compressed as one stream per byte plane (ALWAYS), as one stream (NEVER)
    #: or as blosc2 decides (AUTO). Encoder-side knobs measured per scheme
    #: (benchmarks/bench_codecs.py); each chunk header records them, so
    #: changing them never breaks stored data.
    blocksize: int = 0
    split: blosc2.SplitMode = blosc2.SplitMode.AUTO_SPLIT

    def __post_init__(self) -> None:
        if not 1 <= self.codec_id < 16:
            raise ValueError(f"lossless codec ids are 1..15, got {self.codec_id}")
        if self.compressor not in ("lz4", "zstd"):
            raise ValueError(f"unknown compressor {self.compressor!r}")

    @property
    def name(self) -> str:
        return f"{self.compressor}-{self.shuffle.value}"


#: The stable lossless formats. Never renumber: ids are stored in records.
SCHEMES: tuple[BloscScheme, ...] = (
    BloscScheme(codec_id=1, compressor="lz4", shuffle=Shuffle.BYTE),
    BloscScheme(codec_id=2, compressor="lz4", shuffle=Shuffle.BIT, split=blosc2.SplitMode.ALWAYS_SPLIT),
    # One zstd stream per 512 KiB block: measured as dense as one stream per
    # byte plane on bf16 KV and about 20% faster to compress.
    BloscScheme(codec_id=3, compressor="zstd", shuffle=Shuffle.BYTE, blocksize=1 << 19,
                split=blosc2.SplitMode.NEVER_SPLIT),
    BloscScheme(codec_id=4, compressor="zstd", shuffle=Shuffle.BIT, blocksize=1 << 20,
                split=blosc2.SplitMode.ALWAYS_SPLIT),
)


def segments(tensors: Sequence[TensorDescriptor]) -> Iterator[tuple[int, int, int]]:
    """``(start, stop, itemsize)`` spans of the raw payload, one blosc2 chunk each."""
    start = stop = 0
    itemsize = 0
    for t in tensors:
        try:
            size = dtype_from_code(t.dtype_code).itemsize
        except KeyError:
            raise InvalidRequestError(f"unknown dtype code {t.dtype_code}") from None
        if size != itemsize and stop > start:
            yield from _cut(start, stop, itemsize)
            start = stop
        itemsize = size
        stop += t.nbytes
    if stop > start:
        yield from _cut(start, stop, itemsize)


def _cut(start: int, stop: int, itemsize: int) -> Iterator[tuple[int, int, int]]:
    step = MAX_SEGMENT_BYTES - MAX_SEGMENT_BYTES % itemsize
    for a in range(start, stop, step):
        yield a, min(a + step, stop), itemsize


class BloscCodec:
    """A lossless :class:`~kvengine.chunks.codecs.Codec` over python-blosc2 (thread-safe)."""

    lossless = True

    def __init__(self, scheme: BloscScheme, *, threads: int = 2, clevel: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.scheme = scheme
        self.codec_id = scheme.codec_id
        self.name = scheme.name
        self.threads = threads
        self._dparams = blosc2.DParams(nthreads=threads)
        self._cparams = {
            size: blosc2.CParams(
                codec=blosc2.Codec.ZSTD if scheme.compressor == "zstd" else blosc2.Codec.LZ4,
                clevel=clevel,
                typesize=size,
                nthreads=threads,
                blocksize=scheme.blocksize,
                splitmode=scheme.split,
                filters=[blosc2.Filter.SHUFFLE if scheme.shuffle is Shuffle.BYTE else blosc2.Filter.BITSHUFFLE],
                filters_meta=[0],
            )
            for size in (1, 2, 4, 8)
        }

    def __repr__(self) -> str:
        return f"BloscCodec({self.name!r}, id={self.codec_id}, threads={self.threads})"

    def encode(self, raw: memoryview, tensors: Sequence[TensorDescriptor]) -> bytes:
        """Frame of blosc2 chunks, one per segment.

        :raises InvalidRequestError: if ``raw`` is not as long as ``tensors`` say.
        """
        view = expect_length(raw, sum(t.nbytes for t in tensors))
        chunks = [blosc2.compress2(view[a:b], cparams=self._cparams[size]) for a, b, size in segments(tensors)]
        return seal(self.codec_id, chunks)

    def decode(self, stored: memoryview, tensors: Sequence[TensorDescriptor]) -> memoryview:
        """Raw bytes of ``tensors``.

        :raises IntegrityError: on a bad frame (see ``open_frame``), a chunk
            whose sizes disagree with the descriptors (``codec_layout``), a
            decompression error (``codec_decode``) or trailing bytes.
        """
        body = open_frame(self.codec_id, stored)
        out = bytearray(sum(t.nbytes for t in tensors))
        target = memoryview(out)
        pos = 0
        for a, b, _ in segments(tensors):
            if len(body) - pos < _BLOSC_HEADER_BYTES:
                raise IntegrityError("codec_layout", f"chunk for bytes {a}..{b} is missing")
            nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(body[pos : pos + _BLOSC_HEADER_BYTES])
            if nbytes != b - a or not _BLOSC_HEADER_BYTES <= cbytes <= len(body) - pos:
                raise IntegrityError(
                    "codec_layout", f"chunk announces {nbytes} B raw / {cbytes} B stored, expected {b - a} B raw"
                )
            try:
                blosc2.decompress2(body[pos : pos + cbytes], dst=target[a:b], dparams=self._dparams)
            except (ValueError, RuntimeError) as exc:
                raise IntegrityError("codec_decode", f"{self.name}: {exc}") from None
            pos += cbytes
        if pos != len(body):
            raise IntegrityError("codec_layout", f"{len(body) - pos} trailing bytes after the last chunk")
        return target


def lossless_codecs(threads: int = 2) -> list[BloscCodec]:
    """One codec per stable lossless scheme."""
    return [BloscCodec(scheme, threads=threads) for scheme in SCHEMES]
