"""Length-prefixed pickled messages over a connected, already authenticated Unix socket.

The channel authenticates with :mod:`multiprocessing.connection` (HMAC
challenge with the channel's random key), then moves its messages with this
instead: one ``sendall`` per message, one ``poll`` object per connection,
and ``recv`` into a buffer that keeps what a read brought beyond the frame.
``Connection.poll`` builds a new selector on every call and reads header and
body in separate calls; on the scheduler's path that cost a round trip's
tail (``benchmarks/bench_vllm_lookup.py``).

Only peers that passed the handshake reach :meth:`Frames.recv`, which is why
unpickling here is as safe as ``Connection.recv``.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import time
from multiprocessing.connection import Connection

_HEADER = struct.Struct("<I")
_READ = 1 << 16


class Frames:
    """One end of the channel's connection. ``send`` is not thread-safe (callers lock); ``poll`` and
    ``recv`` belong to one reading thread. Raises ``EOFError`` when the other end is gone, ``OSError``
    when the socket fails."""

    def __init__(self, conn: Connection) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        conn.close()
        self._sock.setblocking(True)
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)
        self._buf = bytearray()

    def send(self, msg: object) -> None:
        body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._sock.sendall(_HEADER.pack(len(body)) + body)

    def poll(self, timeout_s: float) -> bool:
        """Whether a whole message can be received now, waiting up to ``timeout_s`` for one."""
        deadline = time.monotonic() + timeout_s
        while not self._complete():
            if not self._poller.poll(max(0.0, deadline - time.monotonic()) * 1e3):
                return False
            self._fill()
        return True

    def recv(self) -> object:
        while not self._complete():
            self._fill()
        n = _HEADER.unpack_from(self._buf)[0]
        msg = pickle.loads(self._buf[_HEADER.size : _HEADER.size + n])
        del self._buf[: _HEADER.size + n]
        return msg

    def close(self) -> None:
        self._sock.close()

    def _complete(self) -> bool:
        return len(self._buf) >= _HEADER.size and len(self._buf) >= _HEADER.size + _HEADER.unpack_from(self._buf)[0]

    def _fill(self) -> None:
        data = self._sock.recv(_READ)
        if not data:
            raise EOFError("the other end closed the channel")
        self._buf += data
