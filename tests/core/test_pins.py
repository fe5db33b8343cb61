"""Pins: one handle owns a pin from acquisition to release, and only kvengine.core.pins takes or releases one."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import kvengine.core.tier_writer as tier_writer_module
from kvengine import Namespace
from kvengine.core.memory_tier import MemoryEntry
from kvengine.core.pins import Pins

from ..conftest import CHUNK, FakeKV, make_layout
from .test_memory_tier import LAYOUT, key, put, tier
from .test_tiering import DictTransport, prompt_below

ROOT = Path(__file__).resolve().parents[2]
#: The memory tier's implementations (they count pins) and the module that owns them for the engine. The host
#: service keeps a ledger of the pins its clients in other processes hold, released when a connection closes.
MAY_PIN = {"kvengine/core/pins.py", "kvengine/core/memory_tier.py", "kvengine/host/service.py",
           "kvengine/host/client.py"}


def test_a_handle_releases_its_pins_once():
    """prefix() pins the resident prefix; release() unpins it, and a second release unpins nothing."""
    t = tier(3)
    assert put(t, 0) and put(t, 1)
    pins = Pins.prefix(t, [key(0), key(1), key(2)])
    assert [e.key for e in pins] == [key(0), key(1)] and t.total_pins() == 2
    pins.release()
    pins.release()
    assert t.total_pins() == 0 and len(pins) == 0


def test_passing_pins_on_moves_them_and_leaves_one_owner():
    """split() moves pins to a handle per entry, add() moves them on: each pin is released by whichever handle
    holds it, once, and the count never goes below zero (an unbalanced unpin asserts)."""
    t = tier(3)
    for i in range(3):
        assert put(t, i)
    pins = Pins.prefix(t, [key(0), key(1), key(2)])
    each = pins.split()
    assert len(pins) == 0 and [[e.key for e in p] for p in each] == [[key(0)], [key(1)], [key(2)]]
    each[0].add(each[1])
    assert len(each[1]) == 0 and [e.key for e in each[0]] == [key(0), key(1)]
    for handle in (pins, *each, each[0]):
        handle.release()
    assert t.total_pins() == 0


def test_a_with_block_releases_on_every_exit():
    """Leaving a ``with`` block releases the handle's pins, also when it raises; an empty handle is falsy."""
    t = tier(2)
    assert put(t, 0)
    with pytest.raises(RuntimeError), Pins.of(t, key(0)) as pins:
        assert pins and t.total_pins() == 1
        raise RuntimeError("boom")
    assert t.total_pins() == 0
    with Pins.of(t, key(1)) as missing:
        assert not missing


def test_commit_turns_the_writers_pin_into_the_handles():
    """A filled slot committed through Pins keeps its prepare pin, now the handle's: resident, pinned once,
    unpinned on release."""
    t = tier(1)
    slot = t.prepare(key(0), LAYOUT, (0, CHUNK))
    assert isinstance(slot, MemoryEntry)
    pins = Pins.commit(t, (slot,))
    assert t.contains(key(0)) and t.total_pins() == 1 and pins[0] is slot
    pins.release()
    assert t.total_pins() == 0


def _pin_calls(path: Path, root: Path = ROOT) -> list[str]:
    """Where ``path`` calls a memory tier's pin methods or keeps a committed slot's pin."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        keeps = name == "commit" and any(k.arg == "keep_pin" for k in node.keywords)
        if name in ("pin", "pin_prefix", "unpin") or keeps:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


def test_only_the_pins_module_takes_or_releases_pins():
    """No module of the engine, its transports or integrations pins or unpins a memory entry but
    kvengine.core.pins (and the memory tier's implementations): who releases a pin is answered in one file."""
    files = [p for d in ("kvengine", "transports", "integrations") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    offenders = [call for p in files if str(p.relative_to(ROOT)) not in MAY_PIN for call in _pin_calls(p)]
    assert offenders == []


def test_the_structural_check_sees_a_pin_call(tmp_path):
    """The check above finds a direct pin call (so its empty answer means something)."""
    (tmp_path / "x.py").write_text("def f(m, k):\n    m.memory.unpin([k])\n    m.commit(e, keep_pin=True)\n")
    assert _pin_calls(tmp_path / "x.py", tmp_path) == ["x.py:2: unpin", "x.py:3: commit"]


class _BlockingTier(DictTransport):
    """Reads wait until ``release`` is set (a slow peer or disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.reading = asyncio.Event()

    async def get(self, keys):
        self.reading.set()
        await self.release.wait()
        return await super().get(keys)


async def test_a_lookup_cancelled_while_promoting_leaves_nothing_pinned():
    """A lookup that pinned resident chunks and is cancelled while reading the rest from below (its caller
    timed out) releases every pin it took: none is left for a reservation never made."""
    t = _BlockingTier()
    eng, b, toks, kv = await prompt_below(t, make_layout(), 3)
    try:
        await eng.store(b, toks[:CHUNK], FakeKV(CHUNK).source)  # the head is resident again, the rest below
        await eng.flush()
        lookup = asyncio.ensure_future(eng.lookup(b, "r", toks))
        await asyncio.wait_for(t.reading.wait(), 5)
        assert eng.memory.total_pins() == 1
        lookup.cancel()
        with pytest.raises(asyncio.CancelledError):
            await lookup
        assert eng.memory.total_pins() == 0 and len(eng.reservations) == 0
    finally:
        t.release.set()
        await eng.close()


async def test_a_write_through_store_cancelled_before_its_writes_leaves_nothing_pinned(monkeypatch):
    """Write-through writes wait for a write slot (two here, one of them the idle write-behind writer's);
    cancelling the store then releases the pins of the chunks whose writes never started, and of the one in
    flight once it ends."""
    monkeypatch.setattr(tier_writer_module, "_WRITES_IN_FLIGHT", 2)
    t = DictTransport()
    t.put_delay = 0.2
    eng, b, toks, _ = await prompt_below(t, make_layout(), 1, write_mode="write_through")
    try:
        store = asyncio.ensure_future(eng.store(eng.bind(Namespace(model="other"), make_layout()),
                                                list(range(3 * CHUNK)), FakeKV(3 * CHUNK).source))
        await asyncio.sleep(0.05)
        store.cancel()
        with pytest.raises(asyncio.CancelledError):
            await store
        await asyncio.sleep(0.3)
        assert eng.memory.total_pins() == 0
    finally:
        await eng.close()
