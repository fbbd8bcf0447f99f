"""A worker's forwarded routes (``/health``, ``/metrics``, the models listing: ``worker_main.ToAuthority``) never
turn into a 500: whatever the authority's private socket does, the client gets the authority's answer or a 503
with ``Retry-After``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
import uvloop

from gateway.config import Settings
from gateway.http.worker_main import ToAuthority


async def _refusing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """As a server at its connection cap answers: at once, before the request, then a half-close."""
    writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
    writer.write_eof()
    writer.close()


async def _forward(path: Path, route: str) -> list[dict[str, Any]]:
    server = await asyncio.start_unix_server(_refusing, str(path))
    forward = ToAuthority(Settings(), str(path))
    await forward.start()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        scope = {"type": "http", "method": "GET", "path": route, "raw_path": route.encode(), "query_string": b"",
                 "headers": []}
        await forward(scope, receive, send)
    finally:
        await forward.close()
        server.close()
    return sent


@pytest.mark.parametrize("route", ["/health", "/v1/models", "/metrics"])
def test_an_authority_that_answers_and_closes_before_the_request_is_a_503_never_a_500(
    tmp_path: Path, route: str
) -> None:
    sent = uvloop.run(_forward(tmp_path / "app.sock", route))
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 503
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if body != b"{}":  # not the authority's own answer: the worker's, with Retry-After
        assert int(dict(start["headers"])[b"retry-after"]) >= 1
        if route != "/health":  # /health says why in its own shape; the others in OpenAI's
            assert orjson.loads(body)["error"]["type"]
