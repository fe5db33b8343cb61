"""Payload codecs beyond raw: lossless shuffle+LZ4/zstd and opt-in lossy quantization.

Codec ids are stable and stored in every chunk header:

==========  ===================  ====================================
id          name                 what
==========  ===================  ====================================
0           raw                  :class:`kvengine.chunks.codecs.RawCodec`
1           lz4-byteshuffle      lossless, fastest decode
2           lz4-bitshuffle       lossless, fast, ~1.1x on bf16
3           zstd-byteshuffle     lossless, dense (~0.99 of the order-0 bound)
4           zstd-bitshuffle      lossless
16          int8-token           lossy, per token (and head) scale
17          int8-channel         lossy, per channel scale over the chunk's tokens
18          int4-token-g32       lossy, 4-bit, a scale per 32 values
19          int4-channel         lossy, 4-bit, per channel scale over the tokens
20          fp8-token            lossy, float8 e4m3 with per token scale
==========  ===================  ====================================

Lossless ids are 1..15 and lossy ids 16..255. Every codec of this package
frames its body with its id and a checksum (see ``_frame``), so corrupt,
truncated or foreign input raises :class:`~kvengine.errors.IntegrityError`.
"""

from __future__ import annotations

from kvengine.chunks.codecs import Codec, CodecRegistry, RawCodec

from .quantize import Format, Grouping, QuantCodec, QuantScheme, lossy_codecs

#: The lossless codecs, by name: they need blosc2, the ``[compression]`` extra (a C library and about
#: 17 packages), so a process without it still runs raw and lossy codecs and names what is missing.
LOSSLESS_NAMES = ("lz4-byteshuffle", "lz4-bitshuffle", "zstd-byteshuffle", "zstd-bitshuffle")
BLOSC2_MISSING = "it needs blosc2: pip install 'kvengine[compression]'"
try:
    from .lossless import BloscCodec, BloscScheme, Shuffle, lossless_codecs
except ModuleNotFoundError as exc:
    if exc.name != "blosc2":
        raise
    HAVE_BLOSC2 = False
else:
    HAVE_BLOSC2 = True

__all__ = [
    "HAVE_BLOSC2", "LOSSLESS_FAMILY", "LOSSLESS_NAMES", "BloscCodec", "BloscScheme", "Format", "Grouping", "QuantCodec", "QuantScheme",
    "Shuffle", "codec_family", "default_codecs", "error_bound", "lossless_codecs", "lossy_codecs",
]

#: ``Namespace.codec_family`` of every lossless codec (and the Namespace default).
LOSSLESS_FAMILY = "lossless"


def codec_family(codec: Codec) -> str:
    """The ``Namespace.codec_family`` that chunks written by ``codec`` belong to.

    All lossless codecs decode to the same bytes, so they share one family and
    a reader may meet any of them. Each lossy codec yields different KV, so
    each is its own family (``"lossy:<name>"``): an exact reader never sees
    lossy chunks, and two lossy schemes never mix.
    """
    return LOSSLESS_FAMILY if codec.lossless else f"lossy:{codec.name}"


#: Bound on ``|decoded - original|`` relative to the tensor's ``max|original|``, per lossy format: about
#: 2x the worst case. Symmetric int quantization errs by at most half a step, ``scale / 2`` with
#: ``scale = amax_group / qmax`` (bf16 scales rounded up: +0.4 %), and ``amax_group <= max|tensor|``:
#: int8 1/254, int4 1/14 -> bounds 1/127 and 1/7. fp8 e4m3 has 3 mantissa bits: half an ulp of the top
#: binade is 16 at 448, i.e. 1/28 of the group's maximum -> bound 1/16. Re-rounding the decoded values
#: to bf16 adds at most 1/512 of the maximum, inside the margin.
_ERROR_BOUNDS = {Format.INT8: 1 / 127, Format.INT4: 1 / 7, Format.FP8: 1 / 16}


def error_bound(codec: Codec) -> float | None:
    """Largest ``|decoded - original|`` a round trip through ``codec`` may cause in a floating tensor,
    relative to that tensor's largest magnitude: 0.0 for lossless codecs, the format's bound (with a
    2x margin) for :class:`QuantCodec`, None for a lossy codec whose error is unknown here."""
    if codec.lossless:
        return 0.0
    if isinstance(codec, QuantCodec):
        return _ERROR_BOUNDS[codec.scheme.fmt]
    return None


def default_codecs(threads: int = 2) -> CodecRegistry:
    """Registry of raw plus every codec of this package.

    ``threads``: blosc2 threads per lossless call. Per-channel lossy codecs
    take their scales over each tensor's token dimension (its descriptor's
    ``token_dim``), and any registry decodes any writer's chunks.
    """
    if not HAVE_BLOSC2:
        return CodecRegistry([RawCodec(), *lossy_codecs()], unavailable=dict.fromkeys(LOSSLESS_NAMES, BLOSC2_MISSING))
    return CodecRegistry([RawCodec(), *lossless_codecs(threads), *lossy_codecs()])
