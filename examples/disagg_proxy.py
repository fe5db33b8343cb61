"""An OpenAI-compatible proxy for prefill/decode disaggregation through kvengine (docs/vllm.md).

    python examples/disagg_proxy.py --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 8000

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes to a prefill
instance (``vllm serve`` with ``kv_role: kv_producer``) with ``max_tokens`` 1
and no streaming, then to a decode instance (``kv_role: kv_consumer``) with the
``kv_transfer_params`` of the prefill's response in its body; the decode
instance's answer, streamed or not, is relayed as it comes. Several
``--prefill`` / ``--decode`` URLs are used in turn.

A prefill instance that fails, or does not answer within ``--prefill-timeout``,
costs nothing but time: the request goes to a decode instance without params,
which then computes the prompt itself (logged). Other paths are forwarded to
the first decode instance (``/v1/models``, ``/health``...).

aiohttp is vLLM's own dependency, so it is there wherever vLLM is.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("disagg_proxy")
GENERATE = ("/v1/completions", "/v1/chat/completions")


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], prefill_timeout: float) -> None:
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._first_decode = decode[0]
        self._timeout = aiohttp.ClientTimeout(total=prefill_timeout)
        self.session: aiohttp.ClientSession | None = None
        self.prefill_failures = 0

    async def start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            return web.json_response({"error": f"request body is not JSON: {exc}"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request body must be a JSON object"}, status=400)
        params = await self._prefill_params(request.path, body)
        decode = dict(body)
        if params is not None:
            decode["kv_transfer_params"] = params
        return await self._relay(request, next(self._decode) + request.path, decode)

    async def _prefill_params(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The prefill instance's ``kv_transfer_params`` for ``body`` (None: it failed; decode computes)."""
        assert self.session is not None
        prefill = {**body, "max_tokens": 1, "stream": False}
        prefill.pop("stream_options", None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        url = next(self._prefill) + path
        try:
            async with self.session.post(url, json=prefill, timeout=self._timeout) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}: {answer}")
        except Exception as exc:  # a fault of the prefill instance: the decode instance computes the prompt
            self.prefill_failures += 1
            log.warning("prefill at %s failed (%s); the decode instance computes the prompt", url, exc)
            return None
        params = answer.get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return await self._relay(request, self._first_decode + request.path_qs, body if body else None,
                                 method=request.method)

    async def _relay(self, request: web.Request, url: str, body: Any, method: str = "POST") -> web.StreamResponse:
        assert self.session is not None
        kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
        try:
            async with self.session.request(method, url, **kwargs) as upstream:
                response = web.StreamResponse(status=upstream.status, headers={
                    "Content-Type": upstream.headers.get("Content-Type", "application/json")})
                await response.prepare(request)
                async for piece in upstream.content.iter_any():
                    await response.write(piece)
                await response.write_eof()
                return response
        except aiohttp.ClientError as exc:
            return web.json_response({"error": f"decode instance {url} failed: {exc}"}, status=502)


def build_app(prefill: list[str], decode: list[str], prefill_timeout: float = 600.0) -> web.Application:
    proxy = Proxy([u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode], prefill_timeout)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    for path in GENERATE:
        app.router.add_post(path, proxy.generate)
    app.router.add_route("*", "/{tail:.*}", proxy.forward)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill instance (repeatable)")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode instance (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill-timeout", type=float, default=600.0, metavar="S",
                   help="past this, the decode instance computes the prompt itself (default 600)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    web.run_app(build_app(args.prefill, args.decode, args.prefill_timeout), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
