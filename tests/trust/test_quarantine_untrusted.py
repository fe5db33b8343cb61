"""The quarantine folders under the disk tier's directory (``quarantine/``, ``namespaces/``) are writable by
every process on the disk: a FIFO, a link or a hostile JSON file there is skipped and logged by name, never a
hang of the engine's start, of its lease reaper or of the operator's command, never a crash.

Each operation runs under a deadline (:func:`tests.untrusted_dir.within`): a reader that blocks fails the
test instead of hanging the suite."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from kvengine import KVEngine, Namespace
from kvengine.cli.quarantine import main as quarantine_cmd
from kvengine.trust.quarantine import root_digest

from ..conftest import CHUNK, FakeKV, make_layout
from ..untrusted_dir import plant_fifo, releasing, within

DEADLINE = 10.0
TOKENS = list(range(2 * CHUNK))


def _config(disk: Path, **extra: object) -> dict[str, object]:
    return {"chunk_size": CHUNK, "memory": {"capacity_bytes": 1 << 20}, "disk": {"path": str(disk), "fsync": "never"},
            **extra}


def _marker(disk: Path, namespace: Namespace, reason: str) -> None:
    """A valid marker, as another process writes it."""
    (disk / "quarantine").mkdir(parents=True, exist_ok=True)
    root = root_digest(namespace)
    (disk / "quarantine" / f"{root}.json").write_text(json.dumps(
        {"root": root, "model": namespace.model, "reason": reason, "since": 1.0, "details": {}}))


def test_fifos_in_the_quarantine_folders_do_not_hang_engine_start_or_the_quarantine_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: the markers and notes were read with a blocking open, so a FIFO named ``*.json`` in
    ``<disk>/quarantine/`` hung the engine's start (and one in ``namespaces/`` hung ``kvengine quarantine
    list``). Now both finish within the deadline, the FIFOs are skipped, and a valid marker next to them is
    still honoured."""
    layout = make_layout()
    bad = Namespace(model="quarantined-elsewhere")
    _marker(tmp_path, bad, "another process found a mismatch")
    fifos = [plant_fifo(tmp_path / "quarantine" / ("0" * 32 + ".json")),
             plant_fifo(tmp_path / "namespaces" / ("1" * 32 + ".json"))]

    def start() -> bool:
        with KVEngine(_config(tmp_path)) as eng:
            return eng.is_quarantined(eng.bind(bad, layout))

    assert within(DEADLINE, start, fifos=fifos) is True
    assert within(DEADLINE, lambda: quarantine_cmd(["list", "--disk", str(tmp_path)]), fifos=fifos) == 0
    assert "another process found a mismatch" in capsys.readouterr().out


def test_a_deeply_nested_marker_is_skipped_and_named_not_a_crash_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: a marker of deeply nested JSON (``[[[[...]]]]``) raised RecursionError out of the JSON parser,
    which stopped the engine's start without naming the file. Now the engine starts, the warning names the file
    and what is wrong with it, and the valid marker next to it is still honoured."""
    layout = make_layout()
    bad = Namespace(model="quarantined-elsewhere")
    _marker(tmp_path, bad, "mismatch")
    deep = tmp_path / "quarantine" / ("2" * 32 + ".json")
    deep.write_text("[" * 20_000 + "]" * 20_000)  # 40 KB: within the size bound
    caplog.set_level(logging.WARNING, logger="kvengine.trust.quarantine")
    with KVEngine(_config(tmp_path)) as eng:
        assert eng.is_quarantined(eng.bind(bad, layout))
        assert not eng.is_quarantined(eng.bind(Namespace(model="fine"), layout))
    warned = [r.getMessage() for r in caplog.records if str(deep) in r.getMessage()]
    assert len(warned) == 1 and "nested 20000 levels deep" in warned[0]


def test_a_fifo_planted_while_running_does_not_stop_the_lease_reaper(tmp_path: Path) -> None:
    """Regression: the lease reaper re-reads the quarantine markers every 10 ticks and waited for that read;
    a FIFO named ``*.json`` planted in ``<disk>/quarantine/`` while the engine ran blocked the read, and with
    it the reaper, so reservations were never reclaimed. Now the FIFO is skipped and an abandoned reservation
    is reclaimed after its lease, counted."""
    layout = make_layout()
    fifo = tmp_path / "quarantine" / ("3" * 32 + ".json")
    eng = KVEngine(_config(tmp_path, lease_seconds=0.2))  # the reaper ticks every 0.05 s: markers every 0.5 s
    try:
        binding = eng.bind(Namespace(model="m"), layout)
        eng.store(binding, TOKENS, FakeKV(len(TOKENS)).source)
        plant_fifo(fifo)
        time.sleep(1.2)  # two re-reads of the markers since the FIFO appeared
        assert eng.lookup(binding, "abandoned", TOKENS).tokens == len(TOKENS)  # never loaded or released
        deadline = time.monotonic() + DEADLINE
        while eng.metrics.value("kvengine_reservations_reclaimed_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.metrics.value("kvengine_reservations_reclaimed_total") == 1
        assert eng._core.memory.total_pins() == 0
    finally:
        with releasing([fifo]):  # a blocked reader (the regression) must end for the engine to close
            eng.close()
