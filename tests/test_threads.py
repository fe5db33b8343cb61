"""kvengine's threads leave the core their creator is pinned to (as vLLM's CPU worker pins its main thread)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest

from kvengine.threads import executor, start_thread

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux CPU affinity and two CPUs")


def _from_pinned_thread(make: Any) -> dict[str, set[int]]:
    """Affinities seen by threads started from a thread pinned to one CPU: a plain thread's, and ``make``'s."""
    seen: dict[str, set[int]] = {}
    core = min(os.sched_getaffinity(0))

    def pinned() -> None:
        os.sched_setaffinity(0, {core})
        plain = threading.Thread(target=lambda: seen.__setitem__("plain", os.sched_getaffinity(0)))
        plain.start()
        plain.join()
        seen["ours"] = make()

    creator = threading.Thread(target=pinned)
    creator.start()
    creator.join()
    seen["core"] = {core}
    return seen


def test_a_thread_started_from_a_pinned_thread_runs_on_all_the_process_cpus() -> None:
    def make() -> set[int]:
        got: list[set[int]] = []
        start_thread(lambda: got.append(os.sched_getaffinity(0)), "kvengine-test").join()
        return got[0]

    seen = _from_pinned_thread(make)
    assert seen["plain"] == seen["core"]  # what a plain thread inherits
    assert seen["ours"] == os.sched_getaffinity(0) and len(seen["ours"]) > 1


def test_pool_threads_started_from_a_pinned_thread_run_on_all_the_process_cpus() -> None:
    def make() -> set[int]:
        with executor(1, "kvengine-test") as pool:
            return pool.submit(os.sched_getaffinity, 0).result()

    seen = _from_pinned_thread(make)
    assert seen["ours"] == os.sched_getaffinity(0) and seen["ours"] != seen["core"]


def test_a_process_the_user_narrowed_to_one_cpu_keeps_its_threads_there() -> None:
    """As under ``taskset``: every thread of the process on a subset, so kvengine's threads stay inside it."""
    core = min(os.sched_getaffinity(0))
    code = ("import os, sys; os.sched_setaffinity(0, {%d}); from kvengine.threads import start_thread; "
            "got = []; start_thread(lambda: got.append(os.sched_getaffinity(0)), 't').join(); "
            "print(sorted(got[0]))" % core)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == str([core])
