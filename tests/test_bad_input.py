"""Bad input at the Python API: a clear InvalidRequestError naming the argument, and nothing stored.

Every entry point that takes tokens (``lookup``, ``lookup_resident``, ``store``, ``begin_store``, on the
blocking :class:`KVEngine` and the asyncio :class:`CacheEngine`) validates them in one place, so each
case is checked through all of them.
"""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch

from kvengine import CacheEngine, InvalidRequestError, KVEngine, Namespace

from .conftest import CHUNK, FakeKV, copier, make_config, make_layout

N = 4 * CHUNK


def _generator():
    yield from range(N)


#: (id, tokens) that no entry point may accept.
BAD_TOKENS = [
    ("None", lambda: None),
    ("int", lambda: 5),
    ("generator", _generator),
    ("iterator", lambda: iter(range(N))),
    ("dict", lambda: {i: i for i in range(N)}),
    ("set", lambda: set(range(N))),
    ("str", lambda: "hello world"),
    ("bytes", lambda: bytes(range(N))),
    ("meta-tensor", lambda: torch.arange(N, device="meta")),
    ("float-tensor", lambda: torch.arange(N, dtype=torch.float32)),
    ("bool-tensor", lambda: torch.ones(N, dtype=torch.bool)),
    ("2-D tensor", lambda: torch.arange(N).view(4, CHUNK)),
    ("sparse-tensor", lambda: torch.arange(N).to_sparse()),
    ("float-list", lambda: [float(t) for t in range(N)]),
    ("negative-id", lambda: [-1] * N),
    ("empty", lambda: []),
]
ENTRY_POINTS = ["lookup", "lookup_resident", "store", "begin_store"]


@pytest.fixture
def kv():
    layout = make_layout()
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 16 * layout.nbytes()}}) as eng:
        yield eng, eng.bind(Namespace(model="bad-input"), layout)


def _call_sync(eng: KVEngine, binding, entry: str, tokens, **kwargs):
    if entry == "lookup":
        return eng.lookup(binding, "r", tokens, **kwargs)
    if entry == "lookup_resident":
        return eng.lookup_resident(binding, "r", tokens, **kwargs)
    if entry == "store":
        return eng.store(binding, tokens, FakeKV(N).source)
    return eng.begin_store(binding, tokens)


def _assert_nothing_stored(eng: KVEngine | CacheEngine) -> None:
    core = eng._core if isinstance(eng, KVEngine) else eng
    assert len(core.memory) == 0 and core.memory.total_pins() == 0
    assert len(core.reservations) == 0
    assert core.metrics.value("kvengine_stored_bytes_total", tier="memory") == 0


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name,make", BAD_TOKENS, ids=[b[0] for b in BAD_TOKENS])
def test_bad_tokens_are_refused_naming_tokens(kv, entry, name, make):
    """Regression: tokens given as None, an int, a generator or a meta tensor raised TypeError /
    NotImplementedError, and tokens given as a dict were accepted (a store of 4 chunks). Each is now an
    InvalidRequestError naming ``tokens``, through every entry point, with nothing stored or pinned."""
    eng, binding = kv
    with pytest.raises(InvalidRequestError, match="tokens"):
        _call_sync(eng, binding, entry, make())
    _assert_nothing_stored(eng)


def test_an_iterator_given_as_tokens_is_not_consumed(kv):
    """A generator is refused before anything reads it: the caller still has every token."""
    eng, binding = kv
    gen = _generator()
    with pytest.raises(InvalidRequestError, match="generator"):
        eng.store(binding, gen, FakeKV(N).source)
    assert next(gen) == 0


@pytest.mark.parametrize("entry", ["lookup", "lookup_resident"])
@pytest.mark.parametrize("max_tokens", [2.5, "16", True, float("nan"), -1], ids=repr)
def test_bad_max_tokens_is_refused_naming_it(kv, entry, max_tokens):
    """Regression: ``max_tokens=2.5`` and ``max_tokens="16"`` raised TypeError (and ``True`` was taken as 1).
    Each is now an InvalidRequestError naming ``max_tokens``; no reservation is made."""
    eng, binding = kv
    eng.store(binding, list(range(N)), FakeKV(N).source)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        _call_sync(eng, binding, entry, list(range(N)), max_tokens=max_tokens)
    assert len(eng._core.reservations) == 0 and eng._core.memory.total_pins() == 0


def test_integer_max_tokens_still_caps_the_lookup(kv):
    """Valid caps keep working: a Python int, a numpy integer, 0 and None."""
    eng, binding = kv
    toks = list(range(N))
    eng.store(binding, toks, FakeKV(N).source)
    for i, (cap, want) in enumerate([(2 * CHUNK + 3, 2 * CHUNK), (np.int64(CHUNK), CHUNK), (0, 0), (None, N)]):
        res = eng.lookup(binding, f"r{i}", toks, max_tokens=cap)
        assert res.tokens == want
        eng.release(res)


@pytest.mark.parametrize("tokens", [
    list(range(N)), tuple(range(N)), range(N), array.array("I", range(N)), np.arange(N, dtype=np.int32),
    np.arange(N, dtype=np.uint32), torch.arange(N), torch.arange(N, dtype=torch.int32),
], ids=["list", "tuple", "range", "array", "np-int32", "np-uint32", "tensor-int64", "tensor-int32"])
def test_every_supported_token_form_finds_the_same_chunks(kv, tokens):
    """Lists, tuples, ranges, arrays and integer tensors of the same ids name the same chunks."""
    eng, binding = kv
    eng.store(binding, list(range(N)), FakeKV(N).source)
    res = eng.lookup(binding, "r", tokens)
    assert res.tokens == N
    eng.release(res)


def _meta_source(index: int, start: int, end: int) -> list[torch.Tensor]:
    return [torch.empty(2, 2, end - start, 4, device="meta") for _ in range(2)]


def test_store_of_meta_source_tensors_is_refused_with_nothing_stored(kv):
    """Regression: a source returning meta-device tensors made ``store`` raise NotImplementedError from a
    copy. It is now an InvalidRequestError naming the tensor, and nothing is stored."""
    eng, binding = kv
    with pytest.raises(InvalidRequestError, match="layer0: a meta-device tensor"):
        eng.store(binding, list(range(N)), _meta_source)
    _assert_nothing_stored(eng)


def test_meta_tensors_midway_keep_the_chunks_before_and_commit_nothing_of_theirs(kv):
    """Scenario: the source's third chunk is meta tensors. The two chunks before it are stored whole (as for
    any source that fails midway) and load exact; nothing of the third or later chunks is committed."""
    eng, binding = kv
    kv_data = FakeKV(N)

    def source(index: int, start: int, end: int) -> list[torch.Tensor]:
        return _meta_source(index, start, end) if index == 2 else kv_data.source(index, start, end)

    with pytest.raises(InvalidRequestError, match="meta-device"):
        eng.store(binding, list(range(N)), source)
    assert len(eng._core.memory) == 2
    res = eng.lookup(binding, "r", list(range(N)))
    assert res.tokens == 2 * CHUNK
    out = [torch.zeros_like(t) for t in kv_data.layers]
    assert eng.load(res, copier(out)).loaded_tokens == 2 * CHUNK
    assert all(torch.equal(o[:, :, : 2 * CHUNK], k[:, :, : 2 * CHUNK]) for o, k in zip(out, kv_data.layers))


@pytest.mark.parametrize("name,make", BAD_TOKENS[:9], ids=[b[0] for b in BAD_TOKENS[:9]])
async def test_the_async_core_refuses_the_same_tokens(name, make):
    """The asyncio CacheEngine's entry points refuse bad tokens the same way (one validation for all)."""
    layout = make_layout()
    eng = CacheEngine(make_config(capacity=16 * layout.nbytes()))
    await eng.start()
    try:
        binding = eng.bind(Namespace(model="bad-input"), layout)
        with pytest.raises(InvalidRequestError, match="tokens"):
            await eng.lookup(binding, "r", make())
        with pytest.raises(InvalidRequestError, match="tokens"):
            eng.lookup_resident(binding, "r", make())
        with pytest.raises(InvalidRequestError, match="tokens"):
            await eng.store(binding, make(), FakeKV(N).source)
        with pytest.raises(InvalidRequestError, match="tokens"):
            await eng.begin_store(binding, make())
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await eng.lookup(binding, "r", list(range(N)), max_tokens="16")  # type: ignore[arg-type]
        _assert_nothing_stored(eng)
    finally:
        await eng.close()
