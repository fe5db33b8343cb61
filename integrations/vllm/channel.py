"""The explicit channel from vLLM's scheduler process to the worker that owns the cache.

On the vLLM CPU build the scheduler (engine-core process) and the worker
are different processes by default (the CPU platform forces the
multiprocessing executor even at tp=1). The :class:`~kvengine.KVEngine`
lives in the worker, next to the KV pages it copies; the scheduler asks it
over this channel. Reservations are therefore made in the very engine
whose memory the worker later loads from: the pin taken by a lookup
protects exactly the bytes the load copies.

Transport: one Unix-domain socket per engine (``multiprocessing.connection``
with a random auth key), created by the worker in a private temp directory
and announced to the scheduler through vLLM's own handshake-metadata path
(``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``). When vLLM
runs scheduler and worker in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
the same channel is used: one code path, a local round trip costs ~0.1 ms.

Protocol (calls of one request are handled in the order sent; calls of
different requests at once, so a lookup that promotes from disk holds up
no other request's answer). What never waits (a lookup that memory answers,
a release) is handled by the connection's reader thread itself, without a
hand-off; so the scheduler waits for one round trip, never for a disk:

* :class:`LookupCall` -> :class:`Reply` carrying a :class:`~kvengine.lookups.LookupResult`
  (a hit's tokens; a miss; or ``SHADOWED`` for a hit sampled for a shadow
  check: nothing is reserved, vLLM computes it all, the worker compares). A
  lookup that must wait (a promotion from disk or peers, a queued call of its
  request) is first answered ``PENDING`` at once, then with its answer.
  Idempotent per request id: the worker's engine renews the same reservation.
* :class:`ReleaseCall` -> no reply. Ends the request's reservation, if any.
* :class:`StatsCall` -> :class:`Reply` (``stats``): counters for tests and debugging.

Faults: a handler error becomes a ``FAILED`` answer naming it (the scheduler
counts it, a miss); a broken connection makes every later call a miss.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

from kvengine.lookups import MISS, PENDING, LookupOutcome, LookupResult
from kvengine.threads import executor, start_thread

from .frames import Frames

logger = logging.getLogger("vllm.kvengine")

_POLL_S = 0.2
#: Calls answered at once (each waits in a thread on the cache engine's loop, which interleaves them).
_HANDLERS = 8


@dataclass(frozen=True, slots=True)
class LookupCall:
    seq: int
    request_id: str
    salt: str
    tokens: bytes  # little-endian uint32 token ids
    max_tokens: int
    #: a handed-off prompt: the producer that computed it (``host:port``), read from first, and the prompt's
    #: partial last chunk too (:mod:`.handoff`)
    producer: str | None = None
    #: tokens vLLM holds already (its own prefix cache): the chunks wholly before them are not asked for
    computed: int = 0


@dataclass(frozen=True, slots=True)
class ReleaseCall:
    request_id: str


@dataclass(frozen=True, slots=True)
class StatsCall:
    seq: int


@dataclass(frozen=True, slots=True)
class Reply:
    """The worker's answer to call ``seq``: a lookup's (:class:`~kvengine.lookups.LookupResult`, without its
    reservation; ``PENDING`` first where the answer follows) or the stats."""

    seq: int
    result: LookupResult = MISS
    stats: dict[str, float] = field(default_factory=dict)


class LookupHandler(Protocol):
    """What the worker answers with (its cache engine)."""

    def lookup(self, request_id: str, salt: str, tokens: bytes, max_tokens: int,
               producer: str | None = None, computed: int = 0) -> LookupResult: ...

    def lookup_now(self, request_id: str, salt: str, tokens: bytes, max_tokens: int,
                   producer: str | None = None, computed: int = 0) -> LookupResult | None:
        """The answer if it needs no wait (memory holds it), without blocking; None: call ``lookup``."""
        ...

    def release(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, float]: ...


class OrderedExecutor:
    """Runs calls on a thread pool: concurrently across keys, one at a time and in submission order per key."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._queues: dict[Hashable, deque[Callable[[], None]]] = {}  # keys with a call running: what waits

    def submit(self, key: Hashable, call: Callable[[], None]) -> None:
        with self._lock:
            waiting = self._queues.get(key)
            if waiting is not None:
                waiting.append(call)
                return
            self._queues[key] = deque()
        self._start(key, call)

    def busy(self, key: Hashable) -> bool:
        """Whether a call of ``key`` is running or waiting."""
        with self._lock:
            return key in self._queues

    def _start(self, key: Hashable, call: Callable[[], None]) -> None:
        try:
            self._pool.submit(call).add_done_callback(lambda _: self._next(key))
        except RuntimeError:  # the pool is shut down: nothing more runs
            with self._lock:
                self._queues.pop(key, None)

    def _next(self, key: Hashable) -> None:
        with self._lock:
            waiting = self._queues[key]
            if not waiting:
                del self._queues[key]
                return
            call = waiting.popleft()
        self._start(key, call)


class LookupService:
    """Worker end: serves a :class:`LookupHandler` on a private Unix socket.

    :meth:`start` returns ``(path, authkey)`` to hand to the scheduler;
    :meth:`close` stops the threads and removes the socket directory.
    """

    def __init__(self, handler: LookupHandler) -> None:
        self._handler = handler
        self._pool = executor(_HANDLERS, "kvengine-vllm-lookup")
        self._calls = OrderedExecutor(self._pool)
        self._dir = tempfile.mkdtemp(prefix="kvengine-vllm-")
        self.path = os.path.join(self._dir, "lookup.sock")
        self.authkey = secrets.token_bytes(32)
        self._listener: Listener | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> tuple[str, bytes]:
        self._listener = Listener(self.path, family="AF_UNIX", authkey=self.authkey)
        self._spawn(self._accept_loop, "kvengine-vllm-accept")
        return self.path, self.authkey

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        self._threads.append(start_thread(target, name, *args))

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, AuthenticationError):  # closed, or a client that failed authentication
                if self._stop.is_set():
                    return
                continue
            self._spawn(self._serve, "kvengine-vllm-lookup", conn)

    def _serve(self, conn: Connection) -> None:
        frames = Frames(conn)
        sending = threading.Lock()  # replies come from several handler threads

        def send(reply: Reply | None) -> None:
            if reply is None:
                return
            with sending:
                try:
                    frames.send(reply)
                except OSError:  # the scheduler is gone; the reader below notices
                    pass

        try:
            self._read(frames, send)
        finally:
            frames.close()

    def _read(self, frames: Frames, send: Callable[[Reply | None], None]) -> None:
        def answer(msg: object) -> None:
            send(self._handle(msg))

        while not self._stop.is_set():
            try:
                if not frames.poll(_POLL_S):
                    continue
                msg = frames.recv()
            except (OSError, EOFError):
                return
            # Calls of one request keep their order (a release never overtakes its lookup).
            key = getattr(msg, "request_id", None) or ("seq", getattr(msg, "seq", None))
            if not self._calls.busy(key):
                # Nothing of this request is queued (this thread is the only one that queues), so
                # handling it here keeps the order and skips two thread hand-offs.
                if isinstance(msg, ReleaseCall):
                    self._handle(msg)
                    continue
                if isinstance(msg, LookupCall):
                    reply = self._handle_now(msg)
                    if reply is not None:
                        send(reply)
                        continue
            if isinstance(msg, LookupCall):
                send(Reply(msg.seq, PENDING))  # sent before the answer can be: the order holds
            self._calls.submit(key, functools.partial(answer, msg))

    def _handle_now(self, msg: LookupCall) -> Reply | None:
        """The reply if the handler has it without waiting; None (also on an error): the pool answers."""
        try:
            answer = self._handler.lookup_now(msg.request_id, msg.salt, msg.tokens, msg.max_tokens, msg.producer,
                                              msg.computed)
        except Exception:  # the pool's call reports it (as a miss, with the error)
            return None
        return None if answer is None else _answered(msg, answer)

    def _handle(self, msg: object) -> Reply | None:
        try:
            if isinstance(msg, LookupCall):
                return _answered(msg, self._handler.lookup(msg.request_id, msg.salt, msg.tokens, msg.max_tokens,
                                                          msg.producer, msg.computed))
            if isinstance(msg, ReleaseCall):
                self._handler.release(msg.request_id)
                return None
            if isinstance(msg, StatsCall):
                return Reply(msg.seq, stats=self._handler.stats())
            logger.error("kvengine vLLM channel: unknown message %r dropped", type(msg).__name__)
            return None
        except Exception as exc:  # answered as a miss, never kills the service
            seq = getattr(msg, "seq", -1)
            logger.warning("kvengine vLLM channel: %s failed: %s: %s", type(msg).__name__, type(exc).__name__, exc)
            return Reply(seq, LookupResult(LookupOutcome.FAILED, error=f"{type(exc).__name__}: {exc}")) \
                if seq >= 0 else None

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=2 * _POLL_S + 1)
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self._dir, ignore_errors=True)


def _answered(call: LookupCall, answer: LookupResult) -> Reply:
    return Reply(call.seq, answer)  # pickled without its reservation (LookupResult.__reduce__)


class ChannelClosed(Exception):
    """The worker end is gone; every later call is a miss."""


class LookupClient:
    """Scheduler end. Not thread-safe: vLLM's scheduler calls it from one thread.

    Calls are submitted without waiting (:meth:`submit`); answers are
    collected with :meth:`result`, which waits at most ``wait_s``.
    """

    def __init__(self, path: str, authkey: bytes) -> None:
        self._conn: Frames | None = Frames(Client(path, family="AF_UNIX", authkey=authkey))
        self._seq = 0
        self._replies: dict[int, Reply] = {}
        self._abandoned: set[int] = set()

    @property
    def closed(self) -> bool:
        return self._conn is None

    def _send(self, msg: object) -> None:
        if self._conn is None:
            raise ChannelClosed("kvengine vLLM channel is closed")
        try:
            self._conn.send(msg)
        except OSError as exc:
            self.close()
            raise ChannelClosed(f"kvengine vLLM channel broke: {exc}") from None

    def submit(self, request_id: str, salt: str, tokens: bytes, max_tokens: int, *,
               producer: str | None = None, computed: int = 0) -> int:
        self._seq += 1
        self._send(LookupCall(self._seq, request_id, salt, tokens, max_tokens, producer, computed))
        return self._seq

    def release(self, request_id: str) -> None:
        self._send(ReleaseCall(request_id))

    def stats(self, wait_s: float = 5.0) -> dict[str, float]:
        self._seq += 1
        seq = self._seq
        self._send(StatsCall(seq))
        reply = self._reply(seq, wait_s)
        return dict(reply.stats) if reply is not None else {}

    def result(self, seq: int, wait_s: float, *, until_pending: bool = False) -> LookupResult:
        """Lookup ``seq``'s answer if it arrives within ``wait_s``, else ``PENDING`` (ask again later).

        ``until_pending``: stop waiting as soon as the worker says the answer is pending.
        """
        reply = self._reply(seq, wait_s, until_pending=until_pending)
        return PENDING if reply is None else reply.result

    def _reply(self, seq: int, wait_s: float, *, until_pending: bool = False) -> Reply | None:
        """The reply to call ``seq`` if it arrives within ``wait_s``, else None."""
        if seq in self._replies:
            return self._replies.pop(seq)
        if self._conn is None:
            raise ChannelClosed("kvengine vLLM channel is closed")
        deadline = time.monotonic() + wait_s
        try:
            while self._conn.poll(max(0.0, deadline - time.monotonic())):
                reply = self._conn.recv()
                if not isinstance(reply, Reply):
                    raise OSError(f"unexpected message {type(reply).__name__}")
                if reply.result.outcome is LookupOutcome.PENDING:  # the answer follows; nothing to keep
                    if reply.seq == seq and until_pending:
                        return None
                    continue
                if reply.seq == seq:
                    return reply
                if reply.seq in self._abandoned:
                    self._abandoned.discard(reply.seq)
                else:
                    self._replies[reply.seq] = reply
        except (OSError, EOFError) as exc:
            self.close()
            raise ChannelClosed(f"kvengine vLLM channel broke: {exc}") from None
        return None

    def forget(self, seq: int) -> None:
        """Drop the answer of an abandoned call, now or when it arrives."""
        if self._replies.pop(seq, None) is None:
            self._abandoned.add(seq)

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None
