"""Quarantined namespaces: never served, never stored, persisted with the disk tier, purged by an operator."""

from __future__ import annotations

from pathlib import Path

import torch

from kvengine import KVEngine, Namespace
from kvengine.cli.quarantine import main as quarantine_cmd
from kvengine.keyed import GetOutcome, PutOutcome, SyncKeyedStore, keyed_namespace
from kvengine.trust.quarantine import Quarantine, read_markers, root_digest

from ..conftest import CHUNK, FakeKV, copier, make_layout

TOKENS = list(range(3 * CHUNK))


def disk_engine(path: Path) -> KVEngine:
    return KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 1 << 20}, "write_mode": "write_through",
                     "disk": {"path": str(path), "fsync": "never"}})


def test_root_ignores_salts_and_keyed_schemes_but_not_the_model_identity():
    """A model that computes other KV does so for every cache salt and keyed sub-namespace."""
    ns = Namespace(model="m", model_fingerprint="w1")
    assert root_digest(ns) == root_digest(ns.with_updates(cache_salt="tenant-a"))
    assert root_digest(ns) == root_digest(keyed_namespace(ns, "scheme"))
    assert root_digest(ns) != root_digest(ns.with_updates(model_fingerprint="w2"))
    assert root_digest(ns) != root_digest(ns.with_updates(rank=0, world_size=2))


def test_a_quarantined_namespace_serves_and_stores_nothing_and_withdraws_what_it_promised():
    """Quarantine withdraws the root's live reservations (every salt), refuses its lookups, stores and keyed ops,
    counted, leaves no pin and leaves other models untouched."""
    layout = make_layout()
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 1 << 20}}) as eng:
        binding = eng.bind(Namespace(model="m"), layout)
        salted = eng.bind(Namespace(model="m", cache_salt="s"), layout)
        kv = FakeKV(len(TOKENS))
        eng.store(binding, TOKENS, kv.source)
        held = eng.lookup(binding, "held", TOKENS)
        eng.store(salted, TOKENS, kv.source)
        held_salted = eng.lookup(salted, "held", TOKENS)
        assert held.tokens == held_salted.tokens == 3 * CHUNK
        eng.quarantine_namespace(binding, "test")
        assert not eng.load(held_salted, lambda _v: None).ok  # every salt of the root is withdrawn
        assert eng.is_quarantined(binding) and eng.is_quarantined(salted)
        out = [torch.zeros_like(t) for t in kv.layers]
        assert not eng.load(held, copier(out)).ok  # withdrawn: the caller recomputes
        assert eng.lookup(binding, "again", TOKENS).tokens == 0
        assert eng.store(salted, TOKENS, kv.source).stored_chunks == 0
        keyed = SyncKeyedStore(eng, eng.bind(keyed_namespace(Namespace(model="m"), "k"), layout))
        assert keyed.put([b"key"], lambda _i: [t[:, :, :CHUNK] for t in kv.layers]) == [PutOutcome.REFUSED]
        assert keyed.get([b"key"], lambda _i, _t: None) == [GetOutcome.MISS]
        assert keyed.exists([b"key"]) == [False]
        m = eng.metrics
        assert m.value("kvengine_quarantined_namespaces") == 1
        assert m.value("kvengine_quarantine_refusals_total", op="lookup") == 1
        assert m.value("kvengine_quarantine_refusals_total", op="store") == 1
        assert eng._core.memory.total_pins() == 0
        other = eng.bind(Namespace(model="other"), layout)
        eng.store(other, TOKENS, kv.source)
        assert eng.lookup(other, "o", TOKENS).tokens == 3 * CHUNK  # others are untouched


def test_the_quarantine_outlives_the_process_and_reaches_every_engine_on_the_disk(tmp_path: Path, capsys):
    """Marker files under the disk tier: a restart, and an engine started meanwhile on the same disk,
    refuse the namespace too; the operator command lists it and purges its records."""
    layout = make_layout()
    ns = Namespace(model="m")
    kv = FakeKV(len(TOKENS))
    with disk_engine(tmp_path) as writer:
        writer.store(writer.bind(ns, layout), TOKENS, kv.source)
        writer.store(writer.bind(ns.with_updates(cache_salt="s"), layout), TOKENS, kv.source)
    other = disk_engine(tmp_path)
    try:
        with disk_engine(tmp_path) as eng:
            binding = eng.bind(ns, layout)
            eng.quarantine_namespace(binding, "shadow mismatch", tokens="0-48")
        assert [e.model for e in read_markers(tmp_path)] == ["m"]
        other._core.quarantine.refresh()  # what its periodic refresh does
        assert other.lookup(other.bind(ns, layout), "r", TOKENS).tokens == 0
    finally:
        other.close()
    with disk_engine(tmp_path) as eng:
        assert eng.lookup(eng.bind(ns.with_updates(cache_salt="s"), layout), "r", TOKENS).tokens == 0
    assert quarantine_cmd(["list", "--disk", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    root = root_digest(ns)
    assert root in listed and "shadow mismatch" in listed and "6 records under 2 namespaces" in listed
    assert quarantine_cmd(["purge", "--disk", str(tmp_path), "not-a-root"]) == 2
    assert quarantine_cmd(["purge", "--disk", str(tmp_path), "--all"]) == 0
    assert "6 records deleted" in capsys.readouterr().out
    assert read_markers(tmp_path) == []
    with disk_engine(tmp_path) as eng:
        binding = eng.bind(ns, layout)
        assert not eng.is_quarantined(binding)
        assert eng.lookup(binding, "r", TOKENS).tokens == 0  # purged: gone, and cacheable again
        assert eng.store(binding, TOKENS, kv.source).stored_chunks == 3


def test_an_unreadable_marker_is_skipped_not_fatal(tmp_path: Path):
    """A quarantine marker that cannot be parsed is skipped; loading the quarantine does not fail."""
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "bad.json").write_text("{")
    assert len(Quarantine(tmp_path)) == 0
