"""A TCP relay between a peer-wire client and its server that can cut a transfer in the middle.

Tests put it between a decode instance and a producer's handoff server (the producer advertises the relay,
the consumer dials it). Forwarding is plain until :meth:`StallingRelay.arm`: from then on, each connection
stops forwarding server-to-client bytes once ``after_bytes`` more have passed, so the client holds part of
its answer; when ``connections`` connections have stalled (or ``wait_s`` after the first did), ``action``
runs (kill the server or the client) and the stalled connections are closed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Arming:
    after_bytes: int
    connections: int
    wait_s: float
    action: Callable[[], None]
    done: threading.Event = field(default_factory=threading.Event)
    stalled: int = 0
    fired: bool = False
    #: how running ``action`` ended (for a failing test's message): None until it has
    outcome: str | None = None
    release: asyncio.Event = field(default_factory=asyncio.Event)


class StallingRelay:
    """Listens on 127.0.0.1 (:attr:`port`) and forwards each connection to ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._loop = asyncio.new_event_loop()
        self._arming: _Arming | None = None
        self._firing: set[asyncio.Future[None]] = set()  # running actions (the loop keeps only weak references)
        self._thread = threading.Thread(target=self._loop.run_forever, name="stalling-relay", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, "127.0.0.1", 0), self._loop).result(10)
        self.port: int = self._server.sockets[0].getsockname()[1]

    def arm(self, after_bytes: int, connections: int, action: Callable[[], None],
            wait_s: float = 20.0) -> threading.Event:
        """Cut the next transfers as described above; the returned event is set once ``action`` has run."""
        async def install() -> _Arming:
            self._arming = _Arming(after_bytes, connections, wait_s, action)
            return self._arming
        return asyncio.run_coroutine_threadsafe(install(), self._loop).result(10).done

    @property
    def progress(self) -> tuple[int, str | None]:
        """Connections the latest :meth:`arm` has stalled so far, and how its action ended (None: not run or
        still running), for a failing test's message."""
        return (self._arming.stalled, self._arming.outcome) if self._arming is not None else (0, None)

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            if self._arming is not None:
                self._arming.release.set()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_w.close()
            return
        up = asyncio.ensure_future(self._pump(client_r, server_w, downstream=False))
        down = asyncio.ensure_future(self._pump(server_r, client_w, downstream=True))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for w in (client_w, server_w):
            w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, downstream: bool) -> None:
        arming, left = None, 0  # the arming this connection counts bytes for, and the bytes it still passes
        while data := await reader.read(1 << 16):
            if downstream and self._arming is not None and self._arming is not arming:
                arming, left = self._arming, self._arming.after_bytes
            if arming is not None and not arming.fired:
                if len(data) >= left:
                    writer.write(data[:left])
                    await writer.drain()
                    await self._stall(arming)
                    return
                left -= len(data)
            writer.write(data)
            await writer.drain()

    async def _stall(self, arming: _Arming) -> None:
        arming.stalled += 1
        if arming.stalled == 1:
            self._loop.call_later(arming.wait_s, self._start_firing, arming)
        if arming.stalled >= arming.connections:
            self._start_firing(arming)
        await arming.release.wait()

    def _start_firing(self, arming: _Arming) -> None:
        """Run the action in a task of its own: not in the stalled connection's, which is cancelled when the
        action kills the client (its connection closes) -- awaited there, the action's end was cancelled with
        it whenever the client died before the action returned, and the test never heard of the kill (3 runs
        of 7 with the servers in vLLM's default topology, 2026-12-07)."""
        self._firing.add(task := asyncio.ensure_future(self._fire(arming)))
        task.add_done_callback(self._firing.discard)

    async def _fire(self, arming: _Arming) -> None:
        if arming.fired:
            return
        arming.fired = True
        started = time.monotonic()
        try:
            await asyncio.get_running_loop().run_in_executor(None, arming.action)
        except Exception as exc:
            arming.outcome = f"{exc!r} after {time.monotonic() - started:.1f} s"
            raise
        finally:
            arming.release.set()
        arming.outcome = f"ran in {time.monotonic() - started:.1f} s"
        arming.done.set()
