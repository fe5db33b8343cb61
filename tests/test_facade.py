"""KVEngine: the blocking, thread-safe facade; shutdown; metrics exporter; CLI."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import pytest
import torch

from kvengine import KVEngine, Namespace
from kvengine.cli import main as cli_main
from kvengine.metrics import scrape

from .conftest import CHUNK, FakeKV, copier, make_layout


def test_many_threads_share_one_engine():
    """Concurrent store/lookup/load from 8 threads: every load is exact, no pins remain."""
    layout = make_layout()
    errors: list[BaseException] = []
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 64 * layout.nbytes()}}) as eng:
        binding = eng.bind(Namespace(model="threads"), layout)

        def worker(w: int) -> None:
            try:
                for it in range(10):
                    toks = [w % 3 * 1000 + t for t in range(3 * CHUNK)]
                    kv = FakeKV(3 * CHUNK, seed=w % 3)
                    eng.store(binding, toks, kv.source)
                    res = eng.lookup(binding, f"w{w}-{it}", toks)
                    out = [torch.zeros_like(t) for t in kv.layers]
                    result = eng.load(res, copier(out))
                    n = result.loaded_tokens
                    assert all(torch.equal(o[:, :, :n], k[:, :, :n]) for o, k in zip(out, kv.layers))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert eng._core.memory.total_pins() == 0
        assert eng.metrics.value("kvengine_loaded_tokens_total") > 0


def _engine(layout, disk: Path | None) -> KVEngine:
    """An engine of 16 chunks of memory, with a disk tier below it at ``disk`` if given."""
    config: dict = {"chunk_size": CHUNK, "memory": {"capacity_bytes": 16 * layout.nbytes()}}
    if disk is not None:
        config["disk"] = {"path": str(disk)}
    return KVEngine(config)


@pytest.mark.parametrize("lower_tier", [False, True])
def test_a_lookup_memory_alone_answers_runs_in_the_callers_thread(tmp_path, lower_tier):
    """A memory-only engine answers a lookup in the calling thread (no hop to its loop: the control path of
    a scheduler's lookup); with a lower tier to ask, the lookup runs on the engine's loop. Both answer the
    same reservation, idempotent per request."""
    layout = make_layout()
    with _engine(layout, tmp_path / "disk" if lower_tier else None) as eng:
        binding = eng.bind(Namespace(model="threads"), layout)
        tokens = list(range(2 * CHUNK))
        eng.store(binding, tokens, FakeKV(len(tokens)).source)
        eng.flush()  # the disk tier's writes done: they held pins of their own
        threads: list[threading.Thread] = []
        pin_prefix = eng._core.memory.pin_prefix

        def recording(keys):
            threads.append(threading.current_thread())
            return pin_prefix(keys)

        eng._core.memory.pin_prefix = recording  # type: ignore[method-assign]
        res = eng.lookup(binding, "r", tokens)
        assert res.tokens == 2 * CHUNK
        assert eng.lookup(binding, "r", tokens).reservation is res.reservation  # the same question: the same reservation
        assert len(threads) == 1  # pinned once
        assert (threads[0] is threading.current_thread()) is not lower_tier
        eng.release(res)
        assert eng._core.memory.total_pins() == 0


@pytest.mark.parametrize("lower_tier", [False, True])
def test_a_store_with_no_lower_tier_runs_in_the_callers_thread(tmp_path, lower_tier):
    """A memory-only engine copies a store's chunks in the calling thread (no hop to its loop and on to a
    worker thread); with a lower tier to hand chunks on to, the store runs on the engine's threads. Either
    way the chunks are stored and read back exact, and a source that raises still commits what it copied."""
    layout = make_layout()
    with _engine(layout, tmp_path / "disk" if lower_tier else None) as eng:
        binding = eng.bind(Namespace(model="store-threads"), layout)
        tokens = list(range(3 * CHUNK))
        kv = FakeKV(len(tokens))
        threads: list[threading.Thread] = []

        def source(index: int, start: int, end: int) -> list[torch.Tensor]:
            threads.append(threading.current_thread())
            if index == 2:
                raise KeyError("the caller's source failed")
            return kv.source(index, start, end)

        with pytest.raises(KeyError, match="source failed"):
            eng.store(binding, tokens, source)
        assert len(threads) == 3 and all((t is threading.current_thread()) is not lower_tier for t in threads)
        res = eng.lookup(binding, "r", tokens)
        assert res.tokens == 2 * CHUNK  # the two chunks copied before the failure
        out = [torch.zeros_like(t) for t in kv.layers]
        assert eng.load(res, copier(out)).loaded_tokens == 2 * CHUNK
        assert all(torch.equal(o[:, :, :2 * CHUNK], k[:, :, :2 * CHUNK]) for o, k in zip(out, kv.layers))
        eng.flush()
        assert eng._core.memory.total_pins() == 0


def test_close_is_idempotent_and_releases_reservations():
    """close may be called twice; it ends live reservations, empties memory and frees the arena at once."""
    layout = make_layout()
    eng = KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}})
    b = eng.bind(Namespace(model="m"), layout)
    toks = list(range(2 * CHUNK))
    eng.store(b, toks, FakeKV(2 * CHUNK).source)
    eng.lookup(b, "never-loaded", toks)
    assert eng._core.memory.total_pins() == 2
    eng.close()
    eng.close()
    assert len(eng._core.reservations) == 0
    assert len(eng._core.memory) == 0 and eng._core.memory.capacity_bytes > 0
    assert eng._core.memory._alloc.arena.numel() == 0  # memory returned at close, not at GC


def test_metrics_http_exporter(unused_tcp_port):
    """The metrics port serves hit tokens (labelled by model) and stored bytes over HTTP, and stops serving at
    close."""
    layout = make_layout()
    with KVEngine({"chunk_size": CHUNK, "metrics_port": unused_tcp_port,
                   "memory": {"capacity_bytes": 8 * layout.nbytes()}}) as eng:
        b = eng.bind(Namespace(model="m"), layout)
        eng.store(b, list(range(CHUNK)), FakeKV(CHUNK).source)
        eng.release(eng.lookup(b, "r", list(range(CHUNK))))
        body = urllib.request.urlopen(f"http://127.0.0.1:{unused_tcp_port}/metrics", timeout=5).read().decode()
        samples = scrape(unused_tcp_port)
    assert 'kvengine_hit_tokens_total{model="m"} 16.0' in body  # per model; scrape also gives the total
    assert samples["kvengine_hit_tokens_total"] == 16
    assert samples['kvengine_stored_bytes_total{tier="memory"}'] == layout.nbytes()
    with pytest.raises(OSError):  # stopped at close: the port is free again
        urllib.request.urlopen(f"http://127.0.0.1:{unused_tcp_port}/metrics", timeout=2)


def test_metrics_exporter_binds_loopback_and_a_taken_port_names_the_setting(unused_tcp_port):
    """Regression: the exporter bound 0.0.0.0, was never stopped, and a port in use failed with a bare
    OSError. It binds metrics_host (127.0.0.1 by default); a bind failure is a ConfigError naming both."""
    import socket

    from kvengine import ConfigError

    config = {"chunk_size": CHUNK, "metrics_port": unused_tcp_port, "memory": {"capacity_bytes": "1MiB"}}
    with KVEngine(config) as eng:
        with socket.socket() as s:  # another address on the port is free: the exporter is not on 0.0.0.0
            s.bind(("127.0.0.2", unused_tcp_port))
        with pytest.raises(ConfigError, match=rf"metrics_port {unused_tcp_port} on metrics_host '127.0.0.1'"):
            KVEngine(config)
        assert eng.lookup(eng.bind(Namespace(model="m"), make_layout()), "r", list(range(CHUNK))).tokens == 0


def test_cli_quickstart(capsys):
    """Scenario: ``kvengine quickstart`` exits 0, loads every full chunk and reports the bytes identical."""
    assert cli_main(["quickstart", "--tokens", "600", "--chunk-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "bytes identical    True" in out and "tokens loaded      576" in out


def test_keyboard_interrupt_in_a_sink_or_source_reaches_the_caller_and_the_engine_keeps_serving():
    """Regression: a BaseException raised in a sink or source killed the facade's loop thread, and that
    call and every later one blocked forever. It now reaches the caller; nothing stays pinned; the
    engine serves the next call."""
    layout = make_layout()
    toks = list(range(3 * CHUNK))
    kv = FakeKV(3 * CHUNK)
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}}) as eng:
        b = eng.bind(Namespace(model="m"), layout)

        def interrupting_source(i: int, start: int, end: int):
            if i == 1:
                raise KeyboardInterrupt
            return kv.source(i, start, end)

        with pytest.raises(KeyboardInterrupt):
            eng.store(b, toks, interrupting_source)
        assert eng.store(b, toks, kv.source).stored_chunks == 2  # chunk 0 was kept, the rest is stored now
        res = eng.lookup(b, "r", toks)

        def exiting_sink(view) -> None:
            raise SystemExit(3)

        with pytest.raises(SystemExit):
            eng.load(res, exiting_sink)
        assert eng._core.memory.total_pins() == 0 and len(eng._core.reservations) == 0
        again = eng.lookup(b, "r2", toks)
        out = [torch.zeros_like(t) for t in kv.layers]
        assert eng.load(again, copier(out)).loaded_tokens == 3 * CHUNK
        assert all(torch.equal(o, k) for o, k in zip(out, kv.layers))


@pytest.mark.parametrize("lower_tier", [False, True])
def test_pinned_chunks_and_tier_codecs_say_what_the_engine_holds(tmp_path, lower_tier):
    """``pinned_chunks()`` counts the pins a reservation holds and is 0 once it is released; ``tier_codecs``
    names the lower tiers' codecs (none for a memory-only engine), what a load from them decodes with."""
    layout = make_layout()
    with _engine(layout, tmp_path / "disk" if lower_tier else None) as eng:
        assert [c.name for c in eng.tier_codecs] == (["raw"] if lower_tier else [])
        binding = eng.bind(Namespace(model="pins"), layout)
        tokens = list(range(2 * CHUNK))
        eng.store(binding, tokens, FakeKV(len(tokens)).source)
        eng.flush()
        assert eng.pinned_chunks() == 0
        res = eng.lookup(binding, "r", tokens)
        assert eng.pinned_chunks() == 2
        eng.release(res)
        assert eng.pinned_chunks() == 0
