"""The routes the gateway does not guard: the model listing and plain pass-through."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from gateway.engine.client import UpstreamStream, response_headers
from gateway.engine.sse import SSEFramer
from gateway.engine.vllm_api import parse_models, upstream_error_from
from gateway.errors import GatewayError
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
    headers = dict(request.headers.items())
    headers["x-request-id"] = rid
    stream = await parts.serving_engine().client.open(
        request.method, path, body=body or None, headers=headers, params=dict(request.query_params)
    )
    if stream.status >= 400 and stream.headers.get("content-type", "").startswith("application/json"):
        try:
            payload = await stream.read_all()
        finally:
            stream.close()
        raise upstream_error_from(stream.status, payload, stream.headers)
    relayed = {k: v for k, v in response_headers(stream.headers).items() if k.lower() not in _RESPONSE_DROP}
    relayed["x-request-id"] = rid
    if not stream.headers.get("content-type", "").startswith("text/event-stream"):
        # Read whole before answering: a body the upstream cuts midway then becomes a clear 502/503, where a
        # relayed one would reach the client as a well-ended but truncated 200. These answers are small.
        try:
            payload = await stream.read_raw()
        finally:
            stream.close()
        return Response(payload, status_code=stream.status, headers=relayed)
    events = relay(stream, path, rid, parts.settings.max_stream_event_bytes)
    return StreamingResponse(events, status_code=stream.status, headers=relayed)


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
