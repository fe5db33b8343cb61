"""The engine over the real local-disk transport: tiering, restart, cross-process reuse."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from kvengine import KVEngine, Namespace

from ..conftest import CHUNK, FakeKV, copier, make_layout


def engine_with_disk(path, capacity_chunks: int = 4, **extra) -> KVEngine:
    layout = make_layout()
    return KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": capacity_chunks * layout.nbytes()},
                     "disk": {"path": str(path), "capacity_bytes": "64MiB"}, **extra})


def load_all(eng: KVEngine, binding, toks, kv: FakeKV, request: str = "r"):
    res = eng.lookup(binding, request, toks)
    out = [torch.zeros_like(t) for t in kv.layers]
    result = eng.load(res, copier(out))
    n = result.loaded_tokens
    exact = all(torch.equal(o[:, :, :n], k[:, :, :n]) for o, k in zip(out, kv.layers))
    return res.tokens, result, exact


def test_one_lookup_spans_memory_and_disk(tmp_path):
    """A prompt larger than memory is served from memory + disk in one reservation, exactly."""
    layout = make_layout()
    with engine_with_disk(tmp_path, capacity_chunks=4) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        kv1, kv2 = FakeKV(4 * CHUNK, seed=1), FakeKV(4 * CHUNK, seed=2)
        toks1, toks2 = list(range(4 * CHUNK)), [9000 + t for t in range(4 * CHUNK)]
        eng.store(b, toks1, kv1.source)
        eng.flush()
        eng.store(b, toks2, kv2.source)  # evicts prompt 1 from memory; disk still has it
        eng.flush()
        matched, result, exact = load_all(eng, b, toks1, kv1)
        assert matched == 4 * CHUNK and result.ok and exact
        assert eng.metrics.value("kvengine_loaded_bytes_total", tier="local_disk") > 0
        assert eng._core.memory.total_pins() == 0


def test_restarted_engine_reuses_the_directory(tmp_path):
    """A restarted engine on the same directory loads every full chunk exactly; another model misses."""
    layout = make_layout()
    kv = FakeKV(3 * CHUNK + 2, seed=5)
    toks = list(range(3 * CHUNK + 2))
    with engine_with_disk(tmp_path) as eng:
        eng.store(eng.bind(Namespace(model="m"), layout), toks, kv.source)
    with engine_with_disk(tmp_path) as eng:
        matched, result, exact = load_all(eng, eng.bind(Namespace(model="m"), layout), toks, kv)
        assert matched == 3 * CHUNK and result.ok and exact
        other = eng.bind(Namespace(model="other-model"), layout)
        assert eng.lookup(other, "x", toks).tokens == 0


def test_second_process_gets_hits_from_disk(tmp_path):
    """A chunk stored by another process is a hit here, byte-identical."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path.parent.parent)!r})
        from kvengine import KVEngine, Namespace
        from tests.conftest import FakeKV, make_layout, CHUNK
        layout = make_layout()
        with KVEngine({{"chunk_size": CHUNK, "memory": {{"capacity_bytes": 8 * layout.nbytes()}},
                        "disk": {{"path": {str(tmp_path)!r}, "capacity_bytes": "64MiB"}}}}) as eng:
            st = eng.store(eng.bind(Namespace(model="m"), layout), list(range(2 * CHUNK)), FakeKV(2 * CHUNK, seed=7).source)
            print(st.stored_chunks)
    """)
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    script = script.replace(repr(str(tmp_path.parent.parent)), repr(str(root)))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"
    with engine_with_disk(tmp_path) as eng:
        matched, result, exact = load_all(eng, eng.bind(Namespace(model="m"), make_layout()),
                                          list(range(2 * CHUNK)), FakeKV(2 * CHUNK, seed=7))
        assert matched == 2 * CHUNK and result.ok and exact


def test_corrupt_file_on_disk_is_a_miss_not_data(tmp_path):
    """Files with a flipped payload bit are misses, counted as checksum failures, and deleted."""
    layout = make_layout()
    kv = FakeKV(2 * CHUNK, seed=3)
    toks = list(range(2 * CHUNK))
    with engine_with_disk(tmp_path) as eng:
        eng.store(eng.bind(Namespace(model="m"), layout), toks, kv.source)
    files = sorted(tmp_path.rglob("*.kvc"))
    assert len(files) == 2
    for f in files:  # flip one payload bit in every file
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x40
        f.write_bytes(bytes(data))
    with engine_with_disk(tmp_path) as eng:
        matched, result, _ = load_all(eng, eng.bind(Namespace(model="m"), layout), toks, kv)
        assert matched == 0 and result.loaded_tokens == 0
        assert eng.metrics.value("kvengine_integrity_failures_total", tier="local_disk",
                                 reason="payload_checksum") >= 1
    assert not list(tmp_path.rglob("*.kvc"))  # corrupt files are deleted, never served later


def test_compressed_disk_tier_round_trips_exactly(tmp_path):
    """With a lossless codec on disk, a restarted engine loads bit-identical KV."""
    layout = make_layout(dtype=torch.bfloat16)
    kv = FakeKV(2 * CHUNK, seed=9)
    kv.layers = [t.to(torch.bfloat16) for t in kv.layers]
    toks = list(range(2 * CHUNK))
    cfg = {"disk": {"path": str(tmp_path), "codec": "zstd-byteshuffle"}}
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}, **cfg}) as eng:
        eng.store(eng.bind(Namespace(model="m"), layout), toks, kv.source)
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}, **cfg}) as eng:
        matched, result, exact = load_all(eng, eng.bind(Namespace(model="m"), layout), toks, kv)
        assert matched == 2 * CHUNK and result.ok and exact


def test_lossy_disk_codec_needs_a_lossy_namespace(tmp_path):
    """A quantizing disk tier never answers an exact reader: binding a lossless namespace is refused."""
    import pytest

    from kvengine import InvalidRequestError

    layout = make_layout()
    cfg = {"disk": {"path": str(tmp_path), "codec": "int8-token"}}
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}, **cfg}) as eng:
        with pytest.raises(InvalidRequestError, match="lossy:int8-token"):
            eng.bind(Namespace(model="m"), layout)
        lossy = eng.bind(Namespace(model="m", codec_family="lossy:int8-token"), layout)
        kv = FakeKV(2 * CHUNK, seed=4)
        eng.store(lossy, list(range(2 * CHUNK)), kv.source)
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}, **cfg}) as eng:
        lossy = eng.bind(Namespace(model="m", codec_family="lossy:int8-token"), layout)
        res = eng.lookup(lossy, "r", list(range(2 * CHUNK)))
        got = []
        eng.load(res, lambda v: got.append([t.clone() for t in v.tensors]))
        assert res.tokens == 2 * CHUNK
        err = max((g - k[:, :, :CHUNK]).abs().max().item() for g, k in zip(got[0], kv.layers))
        assert 0 < err < 0.05  # quantized: close, not exact


def test_long_prompt_is_promoted_from_disk_window_by_window(tmp_path):
    """Scenario: a restarted engine promotes a prompt of 2.5 read windows from disk, exactly and in order.

    Regression (issue 9): promotion read a whole run of records before admitting any, so a
    32k-token prompt held a second prompt's worth of fresh, page-faulting read buffers.
    """
    from kvengine.core.promotion import _READ_WINDOW

    layout = make_layout()
    n = 2 * _READ_WINDOW + 2
    kv, toks = FakeKV(n * CHUNK, seed=11), list(range(n * CHUNK))
    with engine_with_disk(tmp_path, capacity_chunks=n) as eng:
        eng.store(eng.bind(Namespace(model="m"), layout), toks, kv.source)
    with engine_with_disk(tmp_path, capacity_chunks=n) as eng:
        matched, result, exact = load_all(eng, eng.bind(Namespace(model="m"), layout), toks, kv)
        assert matched == n * CHUNK and result.ok and exact
        assert eng.metrics.value("kvengine_loaded_bytes_total", tier="local_disk") == n * layout.nbytes()
        assert eng._core.memory.total_pins() == 0


def test_promotion_stops_at_a_record_gone_in_a_later_window(tmp_path):
    """Scenario: the file of a chunk in the second read window vanishes after the index was built:
    the chunks before it are served, the rest is a miss, and no pin leaks."""
    from kvengine.chunks.hashing import prefix_hashes
    from kvengine.chunks.keys import ChunkKey
    from kvengine.core.promotion import _READ_WINDOW
    from kvengine.transports._disk_files import record_name

    layout = make_layout()
    n, gone = 2 * _READ_WINDOW + 1, _READ_WINDOW + 1
    kv, toks = FakeKV(n * CHUNK, seed=12), list(range(n * CHUNK))
    with engine_with_disk(tmp_path, capacity_chunks=n) as eng:
        eng.store(eng.bind(Namespace(model="m"), layout), toks, kv.source)
    with engine_with_disk(tmp_path, capacity_chunks=n) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        eng.release(eng.lookup(b, "warm", [7] * CHUNK))  # the index rebuild is done
        key = ChunkKey(b.digest, prefix_hashes(toks, CHUNK, b.digest)[gone])
        (tmp_path / record_name(key)).unlink()
        matched, result, exact = load_all(eng, b, toks, kv)
        assert matched == gone * CHUNK and result.ok and exact
        assert eng._core.memory.total_pins() == 0


def _chunk_keys(b, toks):
    from kvengine.chunks.hashing import prefix_hashes
    from kvengine.chunks.keys import ChunkKey

    return [ChunkKey(b.digest, h) for h in prefix_hashes(toks, CHUNK, b.digest)]


def test_promotion_reads_records_straight_into_memory_verifying_each_once(tmp_path, monkeypatch):
    """Scenario (issue 9): a restarted engine promotes a prompt from disk with placed reads: every
    payload lands in its memory slot (no read buffer taken), its checksum is verified once (by the
    transport, over the slot; the engine does not unpack the record again), and the KV is exact."""
    import kvengine.core.promotion as promotion_mod
    import kvengine.transports._disk_files as files_mod

    layout = make_layout()
    n = 10
    kv, toks = FakeKV(n * CHUNK, seed=21), list(range(n * CHUNK))
    with engine_with_disk(tmp_path, capacity_chunks=n) as eng:
        eng.store(eng.bind(Namespace(model="m"), layout), toks, kv.source)
    verified, unpacked = [], []
    real_verify, real_unpack = files_mod.verify_payload, promotion_mod.unpack_record
    monkeypatch.setattr(files_mod, "verify_payload", lambda h, p: (verified.append(h.key), real_verify(h, p))[1])
    monkeypatch.setattr(promotion_mod, "unpack_record", lambda *a, **k: (unpacked.append(1), real_unpack(*a, **k))[1])
    with engine_with_disk(tmp_path, capacity_chunks=n) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        matched, result, exact = load_all(eng, b, toks, kv)
        assert matched == n * CHUNK and result.ok and exact
        assert len(verified) == n and set(verified) == set(_chunk_keys(b, toks)) and not unpacked
        disk = eng._core.transports[0]
        assert disk.stats().hits == n and disk._files.buffers.idle_bytes == 0  # no read buffer was used
        assert eng.metrics.value("kvengine_loaded_bytes_total", tier="local_disk") == n * layout.nbytes()
        assert eng._core.memory.total_pins() == 0


def test_placed_promotion_stops_at_a_corrupt_record_and_frees_its_slot(tmp_path):
    """Scenario: the payload of chunk 5 of 10 is damaged on disk; a restarted engine serves chunks 0-4,
    the damaged record is deleted and counted, and no memory slot or pin is left behind by it or by
    the reads that were in flight after it."""
    from kvengine.transports._disk_files import record_name

    layout = make_layout()
    n, bad = 10, 5
    kv, toks = FakeKV(n * CHUNK, seed=22), list(range(n * CHUNK))
    with engine_with_disk(tmp_path, capacity_chunks=n) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        eng.store(b, toks, kv.source)
        keys = _chunk_keys(b, toks)
    path = tmp_path / record_name(keys[bad])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with engine_with_disk(tmp_path, capacity_chunks=n) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        matched, result, exact = load_all(eng, b, toks, kv)
        assert matched == bad * CHUNK and result.ok and exact
        assert len(eng._core.memory) == bad and eng._core.memory.total_pins() == 0
        assert eng._core.transports[0].stats().integrity_reasons == {"payload_checksum": 1}
        assert not path.exists()


def test_placed_promotion_refuses_a_record_at_the_wrong_position(tmp_path):
    """Scenario: a record whose bytes verify but whose header claims another token range is refused
    from its header alone (before any slot is taken), counted by the engine and deleted."""
    from kvengine.chunks.record import descriptors_for, encode_header, unpack_record
    from kvengine.transports._disk_files import record_name

    layout = make_layout()
    kv, toks = FakeKV(3 * CHUNK, seed=23), list(range(3 * CHUNK))
    with engine_with_disk(tmp_path) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        eng.store(b, toks, kv.source)
        keys = _chunk_keys(b, toks)
    path = tmp_path / record_name(keys[1])
    header, payload = unpack_record(path.read_bytes())
    path.write_bytes(encode_header(keys[1], (0, CHUNK), descriptors_for(layout, CHUNK), codec_id=0,
                                   raw_length=header.raw_length, payload=payload) + bytes(payload))
    with engine_with_disk(tmp_path) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        matched, result, exact = load_all(eng, b, toks, kv)
        assert matched == CHUNK and result.ok and exact
        assert eng.metrics.value("kvengine_integrity_failures_total", reason="wrong_position") == 1
        assert len(eng._core.memory) == 1 and eng._core.memory.total_pins() == 0
    assert not path.exists()


def test_placed_promotion_stops_where_memory_is_full(tmp_path):
    """Scenario: disk holds 6 chunks of a prompt but memory has room for 3, all pinned by the lookup:
    the reservation covers the first 3, later reads give their slots back, nothing leaks."""
    layout = make_layout()
    kv, toks = FakeKV(6 * CHUNK, seed=24), list(range(6 * CHUNK))
    with engine_with_disk(tmp_path, capacity_chunks=6) as eng:
        eng.store(eng.bind(Namespace(model="m"), layout), toks, kv.source)
    with engine_with_disk(tmp_path, capacity_chunks=3) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        matched, result, exact = load_all(eng, b, toks, kv)
        assert matched == 3 * CHUNK and result.ok and exact
        assert len(eng._core.memory) == 3 and eng._core.memory.total_pins() == 0
        assert len(list(tmp_path.glob("*.kvc"))) == 6  # refused for room, not for corruption


def test_placed_reads_take_memory_slots_in_prompt_order(tmp_path, monkeypatch):
    """Scenario: memory has room for 3 of 6 chunks on disk and the read of chunk 0 is slow to start
    (its header arrives last); the slots still go to chunks 0-2, so the lookup serves 3 chunks
    rather than none (chunk 0 finding no room behind chunks 1-3)."""
    import time

    from kvengine.transports._disk_files import RecordFiles

    layout = make_layout()
    kv, toks = FakeKV(6 * CHUNK, seed=25), list(range(6 * CHUNK))
    with engine_with_disk(tmp_path, capacity_chunks=6) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        eng.store(b, toks, kv.source)
        first = _chunk_keys(b, toks)[0]
    real = RecordFiles.read_into

    def slow_first(self, key, out):
        if key == first:
            time.sleep(0.3)
        return real(self, key, out)

    monkeypatch.setattr(RecordFiles, "read_into", slow_first)
    with engine_with_disk(tmp_path, capacity_chunks=3) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        matched, result, exact = load_all(eng, b, toks, kv)
        assert matched == 3 * CHUNK and result.ok and exact
        assert eng._core.memory.total_pins() == 0


def test_placed_promotion_of_a_partial_last_chunk(tmp_path):
    """Scenario: with partial chunks stored, a restarted engine promotes a prompt whose last chunk is
    partial; its slot is sized from the record's header and the KV is exact."""
    layout = make_layout()
    n = 3 * CHUNK + 5
    kv, toks = FakeKV(n, seed=26), list(range(n))
    with engine_with_disk(tmp_path, store_partial_chunks=True) as eng:
        eng.store(eng.bind(Namespace(model="m"), layout), toks, kv.source)
    with engine_with_disk(tmp_path, store_partial_chunks=True) as eng:
        matched, result, exact = load_all(eng, eng.bind(Namespace(model="m"), layout), toks, kv)
        assert matched == n and result.ok and exact
        assert eng.metrics.value("kvengine_loaded_bytes_total", tier="local_disk") == \
            3 * layout.nbytes() + layout.nbytes(5)


def test_log_level_setting_logs_start_up_and_where_each_lookup_was_served_from(tmp_path, caplog):
    """``log_level: debug`` (KVENGINE_LOG_LEVEL) sets kvengine's loggers: the start-up line names the disk tier
    and its codec; a restarted engine's lookup says its chunks came from local_disk, then the load line."""
    import logging

    layout = make_layout()
    kv = FakeKV(2 * CHUNK, seed=7)
    toks = list(range(2 * CHUNK))
    with engine_with_disk(tmp_path) as eng:
        eng.store(eng.bind(Namespace(model="m"), layout), toks, kv.source)
    before = logging.getLogger("kvengine").level
    try:
        with caplog.at_level(logging.DEBUG, logger="kvengine"), engine_with_disk(tmp_path, log_level="DEBUG") as eng:
            assert logging.getLogger("kvengine").level == logging.DEBUG
            matched, result, exact = load_all(eng, eng.bind(Namespace(model="m"), layout), toks, kv, request="r7")
    finally:
        logging.getLogger("kvengine").setLevel(before)
    assert matched == 2 * CHUNK and result.ok and exact
    text = caplog.text
    assert "kvengine: started: chunk" in text and "lower tiers: local_disk (raw)" in text
    assert f"kvengine: lookup r7: {2 * CHUNK} of {2 * CHUNK} tokens hit, chunks by tier {{'local_disk': 2}}" in text
    assert f"kvengine: load r7: {2 * CHUNK} of {2 * CHUNK} tokens loaded" in text
