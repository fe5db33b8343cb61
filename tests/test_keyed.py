"""Tests of kvengine.keyed, the keyed-chunk store under the SGLang backend.

These need no SGLang and run in the main .venv.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvengine import ChunkLayout, InvalidRequestError, KVCategory, KVEngine, Namespace, TensorSpec
from kvengine.keyed import (
    GetOutcome,
    KeyedStore,
    PutOutcome,
    SyncKeyedStore,
    key_scheme,
    keyed_chunk_key,
    keyed_namespace,
)
from kvengine.transports.local_disk import create_transport
from kvengine.types import ModelBinding
from tests.core.test_tiering import DictTransport

PAGE = 8
SCHEME = "test-keys"


def page_layout(dtype: torch.dtype = torch.float32) -> ChunkLayout:
    return ChunkLayout(PAGE, tuple(
        TensorSpec(name=n, group=0, category=KVCategory.FULL_ATTENTION, dtype=dtype, shape=(PAGE, 2, 4))
        for n in ("k", "v")))


def pages(n: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(PAGE, 2, 4, generator=g) for _ in range(2)] for _ in range(n)]


def keys(n: int, prefix: str = "page") -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


class Collect:
    """A sink that clones what it is given."""

    def __init__(self) -> None:
        self.got: dict[int, list[torch.Tensor]] = {}

    def __call__(self, i: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.got[i] = [t.clone() for t in tensors]


def open_engine(tmp_path: Path | None = None, *, capacity: str = "1MiB", namespace: Namespace | None = None):
    ns = namespace or keyed_namespace(Namespace(model="keyed-test"), SCHEME)
    layout = page_layout()
    binding = ModelBinding.create(ns, layout)
    transports = None
    if tmp_path is not None:
        transports = [create_transport({"path": str(tmp_path), "capacity_bytes": "16MiB", "fsync": "never",
                                        "namespaces": [binding.digest.hex()]})]
    kv = KVEngine({"chunk_size": PAGE, "memory": {"capacity_bytes": capacity, "slab_bytes": "64KiB"}},
                  transports=transports or [])
    kv.bind(ns, layout)
    return kv, SyncKeyedStore(kv, binding)


def test_put_get_exists_round_trip_in_memory() -> None:
    """Scenario: pages put under caller keys come back bit-exact; unknown keys miss."""
    kv, store = open_engine()
    try:
        data = pages(4)
        assert store.exists(keys(4)) == [False] * 4
        assert store.put(keys(4), lambda i: data[i]) == [PutOutcome.STORED] * 4
        assert store.exists([*keys(4), b"other"]) == [True] * 4 + [False]
        sink = Collect()
        out = store.get([keys(4)[2], b"other", keys(4)[0]], sink)
        assert out == [GetOutcome.HIT, GetOutcome.MISS, GetOutcome.HIT]
        assert all(torch.equal(a, b) for a, b in zip(sink.got[0], data[2]))
        assert all(torch.equal(a, b) for a, b in zip(sink.got[2], data[0]))
        assert kv._core.memory.total_pins() == 0
    finally:
        kv.close()


def test_second_put_is_present_and_source_not_called() -> None:
    """Scenario: re-putting stored keys copies nothing (the source is never asked)."""
    kv, store = open_engine()
    try:
        data = pages(2)
        store.put(keys(2), lambda i: data[i])
        calls: list[int] = []
        out = store.put(keys(3), lambda i: calls.append(i) or pages(3, seed=1)[i])
        assert out == [PutOutcome.PRESENT, PutOutcome.PRESENT, PutOutcome.STORED]
        assert calls == [2]
    finally:
        kv.close()


def test_wrong_tensors_raise_and_store_nothing() -> None:
    """Caller mistake: tensors that do not match the layout raise; the key stays absent."""
    kv, store = open_engine()
    try:
        with pytest.raises(InvalidRequestError):
            store.put([b"bad"], lambda i: [torch.zeros(PAGE, 2, 4, dtype=torch.float16)] * 2)
        assert store.exists([b"bad"]) == [False]
        assert kv._core.memory.total_pins() == 0
    finally:
        kv.close()


def test_a_source_that_fails_part_way_still_hands_the_stored_pages_to_the_lower_tier(tmp_path: Path) -> None:
    """One store-failure behaviour on every store path: the pages copied before the source raised are
    committed and reach the disk tier (as with a prefix store); the error reaches the caller; no pin leaks."""
    kv, store = open_engine(tmp_path)
    data = pages(2)

    def source(i: int) -> list[torch.Tensor]:
        if i == 2:
            raise RuntimeError("the engine's buffer went away")
        return data[i]

    try:
        with pytest.raises(RuntimeError, match="went away"):
            store.put(keys(3), source)
        kv.flush()
        assert kv._core.memory.total_pins() == 0
        assert store.exists(keys(3)) == [True, True, False]
    finally:
        kv.close()
    kv, store = open_engine(tmp_path)  # a fresh engine: only the disk tier has them
    try:
        assert store.get(keys(2), Collect()) == [GetOutcome.HIT] * 2
    finally:
        kv.close()


def test_full_memory_reports_no_room_for_the_rest() -> None:
    """Scenario: a put larger than memory stores a head and reports NO_ROOM for the rest (counted)."""
    kv, store = open_engine(capacity="64KiB")
    try:
        n = 256  # 256 pages x 512 B of payload: more than 64 KiB of memory
        out = store.put(keys(n), lambda i: pages(1, seed=i)[0])
        assert out[0] is PutOutcome.STORED and out[-1] is PutOutcome.NO_ROOM
        first_no_room = out.index(PutOutcome.NO_ROOM)
        assert set(out[first_no_room:]) == {PutOutcome.NO_ROOM}
        assert kv.metrics.value("kvengine_store_rejected_total", reason="no_room") == n - first_no_room
        assert kv._core.memory.total_pins() == 0
    finally:
        kv.close()


def test_pages_survive_a_restart_through_the_disk_tier(tmp_path: Path) -> None:
    """Scenario: a second engine on the same directory finds the pages and promotes them into memory."""
    data = pages(3)
    kv, store = open_engine(tmp_path)
    store.put(keys(3), lambda i: data[i])
    kv.close()  # flushes write-behind
    kv, store = open_engine(tmp_path)
    try:
        assert store.exists(keys(3)) == [True] * 3
        sink = Collect()
        assert store.get(keys(3), sink) == [GetOutcome.HIT] * 3
        for i in range(3):
            assert all(torch.equal(a, b) for a, b in zip(sink.got[i], data[i]))
        assert kv._core.memory.contains(keyed_chunk_key(store.binding, keys(3)[0]))
        assert kv.metrics.value("kvengine_loaded_bytes_total", tier="local_disk") > 0
    finally:
        kv.close()


def test_corrupt_disk_record_is_a_counted_miss(tmp_path: Path) -> None:
    """Scenario: a record whose payload was damaged on disk is a miss, counted, never served."""
    data = pages(1)
    kv, store = open_engine(tmp_path)
    store.put(keys(1), lambda i: data[i])
    kv.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[-3] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    kv, store = open_engine(tmp_path)
    try:
        sink = Collect()
        assert store.get(keys(1), sink) in ([GetOutcome.CORRUPT], [GetOutcome.MISS])
        assert sink.got == {}
        assert store.exists(keys(1)) == [False]
    finally:
        kv.close()


def test_verified_exists_reads_below_memory_before_it_promises(tmp_path: Path) -> None:
    """Scenario: of three pages on disk one has a damaged payload. A plain ``exists`` answers from the disk
    index (all three); ``exists(verify=True)`` answers what a get can deliver (two), leaves the good pages
    promoted into memory unpinned, and the damaged record counted and deleted."""
    data = pages(3)
    kv, store = open_engine(tmp_path)
    store.put(keys(3), lambda i: data[i])
    kv.close()
    victim = next(p for p in tmp_path.rglob("*") if p.is_file()
                  and keyed_chunk_key(store.binding, keys(3)[1]).chunk_hash.hex() in p.name)
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF
    victim.write_bytes(bytes(raw))
    kv, store = open_engine(tmp_path)
    try:
        assert store.exists(keys(3)) == [True] * 3
        assert store.exists(keys(3), verify=True) == [True, False, True]
        assert kv.metrics.value("kvengine_integrity_failures_total", tier="local_disk",
                                reason="payload_checksum") == 1
        assert not victim.exists()
        memory = kv._core.memory
        assert [memory.contains(keyed_chunk_key(store.binding, k)) for k in keys(3)] == [True, False, True]
        assert memory.total_pins() == 0
        assert kv.metrics.value("kvengine_loaded_bytes_total", tier="memory") == 0  # nothing handed out
    finally:
        kv.close()


def test_promotion_without_room_is_counted_and_leaves_nothing_pinned(tmp_path: Path) -> None:
    """Scenario: more pages on disk than memory can hold: those promoted are exact, the rest are NO_ROOM
    misses, and no slot or pin is left behind."""
    n = 200  # pages of 512 B; 64 KiB of memory holds fewer
    data = pages(n, seed=3)
    kv, store = open_engine(tmp_path)
    store.put(keys(n), lambda i: data[i])
    kv.close()
    kv, store = open_engine(tmp_path, capacity="64KiB")
    try:
        sink = Collect()
        out = store.get(keys(n), sink)
        assert GetOutcome.HIT in out and GetOutcome.NO_ROOM in out
        assert set(out) <= {GetOutcome.HIT, GetOutcome.NO_ROOM}
        for i, outcome in enumerate(out):
            if outcome is GetOutcome.HIT:
                assert all(torch.equal(a, b) for a, b in zip(sink.got[i], data[i]))
        assert kv._core.memory.total_pins() == 0
    finally:
        kv.close()


def test_keyed_chunks_never_meet_token_chunks() -> None:
    """A keyed binding lives in its own namespace: token lookups of the same model never see its chunks."""
    plain = Namespace(model="keyed-test")
    keyed = keyed_namespace(plain, SCHEME)
    layout = page_layout()
    assert key_scheme(ModelBinding.create(keyed, layout)) == SCHEME
    assert key_scheme(ModelBinding.create(plain, layout)) is None
    assert ModelBinding.create(keyed, layout).digest != ModelBinding.create(plain, layout).digest
    kv = KVEngine({"chunk_size": PAGE, "memory": {"capacity_bytes": "1MiB", "slab_bytes": "64KiB"}}, transports=[])
    try:
        with pytest.raises(InvalidRequestError):
            KeyedStore(kv._core, kv.bind(plain, layout))
        store = SyncKeyedStore(kv, kv.bind(keyed, layout))
        tokens = list(range(PAGE))
        token_bytes = torch.tensor(tokens, dtype=torch.int32).numpy().tobytes()
        store.put([token_bytes], lambda i: pages(1)[0])  # key bytes equal to the first chunk's tokens
        res = kv.lookup(kv.bind(plain, layout), "r1", tokens)
        assert res.tokens == 0
        kv.release(res)
    finally:
        kv.close()


def test_keys_must_be_non_empty_bytes() -> None:
    """An empty or non-bytes key is refused, and a keyed namespace cannot be keyed again."""
    binding = ModelBinding.create(keyed_namespace(Namespace(model="m"), SCHEME), page_layout())
    with pytest.raises(InvalidRequestError):
        keyed_chunk_key(binding, b"")
    with pytest.raises(InvalidRequestError):
        keyed_chunk_key(binding, "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        keyed_namespace(keyed_namespace(Namespace(model="m"), SCHEME), "again")


def test_sink_writes_inference_tensors_of_a_caller_under_inference_mode() -> None:
    """Scenario: pool pages made and filled under ``torch.inference_mode()`` (inference tensors). The sink,
    which the engine runs on its own thread, writes them in the caller's mode: a hit, not a sink failure."""
    kv, store = open_engine()
    with kv, torch.inference_mode():
        data = pages(2, seed=3)
        assert store.put(keys(2), data.__getitem__) == [PutOutcome.STORED] * 2
        pool = torch.zeros(2, 2, PAGE, 2, 4)

        def sink(i: int, tensors: tuple[torch.Tensor, ...]) -> None:
            for j, t in enumerate(tensors):
                pool[i, j].copy_(t)

        assert store.get(keys(2), sink) == [GetOutcome.HIT] * 2
    assert pool.is_inference()
    assert all(torch.equal(pool[i, j], data[i][j]) for i in range(2) for j in range(2))


def test_a_tier_that_fails_its_reads_is_a_miss_there_and_the_next_tier_serves(tmp_path: Path) -> None:
    """Scenario: the first lower tier says it holds the pages but fails every read; the second holds them: every
    page is served from the second, exactly, and the first tier's faults are counted."""
    class FailingReads(DictTransport):
        name = "failing"

        async def get(self, keys):
            raise OSError("the device went away")

    ns = keyed_namespace(Namespace(model="keyed-test"), SCHEME)
    layout = page_layout()
    binding = ModelBinding.create(ns, layout)
    good, broken = DictTransport(), FailingReads()
    data = pages(3)
    config = {"chunk_size": PAGE, "memory": {"capacity_bytes": "1MiB", "slab_bytes": "64KiB"}}
    with KVEngine(config, transports=[good]) as kv:
        kv.bind(ns, layout)
        assert SyncKeyedStore(kv, binding).put(keys(3), lambda i: data[i]) == [PutOutcome.STORED] * 3
    broken.blobs = dict(good.blobs)  # it claims them all
    with KVEngine(config, transports=[broken, good]) as kv:
        kv.bind(ns, layout)
        sink = Collect()
        assert SyncKeyedStore(kv, binding).get(keys(3), sink) == [GetOutcome.HIT] * 3
        assert all(torch.equal(a, b) for i in range(3) for a, b in zip(sink.got[i], data[i]))
        assert kv.metrics.value("kvengine_tier_errors_total", tier="failing", op="get") >= 1
