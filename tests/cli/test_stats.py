"""``kvengine stats`` and ``kvengine top`` against a real engine's metrics endpoint."""

from __future__ import annotations

import json
import re
import threading

import pytest

from kvengine import KVEngine, Namespace
from kvengine.cli import main

from ..conftest import CHUNK, FakeKV, make_layout


@pytest.fixture
def engine(unused_tcp_port):
    """An engine serving metrics on a free port, after one store of 4 chunks and one lookup + load of 3."""
    layout = make_layout()
    with KVEngine({"chunk_size": CHUNK, "metrics_port": unused_tcp_port,
                   "memory": {"capacity_bytes": 8 * layout.nbytes()}}) as eng:
        binding = eng.bind(Namespace(model="stats"), layout)
        tokens = list(range(4 * CHUNK))
        eng.store(binding, tokens, FakeKV(4 * CHUNK).source)
        eng.load(eng.lookup(binding, "r1", tokens, max_tokens=len(tokens) - 1), lambda view: None)
        eng.url = f"http://127.0.0.1:{unused_tcp_port}/metrics"  # type: ignore[attr-defined]
        eng.binding = binding  # type: ignore[attr-defined]
        yield eng


def test_stats_shows_hit_tokens_and_memory_fill(engine, capsys):
    """``kvengine stats --url`` shows the hit tokens out of the tokens asked, the tokens saved and the memory
    tier's fill (used / capacity bytes) as the engine counts them; ``--json`` gives the same numbers."""
    assert main(["stats", "--url", engine.url]) == 0
    text = capsys.readouterr().out
    used, capacity = engine._core.memory.used_bytes, engine._core.memory.capacity_bytes
    assert "hit rate        76.2%  (48 hit tokens of 63 asked, 1 lookups)" in text  # 3 of 4 chunks: 48 of 63
    assert "tokens saved    48" in text
    assert f"memory fill     {100 * used / capacity:.1f}%" in text
    assert re.search(r"^memory\s+4\s", text, re.M)  # chunks held per tier

    assert main(["stats", "--url", engine.url, "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["hit_tokens"] == 48 and snap["lookup_tokens"] == 63 and snap["tokens_saved"] == 48
    assert snap["used_bytes"]["memory"] == used and snap["capacity_bytes"]["memory"] == capacity
    assert snap["fill"]["memory"] == pytest.approx(used / capacity)
    assert snap["evictions"] == {"memory": 0} and snap["reservations_active"] == 0


def test_top_prints_snapshots_with_rates_when_not_a_terminal(engine, capsys):
    """``kvengine top --count 2 --interval 0.2`` with stdout not a terminal prints two snapshots one after the
    other (no screen control codes); the second has rates per second, here of lookups made meanwhile."""
    stop = threading.Event()

    def traffic() -> None:
        tokens = list(range(4 * CHUNK))
        i = 0
        while not stop.is_set():
            engine.release(engine.lookup(engine.binding, f"t{i}", tokens))
            i += 1
            stop.wait(0.01)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        assert main(["top", "--url", engine.url, "--count", "2", "--interval", "0.2"]) == 0
    finally:
        stop.set()
        worker.join()
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    assert out.count("hit rate ") == 2 and out.count("rates/s ") == 1
    first, second = out.split("\n\n", 2)[0], out.split("rates/s", 1)[1]
    assert "rates/s" not in first
    assert float(re.match(r"\s+lookups ([\d,.]+)", second).group(1).replace(",", "")) > 0
    assert "store/s" in out and "load/s" in out


@pytest.mark.parametrize("command", ["stats", "top"])
def test_unreachable_endpoint_is_one_line_and_exit_2(command, unused_tcp_port, capsys):
    """Nothing listening at the URL: one line on stderr naming the URL, nothing on stdout, exit 2."""
    url = f"http://127.0.0.1:{unused_tcp_port}/metrics"
    assert main([command, "--url", url, "--timeout", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and url in captured.err and "Traceback" not in captured.err


def test_port_is_an_alternative_to_url(engine, capsys):
    """``--port`` reads http://127.0.0.1:PORT/metrics; neither ``--url`` nor ``--port`` is a usage error."""
    port = engine.url.split(":")[2].split("/")[0]
    assert main(["top", "--port", port, "--once"]) == 0
    assert "hit rate        76.2%" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["stats"])
    assert info.value.code == 2 and "one of --url or --port is required" in capsys.readouterr().err


def test_stats_totals_sum_over_models_with_a_line_per_model(unused_tcp_port, capsys):
    """With two models bound in one engine, ``kvengine stats`` shows the totals over both (hit and asked
    tokens, lookups, tokens saved, stored chunks per tier: each counted once, not doubled by the per-model
    series), then one line per model with its own hit rate; ``--json`` gives the same under ``models``."""
    layout = make_layout()
    with KVEngine({"chunk_size": CHUNK, "metrics_port": unused_tcp_port,
                   "memory": {"capacity_bytes": 8 * layout.nbytes()}}) as eng:
        a = eng.bind(Namespace(model="alpha"), layout)
        b = eng.bind(Namespace(model="beta"), layout)
        tokens = list(range(4 * CHUNK))
        eng.store(a, tokens, FakeKV(4 * CHUNK).source)
        eng.load(eng.lookup(a, "ra", tokens, max_tokens=len(tokens) - 1), lambda view: None)
        eng.load(eng.lookup(b, "rb", tokens), lambda view: None)  # nothing stored for beta: a miss
        url = f"http://127.0.0.1:{unused_tcp_port}/metrics"
        assert main(["stats", "--url", url]) == 0
        text = capsys.readouterr().out
        assert main(["stats", "--url", url, "--json"]) == 0
        snap = json.loads(capsys.readouterr().out)
    assert "hit rate        37.8%  (48 hit tokens of 127 asked, 2 lookups)" in text
    assert "tokens saved    48" in text
    assert "  model alpha: 76.2% hit  (48 of 63 asked tokens, 1 lookups, 48 tokens saved)" in text
    assert "  model beta: 0.0% hit  (0 of 64 asked tokens, 1 lookups, 0 tokens saved)" in text
    assert re.search(r"^memory\s+4\s.*\s4\s+0\s+0\s+0$", text, re.M)  # 4 chunks held, 4 stored (not 8)
    assert snap["hit_tokens"] == 48 and snap["lookup_tokens"] == 127 and snap["lookups"] == 2
    assert snap["stored_chunks"] == {"memory": 4}
    assert snap["models"]["alpha"]["hit_tokens"] == 48 and snap["models"]["beta"]["lookup_tokens"] == 64
