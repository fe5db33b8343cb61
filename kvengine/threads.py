"""kvengine's own threads, placed on the process's CPUs rather than on the core their creator is pinned to.

A Linux thread starts with its creator's CPU affinity. Inference engines pin their compute threads: vLLM's
CPU worker binds its main thread (an OpenMP thread) to one core, and between steps that thread spins on a
shared-memory queue. A thread kvengine starts from it would inherit that one core and share it with the
spinning thread, and with every other instance's worker the same binding put there: measured here (two
``vllm serve`` instances on two cores, both workers' main threads on core 0), a handoff server took 7 to 20 s
to accept a connection and 22 s to encode one 11.8 MB record; started as below, the whole handoff took
1.2-4.3 s (docs/vllm.md). kvengine's threads do I/O and bookkeeping: they belong on any CPU the
process's threads may use (the union of their affinities, which keeps a ``taskset`` the user set), where
the OS finds room.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def process_cpus() -> frozenset[int] | None:
    """The CPUs some thread of this process may run on; None where the OS does not say (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return frozenset(os.sched_getaffinity(0))
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return frozenset(cpus) or None


def unpin() -> None:
    """Let the calling thread run on all of :func:`process_cpus` (a no-op where affinity is unknown)."""
    cpus = process_cpus()
    if cpus is not None and cpus != os.sched_getaffinity(0):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:  # a CPU went offline or a cpuset shrank meanwhile: stay where we are
            pass


def start_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Start a daemon thread running ``target(*args)`` on the process's CPUs (:func:`unpin`)."""

    def run() -> None:
        unpin()
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def executor(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run on the process's CPUs (:func:`unpin`), named ``name_N``."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=unpin)
