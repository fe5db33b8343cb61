"""examples/disagg_proxy.py's routing, against stand-in HTTP instances that record what they receive
(real sockets, real aiohttp on both sides; the instances themselves are not vLLM here: the two-instance
path on real vLLM engines is test_vllm_disaggregation.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None,
                                reason="aiohttp comes with vLLM (use .venv-vllm)")

ROOT = Path(__file__).resolve().parents[2]
PARAMS = {"kvengine_handoff": {"producer": "127.0.0.1:7601", "tokens": 9, "namespace": "ab" * 16}}


def _proxy_module() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import disagg_proxy
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return disagg_proxy


class Instance:
    """A stand-in vLLM OpenAI server: records request bodies; a prefill answers with PARAMS, a decode
    streams two SSE events when asked to stream."""

    def __init__(self, *, prefill: bool, fail: bool = False) -> None:
        from aiohttp import web

        self.bodies: list[dict[str, Any]] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.prefill, self.fail = prefill, fail

    async def completions(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.bodies.append(body)
        if self.fail:
            return web.json_response({"error": "down"}, status=500)
        if self.prefill:
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for text in ("a", "b"):
                await response.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response({"choices": [{"text": "ab"}]})

    async def models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"data": [{"id": "m"}]})


async def _serve(app: Any) -> tuple[Any, str]:
    from aiohttp.test_utils import TestServer

    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


async def _setup(prefill_fails: bool = False) -> tuple[Instance, Instance, str, list[Any]]:
    prefill, decode = Instance(prefill=True, fail=prefill_fails), Instance(prefill=False)
    p_server, p_url = await _serve(prefill.app)
    d_server, d_url = await _serve(decode.app)
    proxy_server, url = await _serve(_proxy_module().build_app([p_url], [d_url], prefill_timeout=5))
    return prefill, decode, url, [proxy_server, p_server, d_server]


async def test_prefill_gets_one_token_and_decode_gets_its_params_streamed_back():
    import aiohttp

    prefill, decode, url, servers = await _setup()
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hello", "max_tokens": 64, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with s.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                text = await resp.text()
            async with s.get(url + "/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "m"
    finally:
        for server in servers:
            await server.close()
    (p,) = prefill.bodies
    assert (p["max_tokens"], p["stream"], "stream_options" in p) == (1, False, False)
    (d,) = decode.bodies
    assert d["max_tokens"] == 64 and d["stream"] is True and d["kv_transfer_params"] == PARAMS
    assert text.count("data: ") == 3 and text.endswith("data: [DONE]\n\n")  # relayed as streamed


async def test_a_failed_prefill_sends_the_request_to_decode_without_params():
    import aiohttp

    prefill, decode, url, servers = await _setup(prefill_fails=True)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["text"] == "ab"
            async with s.post(url + "/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400
                assert "not JSON" in (await resp.json())["error"]
    finally:
        for server in servers:
            await server.close()
    assert len(prefill.bodies) == 1
    (d,) = decode.bodies
    assert "kv_transfer_params" not in d
