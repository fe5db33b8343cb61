"""Chunked prefix hashing: stability, chain property, input validation, speed-insensitive."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from kvengine.chunks.hashing import chunk_tails, prefix_end_hash, prefix_hashes
from kvengine.chunks.keys import Namespace
from kvengine.errors import InvalidRequestError

SEED = Namespace(model="m").digest()


def test_same_tokens_same_hashes_across_input_types():
    """A list, a numpy array and a torch tensor of the same ids hash identically."""
    toks = list(range(1000))
    a = prefix_hashes(toks, 256, SEED)
    assert a == prefix_hashes(np.array(toks, dtype=np.int64), 256, SEED)
    assert a == prefix_hashes(torch.tensor(toks), 256, SEED)
    assert a == prefix_hashes(np.array(toks, dtype=np.uint32), 256, SEED)
    assert len(a) == 3 and all(len(h) == 16 for h in a)


@pytest.mark.parametrize("partial", [False, True])
def test_hashes_follow_the_documented_definition(partial: bool) -> None:
    """h_i = xxh3_128(h_{i-1} || chunk i as little-endian uint32), h_{-1} the namespace digest: stored keys
    depend on it, so a faster implementation must not change a bit."""
    import xxhash

    toks = list(range(100_000, 100_700))
    data = np.array(toks, dtype="<u4").tobytes()
    prev, want = SEED, []
    stop = len(data) if partial else len(data) - len(data) % 1024
    for start in range(0, stop, 1024):
        prev = xxhash.xxh3_128_digest(prev + data[start:min(start + 1024, stop)])
        want.append(prev)
    assert prefix_hashes(toks, 256, SEED, partial=partial) == want and len(want) == (3 if partial else 2)


def test_chain_depends_on_whole_prefix():
    """Changing one token of chunk 0 changes every later hash; changing chunk 2 keeps 0 and 1."""
    toks = list(range(1024))
    base = prefix_hashes(toks, 256, SEED)
    early = toks.copy()
    early[3] = 7
    late = toks.copy()
    late[600] = 7
    assert all(x != y for x, y in zip(base, prefix_hashes(early, 256, SEED)))
    changed = prefix_hashes(late, 256, SEED)
    assert changed[:2] == base[:2] and changed[2] != base[2] and changed[3] != base[3]


def test_namespace_seeds_the_chain():
    """Different namespaces never share a chunk hash, even for identical tokens."""
    toks = list(range(512))
    other = Namespace(model="m", cache_salt="tenant-b").digest()
    assert set(prefix_hashes(toks, 256, SEED)).isdisjoint(prefix_hashes(toks, 256, other))


@pytest.mark.parametrize("field,value", [
    ("model_fingerprint", "w2"), ("kv_spec_fingerprint", "s2"), ("layout_id", "NHD"), ("rank", 1),
    ("cache_salt", "x"), ("adapter_id", "lora1"), ("extra_keys", ("img:abc",)), ("verified", False),
    ("codec_family", "lossy-int8"),
])
def test_every_namespace_field_changes_the_digest(field, value):
    """Each field that changes KV bytes or meaning is part of the digest."""
    base = Namespace(model="m", world_size=2)
    assert base.with_updates(**{field: value}).digest() != base.digest()


def test_partial_chunk_only_on_request():
    """A trailing partial chunk is hashed only when asked for."""
    toks = list(range(300))
    assert len(prefix_hashes(toks, 256, SEED)) == 1
    assert len(prefix_hashes(toks, 256, SEED, partial=True)) == 2


def test_max_tokens_bounds_the_chain():
    """max_tokens stops the chain: only the chunks wholly inside the first max_tokens tokens are hashed."""
    toks = list(range(1024))
    assert prefix_hashes(toks, 256, SEED, max_tokens=700) == prefix_hashes(toks, 256, SEED)[:2]


def test_stable_across_processes():
    """The digest does not depend on the process (no builtin hash(), no salt)."""
    code = ("from kvengine.chunks.hashing import prefix_hashes; from kvengine.chunks.keys import Namespace;"
            "print(prefix_hashes(list(range(600)), 256, Namespace(model='m').digest())[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"}).stdout.strip()
    assert out == prefix_hashes(list(range(600)), 256, SEED)[1].hex()


@pytest.mark.parametrize("bad", [[], [1, -2], [1.5, 2], [2**32], "hello", np.zeros((2, 2), dtype=np.int64),
                                 np.array([0.5]), torch.tensor([])])
def test_bad_tokens_raise_clear_error(bad):
    """Empty, negative, non-integer, over-32-bit, string, 2-D or float token ids raise InvalidRequestError."""
    with pytest.raises(InvalidRequestError):
        prefix_hashes(bad, 256, SEED)


def test_chunk_tails_are_the_partial_chains_of_the_broken_chunk_longest_first():
    """A chunk's tail candidates: its leading whole steps, shorter than the chunk and within the tokens asked,
    each hashed as a partial last chunk would be, longest first; none without a step or room for one."""
    seed = SEED
    tokens = list(range(100, 150))  # 3 whole chunks of 16, then 2 tokens
    hashes = prefix_hashes(tokens, 16, seed)
    got = chunk_tails(tokens, hashes, seed, 16, 4, 1, 30)  # chunk 1 (tokens 16..31), 30 tokens asked
    assert [end for end, _ in got] == [28, 24, 20]
    assert all(h == prefix_hashes(tokens[:end], 16, seed, partial=True)[-1] for end, h in got)
    assert [end for end, _ in chunk_tails(tokens, hashes, seed, 16, 4, 0, 50)] == [12, 8, 4]
    assert chunk_tails(tokens, hashes, seed, 16, 0, 1, 50) == []
    assert chunk_tails(tokens, hashes, seed, 16, 4, 3, 50) == []  # 48..50: no whole step


@pytest.mark.parametrize("end", [256, 512, 300, 511, 1])
def test_the_hash_of_a_prefix_is_its_chunk_hash_at_a_chunk_boundary_else_its_partial_chunks(end):
    """prefix_end_hash keys a record of exactly the first ``end`` tokens: the last whole chunk's chain hash
    where ``end`` ends a chunk, else the hash of the partial chunk after the whole ones (a tail's key)."""
    tokens = list(range(600))
    got = prefix_end_hash(tokens, 256, SEED, end)
    if end % 256 == 0:
        assert got == prefix_hashes(tokens, 256, SEED)[end // 256 - 1]
    assert got == prefix_hashes(tokens[:end], 256, SEED, partial=True)[-1]
    assert got != prefix_end_hash(tokens, 256, SEED, end - 1 if end > 1 else end + 1)
