"""A minimal pass-through, for choosing an upstream HTTP client by measurement: the same Starlette app on uvicorn +
uvloop + httptools forwards ``POST /v1/chat/completions`` to one upstream; only the client differs (``aiohttp``,
``httpx``, ``httpx-aiohttp`` where that package is installed).

    python -m bench.servers.passthrough KIND UPSTREAM_URL PORT
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

KINDS = ("aiohttp", "httpx", "httpx-aiohttp")


def build(kind: str, upstream: str) -> Starlette:
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if kind == "aiohttp":
            import aiohttp

            state["c"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512))
        elif kind == "httpx":
            import httpx

            state["c"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))
        else:
            import httpx
            from httpx_aiohttp import AiohttpTransport

            state["c"] = httpx.AsyncClient(transport=AiohttpTransport())
        try:
            yield
        finally:
            await state["c"].close() if kind == "aiohttp" else await state["c"].aclose()

    async def chat(request: Request) -> Response:
        body = await request.body()
        headers = {"content-type": "application/json"}
        if kind == "aiohttp":
            async with state["c"].post(upstream, data=body, headers=headers) as r:
                return Response(await r.read(), status_code=r.status, media_type="application/json")
        r = await state["c"].post(upstream, content=body, headers=headers)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b"ok")

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)]
    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: list[str]) -> int:
    kind, upstream, port = argv[0], argv[1], int(argv[2])
    if kind not in KINDS:
        raise SystemExit(f"passthrough: KIND is one of {', '.join(KINDS)}, got {kind!r}")
    uvicorn.run(build(kind, upstream), host="127.0.0.1", port=port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
