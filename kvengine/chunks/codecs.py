"""Payload codecs. The codec id is recorded in every chunk header.

A codec turns a chunk's raw tensor bytes into stored bytes and back. The
reader decodes with the codec the header names; an unknown id or a decode
error is a miss (:class:`IntegrityError`), never data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvengine.chunks.record import TensorDescriptor
from kvengine.errors import IntegrityError


class Codec(Protocol):
    #: Stable id written into record headers (0 is reserved for raw).
    codec_id: int
    name: str
    #: True if decode(encode(x)) == x bit for bit.
    lossless: bool

    def encode(self, raw: memoryview, tensors: Sequence[TensorDescriptor]) -> bytes | memoryview:
        """Stored bytes for ``raw`` (the concatenated tensors described by ``tensors``)."""
        ...

    def decode(self, stored: memoryview, tensors: Sequence[TensorDescriptor]) -> bytes | memoryview:
        """Raw bytes (``sum(t.nbytes)`` long); raises IntegrityError if ``stored`` is bad."""
        ...


class RawCodec:
    """No transformation (the memory tier's and the default format)."""

    codec_id = 0
    name = "raw"
    lossless = True

    def encode(self, raw: memoryview, tensors: Sequence[TensorDescriptor]) -> memoryview:
        return raw

    def decode(self, stored: memoryview, tensors: Sequence[TensorDescriptor]) -> memoryview:
        raw_length = sum(t.nbytes for t in tensors)
        if len(stored) != raw_length:
            raise IntegrityError("codec_length", f"raw payload {len(stored)} B, expected {raw_length}")
        return stored


class CodecRegistry:
    """Codecs known to this process, by id and by name. Pass it where needed."""

    def __init__(self, codecs: list[Codec] | None = None, *, unavailable: dict[str, str] | None = None) -> None:
        self._by_id: dict[int, Codec] = {}
        self._by_name: dict[str, Codec] = {}
        #: Codecs this process knows of but cannot run, with what is missing (asked for: a clear error).
        self._unavailable = dict(unavailable or {})
        for codec in codecs or [RawCodec()]:
            self.add(codec)

    def add(self, codec: Codec) -> None:
        if codec.codec_id in self._by_id:
            raise ValueError(f"codec id {codec.codec_id} already registered")
        self._by_id[codec.codec_id] = codec
        self._by_name[codec.name] = codec

    def by_name(self, name: str) -> Codec:
        try:
            return self._by_name[name]
        except KeyError:
            if name in self._unavailable:
                raise ValueError(f"codec {name!r} is not available here: {self._unavailable[name]}") from None
            raise ValueError(f"unknown codec {name!r}; known: {sorted(self._by_name)}") from None

    def by_id(self, codec_id: int) -> Codec:
        try:
            return self._by_id[codec_id]
        except KeyError:
            raise IntegrityError("unknown_codec", f"codec id {codec_id}") from None

    def names(self) -> list[str]:
        return sorted(self._by_name)
