"""A real Mooncake Store cluster on loopback for tests: the master, and a process that holds a segment.

* :class:`Master` runs ``mooncake_master`` (a console script of the mooncake wheel, next to
  ``sys.executable``) on 127.0.0.1, restartable on the same port.
* :class:`SegmentHolder` is a Mooncake client that contributes a memory segment and does nothing
  else. Objects live in the segments of live clients only (Mooncake drops a segment's objects
  when its owner leaves), so a holder lets writers with ``segment_bytes: 0`` exit while their
  chunks stay readable by later processes.

Both are context managers and both die with the thread that started them (``PR_SET_PDEATHSIG``),
so a test runner killed on a timeout leaves neither behind. Start them from a thread that lives
as long as they should (the main thread).

This file is also the holder's program: ``python -m tests.mooncake_master hold HOST MASTER SEGMENT_BYTES``.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[1]


def _die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get SIGKILL when the thread that started it ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"mooncake_master exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"mooncake_master did not listen on {port} within {timeout} s")


class Master:
    """A real ``mooncake_master`` on loopback, restartable on the same port."""

    def __init__(self) -> None:
        from tests.integrations.ports import free_port

        self.port, self.metrics_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
        assert binary is not None, "mooncake_master is not installed (scripts/setup.sh test installs it)"
        self.proc = subprocess.Popen(
            [binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent())
        try:
            _wait_listening(self.port, self.proc)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """Kill the master if it runs (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()

    def __enter__(self) -> Master:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


class SegmentHolder:
    """A Mooncake client process on ``host`` that mounts a ``segment_bytes`` segment into the cluster of
    ``master`` and holds it until :meth:`stop`."""

    def __init__(self, master: str, *, host: str = "127.0.0.4", segment_bytes: int = 256 << 20,
                 timeout: float = 30.0) -> None:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": host, "MC_STORE_CLIENT_SETUP_RETRIES": "1",
               "GLOG_minloglevel": "2"}
        self.host = host
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.mooncake_master", "hold", host, master,
                                      str(segment_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=ROOT, env=env, preexec_fn=_die_with_parent())
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc.stdout is not None
        fd, out = self.proc.stdout.fileno(), b""  # read unbuffered: select sees every byte
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and b"ready\n" not in out:
            if not select.select([fd], [], [], left)[0]:
                break
            more = os.read(fd, 4096)
            if not more:
                raise AssertionError(f"the segment holder on {self.host} exited ({self.proc.wait()}): {out!r}")
            out += more
        if b"ready\n" not in out:
            raise AssertionError(f"the segment holder on {self.host} was not ready within {timeout} s: {out!r}")

    def stop(self) -> None:
        """End the holder (its segment, and every object in it, leaves the cluster). Idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    def __enter__(self) -> SegmentHolder:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def hold_main(host: str, master: str, segment_bytes: str) -> int:
    """The holder's program: mount the segment, say ``ready``, hold it until stdin closes."""
    assert os.environ.get("MC_TCP_BIND_ADDRESS") == host, "MC_TCP_BIND_ADDRESS must be the holder's address"
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(host, "P2PHANDSHAKE", int(segment_bytes), 16 << 20, "tcp", "", master)
    if code != 0:
        print(f"setup returned {code}", flush=True)
        return 1
    print("ready", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["hold"]:
    sys.exit(hold_main(*sys.argv[2:]))
