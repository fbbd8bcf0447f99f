"""The routes the gateway does not guard: the model listing and plain pass-through."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from gateway.engine.client import UpstreamStream, decoder_for, response_headers
from gateway.engine.sse import SSEFramer
from gateway.engine.vllm_api import parse_models, upstream_error_from
from gateway.errors import BadUpstreamResponse, GatewayError
from gateway.guard.parts import Parts
from gateway.guard.policy import effective_max_model_len
from gateway.http.auth import authenticate
from gateway.http.body import BodyLimits, read_body
from gateway.http.context import request_id
from gateway.http.errors import sse_error_events

log = logging.getLogger(__name__)

# An upstream's cookies are its own business: relayed, they would be shared by every client of the gateway.
_RESPONSE_DROP = frozenset({"set-cookie", "set-cookie2"})


async def list_models(parts: Parts, request: Request) -> Response:
    rid = request_id(request)
    authenticate(parts.settings, request)
    reply = await parts.serving_engine().client.request("GET", "/v1/models", timeout=10.0)
    if reply.status != 200:
        raise upstream_error_from(reply.status, reply.body, reply.headers)
    info = parse_models(reply.body)
    parts.models.update(info)
    limit = effective_max_model_len(info.max_model_len, parts.settings.max_model_len)
    return Response(
        parts.models.rewrite_listing(reply.body, limit), media_type="application/json",
        headers={"x-request-id": rid},
    )


async def passthrough(parts: Parts, request: Request, path: str) -> Response:
    """A pass-through route of the route table: forwarded with auth to ``path`` (canonical, from the table,
    never the client's own), streamed back as it comes. The client's credentials stay here (upstream.py
    drops them); the gateway's own upstream key goes instead."""
    rid = request_id(request)
    authenticate(parts.settings, request)
    try:
        body = await read_body(request, BodyLimits.of(parts.settings))
    except ClientDisconnect:
        return Response(status_code=499)
    return await forward(parts, request, path, body, rid)


async def forward(
    parts: Parts, request: Request, path: str, body: bytes, rid: str, *, check: Callable[[bytes], None] | None = None
) -> Response:
    """``body`` sent to the engine at ``path``; its answer relayed: an event stream one whole event per write,
    anything else read whole within ``--max-answer-bytes`` (``check``, if given, sees a 200 answer first and may
    refuse it)."""
    headers = dict(request.headers.items())
    headers["x-request-id"] = rid
    stream = await parts.serving_engine().client.open(
        request.method, path, body=body or None, headers=headers, params=dict(request.query_params)
    )
    limit = parts.settings.max_answer_bytes
    if stream.status >= 400 and stream.headers.get("content-type", "").startswith("application/json"):
        try:
            payload = await read_bounded(stream, path, limit)
        finally:
            stream.close()
        decoder = decoder_for(stream.headers)
        if decoder is not None:
            payload = decoder.decode(payload, limit) + decoder.finish()
        raise upstream_error_from(stream.status, payload, stream.headers)
    relayed = {k: v for k, v in response_headers(stream.headers).items() if k.lower() not in _RESPONSE_DROP}
    relayed["x-request-id"] = rid
    if not stream.headers.get("content-type", "").startswith("text/event-stream"):
        # Read whole before answering: a body the upstream cuts midway then becomes a clear 502/503, where a
        # relayed one would reach the client as a well-ended but truncated 200.
        try:
            payload = await read_bounded(stream, path, limit)
        finally:
            stream.close()
        if check is not None and stream.status == 200:
            decoder = decoder_for(stream.headers)
            check(payload if decoder is None else decoder.decode(payload, limit) + decoder.finish())
        return Response(payload, status_code=stream.status, headers=relayed)
    events = relay(stream, path, rid, parts.settings.max_stream_event_bytes)
    return StreamingResponse(events, status_code=stream.status, headers=relayed)


async def read_bounded(stream: UpstreamStream, path: str, limit: int) -> bytes:
    """The whole answer as sent, refused (502) at the first byte past ``limit``: nothing more is read, and
    closing the stream then drops the connection, which aborts the upstream's request."""
    declared = stream.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(path, limit, f"{int(declared)} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream.chunks():
        size += len(chunk)
        if size > limit:
            raise _too_large(path, limit, f"more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(path: str, limit: int, size: str) -> BadUpstreamResponse:
    return BadUpstreamResponse(
        f"The upstream's answer to {path} is {size}; the gateway relays at most {limit} bytes "
        "(--max-answer-bytes). Nothing of it was sent."
    )


async def relay(stream: UpstreamStream, path: str, rid: str, max_event_bytes: int) -> AsyncIterator[bytes]:
    """An event stream relayed one whole event per write, as the guarded routes relay theirs. A stream the
    upstream cuts midway ends cleanly for the client, with an error event after its last whole event and one
    warning in the log (never an exception once the response has started)."""
    framer = SSEFramer(max_event_bytes)
    try:
        async for chunk in stream.chunks():
            for event in framer.feed(chunk):
                yield event
        for event in framer.close():
            yield event
    except GatewayError as exc:
        log.warning("request %s: the upstream cut the pass-through response of %s midway: %s", rid, path, exc.message)
        # A partial event is dropped rather than glued to the error event, which no client could parse.
        for event in sse_error_events(exc):
            yield event
    finally:
        stream.close()
