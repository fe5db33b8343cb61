"""Chunked prefix hashing.

``h_i = xxh3_128(h_{i-1} || tokens of chunk i as little-endian uint32)`` with
``h_{-1}`` the namespace digest. The hash of chunk *i* therefore identifies
the whole prefix up to and including chunk *i*, in that namespace, on any
machine. Python's ``hash()`` is never used: it is salted per process.

Only full chunks are hashed by default. A partial trailing chunk changes
identity as soon as one more token arrives, so storing it would mostly write
entries that no later request can match (and evict useful ones to make room).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
import xxhash

from kvengine.chunks.keys import ChunkHash, NamespaceDigest
from kvengine.errors import InvalidRequestError

TokenInput = Sequence[int] | np.ndarray | torch.Tensor

_TOKEN_DTYPE = np.dtype("<u4")
_TOKEN_BYTES = 4


def token_bytes(tokens: TokenInput) -> memoryview:
    """Validate token ids and return them as contiguous little-endian uint32.

    Accepted: a 1-D integer ``torch.Tensor`` (on any device but ``meta``: it is
    copied to the CPU), a 1-D integer numpy array, or a sequence of ints (list,
    tuple, range, ``array.array``). Python's ``bool`` is an ``int``, so ``True``
    in a list is token 1; a bool array or tensor is refused (it is a mask).

    Raises :class:`InvalidRequestError` naming ``tokens`` for anything else:
    ``None``, a scalar, text or bytes, a mapping or set (no order of ids), an
    iterator or generator (checking it would consume it), empty input,
    non-integer values, ids outside ``[0, 2**32)`` or more than one dimension.
    """
    if isinstance(tokens, torch.Tensor):
        tokens = _tensor_to_numpy(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise InvalidRequestError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.dtype.kind not in "iu":
            raise InvalidRequestError(f"tokens must be integers, got dtype {tokens.dtype}")
        if tokens.size == 0:
            raise InvalidRequestError("tokens must not be empty")
        if tokens.dtype != _TOKEN_DTYPE:
            if int(tokens.min()) < 0 or int(tokens.max()) >= 2**32:
                raise InvalidRequestError("tokens: token ids must be in [0, 2**32)")
            tokens = tokens.astype(_TOKEN_DTYPE)
        return memoryview(np.ascontiguousarray(tokens).data).cast("B")
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise InvalidRequestError(f"tokens must be a sequence of token ids, not text or bytes "
                                  f"(got {type(tokens).__name__})")
    if not isinstance(tokens, Sequence):  # dict, set, None, int, generator, iterator, ...
        raise InvalidRequestError(f"tokens must be a list, tuple, numpy array or 1-D integer tensor of token ids, "
                                  f"got {type(tokens).__name__}")
    if len(tokens) == 0:
        raise InvalidRequestError("tokens must not be empty")
    try:
        # array('I') checks every element for int-ness and range in C: about
        # 7 ns a token, far cheaper than numpy's conversion of a list.
        packed = array.array("I", tokens)
    except (TypeError, OverflowError) as exc:
        raise InvalidRequestError(f"tokens: token ids must be integers in [0, 2**32): {exc}") from None
    if packed.itemsize != _TOKEN_BYTES:  # pragma: no cover - exotic C ABI
        packed = array.array("L", tokens)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return memoryview(packed).cast("B")


#: Tensor dtypes that hold token ids (bool is a mask, floats are not ids).
_INTEGER_TENSOR_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64,
                                    torch.uint8, torch.uint16, torch.uint32, torch.uint64))


def _tensor_to_numpy(tokens: torch.Tensor) -> np.ndarray:
    """A tensor of token ids as a numpy array (copied to the CPU first where it lives elsewhere)."""
    if tokens.is_meta:
        raise InvalidRequestError("tokens is a meta-device tensor, which holds no token ids")
    if tokens.layout is not torch.strided:
        raise InvalidRequestError(f"tokens must be a dense tensor, got layout {tokens.layout}")
    if tokens.dtype not in _INTEGER_TENSOR_DTYPES:  # checked before a device copy of what would be refused
        raise InvalidRequestError(f"tokens must be integers, got dtype {tokens.dtype}")
    return tokens.detach().cpu().numpy()


def check_max_tokens(max_tokens: object) -> int | None:
    """``max_tokens`` as an int, or None; :class:`InvalidRequestError` unless it is a non-negative integer."""
    return None if max_tokens is None else check_token_count(max_tokens, "max_tokens", accepted="an int or None")


def check_token_count(value: object, name: str, *, accepted: str = "an int") -> int:
    """``value`` as an int; :class:`InvalidRequestError` naming ``name`` unless it is a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidRequestError(f"{name} must be {accepted}, got {type(value).__name__} {value!r}")
    if value < 0:
        raise InvalidRequestError(f"{name} must be >= 0, got {value}")
    return int(value)


def prefix_hashes(
    tokens: TokenInput,
    chunk_size: int,
    seed: NamespaceDigest,
    *,
    partial: bool = False,
    max_tokens: int | None = None,
) -> list[ChunkHash]:
    """Chain hashes of the chunks of ``tokens`` (full chunks only by default).

    ``max_tokens`` stops hashing at that many tokens, for callers that need
    only a bounded prefix.
    """
    if chunk_size <= 0:
        raise InvalidRequestError(f"chunk_size must be positive, got {chunk_size}")
    max_tokens = check_max_tokens(max_tokens)
    data = token_bytes(tokens)
    n_tokens = len(data) // _TOKEN_BYTES
    if max_tokens is not None:
        n_tokens = min(n_tokens, max_tokens)
    step = chunk_size * _TOKEN_BYTES
    end = n_tokens * _TOKEN_BYTES
    stop = end if partial else end - end % step
    # A hasher fed the previous hash and then the chunk's slice: no concatenated copy of each chunk
    # (measured 1.5x faster than hashing ``prev + chunk`` on 256-token chunks).
    hasher = xxhash.xxh3_128
    prev = bytes(seed)
    out: list[bytes] = []
    for start in range(0, stop, step):
        h = hasher(prev)
        h.update(data[start : min(start + step, stop)])
        prev = h.digest()
        out.append(prev)
    return cast(list[ChunkHash], out)  # ChunkHash is bytes at run time: no call per chunk


def prefix_end_hash(tokens: TokenInput, chunk_size: int, seed: NamespaceDigest, end: int) -> ChunkHash:
    """The chain hash of the first ``end`` tokens: their last whole chunk's where ``end`` is a chunk boundary,
    else that of the partial chunk they end with (what keys a record of exactly that prefix)."""
    return prefix_hashes(tokens, chunk_size, seed, partial=True, max_tokens=end)[-1]


def chunk_tails(tokens: TokenInput, hashes: Sequence[ChunkHash], seed: bytes, chunk_size: int, step: int,
                chunk: int, asked: int) -> list[tuple[int, ChunkHash]]:
    """The tails of chunk number ``chunk`` (its leading runs of whole ``step`` tokens, shorter than the chunk and within
    the ``asked`` tokens) a hit may end with, longest first, as ``(end, chain hash)``: the keys a store with
    that step gives them. ``hashes``: the whole chunks' chain hashes (at least the ``chunk`` before it);
    ``seed``: the namespace digest. None without a step."""
    start = chunk * chunk_size
    ends = list(range(start + step, min(start + chunk_size, asked + 1), step)) if step else []
    if not ends:
        return []
    found = tail_hashes(tokens, hashes[chunk - 1] if chunk else seed, start, ends)
    return list(zip(reversed(ends), reversed(found)))


def tail_hashes(tokens: TokenInput, parent: bytes, start: int, ends: Sequence[int]) -> list[ChunkHash]:
    """Hashes of the partial chunks ``tokens[start:end]`` after ``parent`` (the chain hash of the chunk
    before ``start``, or the seed), one per ``end`` in ascending order: each equals the last of
    ``prefix_hashes(tokens[:end], ..., partial=True)``, from one incremental hasher."""
    data = token_bytes(tokens)
    hasher = xxhash.xxh3_128(parent)
    pos = start
    out: list[bytes] = []
    for end in ends:
        if end <= pos:
            raise InvalidRequestError(f"tail ends must ascend past {start}, got {list(ends)}")
        hasher.update(data[pos * _TOKEN_BYTES : end * _TOKEN_BYTES])
        out.append(hasher.copy().digest())
        pos = end
    return cast(list[ChunkHash], out)
