"""Hostile files for tests of readers of the disk tier's directory: real FIFOs, and a deadline that turns a
reader blocked on one into a failed test instead of a hung suite."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def plant_fifo(path: Path) -> Path:
    """A real FIFO at ``path`` (nobody writes it: opening it for reading blocks until someone does)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _release_once(fifos: Sequence[Path]) -> bool:
    """Open each FIFO for writing and close it again: a reader blocked opening it returns (and reads an empty
    file). Whether any had a reader."""
    released = False
    for fifo in fifos:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            released = True
        except OSError as exc:  # ENXIO: no reader has it open; ENOENT: gone
            if exc.errno not in (errno.ENXIO, errno.ENOENT):
                raise
    return released


@contextlib.contextmanager
def releasing(fifos: Sequence[Path], *, quiet: float = 0.5, timeout: float = 30.0) -> Iterator[None]:
    """While inside, and after until no reader has come for ``quiet`` seconds, keep releasing the readers of
    ``fifos``. How a test cleans up after code that did block on one (a regression): a thread left blocked
    would keep the test process from exiting."""
    stop = threading.Event()

    def release() -> None:
        while not stop.wait(0.01):
            _release_once(fifos)

    thread = threading.Thread(target=release, name="fifo-release", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        last, end = time.monotonic(), time.monotonic() + timeout
        while time.monotonic() - last < quiet and time.monotonic() < end:
            if _release_once(fifos):
                last = time.monotonic()
            time.sleep(0.01)


def within(seconds: float, fn: Callable[[], T], *, fifos: Sequence[Path] = ()) -> T:
    """``fn()`` run on a thread; its result if it returns within ``seconds``, else an AssertionError (after
    releasing ``fifos`` so that the blocked thread can end)."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="within", daemon=True)
    thread.start()
    thread.join(seconds)
    hung = thread.is_alive()
    if hung:
        with releasing(fifos):
            thread.join(30)
    if hung:
        raise AssertionError(f"did not finish within {seconds} s (blocked on a FIFO?)")
    if failure:
        raise failure[0]
    return outcome[0]
