"""Calls after close(): one clear EngineClosedError from every method, and no unawaited coroutine."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvengine import CacheEngine, KVEngine, Namespace
from kvengine.errors import EngineClosedError, KVEngineError

from .conftest import CHUNK, FakeKV, make_config, make_layout

N = 2 * CHUNK


@pytest.fixture
def closed_kv() -> Iterator[tuple[KVEngine, dict[str, Callable[[], Any]]]]:
    """A closed KVEngine, and every public method called with arguments that were valid before close."""
    layout = make_layout()
    eng = KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}})
    b = eng.bind(Namespace(model="closed"), layout)
    toks = list(range(N))
    eng.store(b, toks, FakeKV(N).source)
    res = eng.lookup(b, "r", toks)
    staged = eng.begin_store(b, list(range(100, 100 + N)))
    eng.close()
    calls: dict[str, Callable[[], Any]] = {
        "bind": lambda: eng.bind(Namespace(model="closed"), layout),
        "lookup": lambda: eng.lookup(b, "r2", toks),
        "lookup_resident": lambda: eng.lookup_resident(b, "r2", toks),
        "load": lambda: eng.load(res, lambda view: None),
        "begin_load": lambda: eng.begin_load(res),
        "finish_load": lambda: eng.finish_load(res, 0),
        "release": lambda: eng.release(res),
        "store": lambda: eng.store(b, toks, FakeKV(N).source),
        "begin_store": lambda: eng.begin_store(b, toks),
        "commit_store": lambda: eng.commit_store(staged, 0),
        "flush": eng.flush,
        "reclaim_expired": eng.reclaim_expired,
        "is_quarantined": lambda: eng.is_quarantined(b),
        "quarantine_namespace": lambda: eng.quarantine_namespace(b, "test"),
        "run": lambda: eng.run(eng._core.flush()),
    }
    yield eng, calls


FACADE_METHODS = ["bind", "lookup", "lookup_resident", "load", "begin_load", "finish_load", "release", "store",
                  "begin_store", "commit_store", "flush", "reclaim_expired", "is_quarantined",
                  "quarantine_namespace", "run"]


@pytest.mark.parametrize("method", FACADE_METHODS)
def test_every_kvengine_method_after_close_raises_engine_closed(closed_kv, method):
    """Regression: a call after close() raised ``RuntimeError: Event loop is closed`` and left "coroutine ...
    was never awaited" warnings. Each public method now raises EngineClosedError (a KVEngineError, and a
    RuntimeError as before), and no coroutine is left unawaited."""
    eng, calls = closed_kv
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(EngineClosedError, match="closed"):
            calls[method]()
        gc.collect()  # an unawaited coroutine warns when it is collected
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    assert eng.closed
    eng.close()  # still idempotent


def test_engine_closed_is_a_kvengine_error_and_a_runtime_error():
    """Callers catching KVEngineError (or the RuntimeError a closed loop raised before) catch it."""
    assert issubclass(EngineClosedError, KVEngineError) and issubclass(EngineClosedError, RuntimeError)


def test_a_call_still_running_when_another_thread_closes_the_engine_ends_with_engine_closed():
    """Regression: a call submitted to the facade's loop just before another thread's close() stopped that
    loop waited on its future forever. Now it ends, at close, with EngineClosedError."""
    eng = KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * make_layout().nbytes()}})
    started, outcome = threading.Event(), []

    async def slow() -> None:
        started.set()
        await asyncio.sleep(60)

    def caller() -> None:
        try:
            eng.run(slow())
        except BaseException as exc:  # the outcome is what the test asserts
            outcome.append(exc)

    thread = threading.Thread(target=caller, daemon=True)
    thread.start()
    assert started.wait(10)
    t0 = time.monotonic()
    eng.close()
    thread.join(10)
    assert not thread.is_alive(), "the call outlived close() (a hang)"
    assert len(outcome) == 1 and isinstance(outcome[0], EngineClosedError)
    assert time.monotonic() - t0 < 10


def test_metrics_stay_readable_after_close():
    """Reading what the engine counted is not a call into it: metrics answer after close."""
    layout = make_layout()
    eng = KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}})
    b = eng.bind(Namespace(model="closed"), layout)
    eng.store(b, list(range(N)), FakeKV(N).source)
    eng.close()
    assert eng.metrics.value("kvengine_stored_bytes_total", tier="memory") == 2 * layout.nbytes()


async def test_every_cache_engine_primitive_after_close_raises_engine_closed():
    """Regression: the asyncio core kept answering after close() (lookups, stores into a released arena).
    Every primitive now raises EngineClosedError; close() stays idempotent."""
    layout = make_layout()
    eng = CacheEngine(make_config(capacity=8 * layout.nbytes()))
    await eng.start()
    b = eng.bind(Namespace(model="closed"), layout)
    toks = list(range(N))
    await eng.store(b, toks, FakeKV(N).source)
    res = await eng.lookup(b, "r", toks)
    staged = await eng.begin_store(b, list(range(100, 100 + N)))
    await eng.close()
    assert eng.closed
    sync_calls: dict[str, Callable[[], Any]] = {
        "bind": lambda: eng.bind(Namespace(model="closed"), layout),
        "lookup_resident": lambda: eng.lookup_resident(b, "r2", toks),
        "release_now": lambda: eng.release_now(res),
        "is_quarantined": lambda: eng.is_quarantined(b),
        "quarantine_namespace": lambda: eng.quarantine_namespace(b, "test"),
    }
    answered = []
    for name, call in sync_calls.items():
        try:
            call()
        except EngineClosedError:
            continue
        answered.append(name)
    async_calls: dict[str, Callable[[], Any]] = {
        "lookup": lambda: eng.lookup(b, "r2", toks),
        "load": lambda: eng.load(res, lambda view: None),
        "begin_load": lambda: eng.begin_load(res),
        "finish_load": lambda: eng.finish_load(res, 0),
        "release": lambda: eng.release(res),
        "store": lambda: eng.store(b, toks, FakeKV(N).source),
        "begin_store": lambda: eng.begin_store(b, toks),
        "commit_store": lambda: eng.commit_store(staged, 0),
        "flush": eng.flush,
        "reclaim_expired": eng.reclaim_expired,
    }
    for name, call in async_calls.items():
        try:
            await call()
        except EngineClosedError:
            continue
        answered.append(name)
    assert answered == []
    await eng.close()
