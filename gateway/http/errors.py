"""The one place a domain error becomes an answer: its HTTP status and OpenAI type, its headers, its JSON body,
and the same error inside an already-started event stream.

Every answer has OpenAI's nested shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
import math

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.errors import (
    AuthenticationFailed,
    BadUpstreamResponse,
    GatewayError,
    HeadersTooLarge,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    QueueFull,
    QueueTimeout,
    QueueTimeoutExpected,
    RequestTimeout,
    TenantRateLimited,
    TooManyConnections,
    UnsupportedField,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

log = logging.getLogger(__name__)

# Status and OpenAI type by error class; the most specific class listed wins (walked along the MRO).
STATUS_AND_TYPE: dict[type[GatewayError], tuple[int, str]] = {
    InvalidRequest: (400, "invalid_request_error"),
    UnsupportedField: (400, "invalid_request_error"),
    NotFound: (404, "invalid_request_error"),
    ModelNotFound: (404, "invalid_request_error"),
    MethodNotAllowed: (405, "invalid_request_error"),
    RequestTimeout: (408, "invalid_request_error"),
    PayloadTooLarge: (413, "invalid_request_error"),
    HeadersTooLarge: (431, "invalid_request_error"),
    AuthenticationFailed: (401, "authentication_error"),
    PermissionDenied: (403, "permission_error"),
    QueueFull: (429, "rate_limit_error"),
    TenantRateLimited: (429, "rate_limit_error"),
    QueueTimeout: (503, "server_error"),
    QueueTimeoutExpected: (503, "server_error"),
    UpstreamUnavailable: (503, "server_error"),
    TooManyConnections: (503, "server_error"),
    BadUpstreamResponse: (502, "server_error"),
    UpstreamTimeout: (504, "server_error"),
    GatewayError: (500, "server_error"),
}


def status_and_type(exc: GatewayError) -> tuple[int, str]:
    if isinstance(exc, UpstreamError):
        return exc.status, exc.type  # relayed as the upstream said it
    for cls in type(exc).__mro__:
        found = STATUS_AND_TYPE.get(cls)
        if found is not None:
            return found
    return STATUS_AND_TYPE[GatewayError]


def error_body(exc: GatewayError) -> dict[str, object]:
    _, etype = status_and_type(exc)
    return {"error": {"message": exc.message, "type": etype, "param": exc.param, "code": exc.code}}


def error_headers(exc: GatewayError) -> dict[str, str]:
    headers: dict[str, str] = {}
    if exc.retry_after is not None:
        # Whole seconds, at least 1: the OpenAI SDKs and browsers read integer Retry-After.
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after)))
    elif isinstance(exc, UpstreamError) and exc.upstream_retry_after:
        headers["retry-after"] = exc.upstream_retry_after
    if isinstance(exc, MethodNotAllowed) and exc.allowed:
        headers["allow"] = exc.allowed
    if exc.close_connection:
        headers["connection"] = "close"
    return headers


def error_response(exc: GatewayError, extra_headers: dict[str, str] | None = None) -> Response:
    headers = error_headers(exc)
    if extra_headers:
        headers.update(extra_headers)
    return Response(
        content=orjson.dumps(error_body(exc)),
        status_code=status_and_type(exc)[0],
        media_type="application/json",
        headers=headers,
    )


def sse_error_events(exc: GatewayError) -> tuple[bytes, bytes]:
    """An error inside an already-started stream, as vLLM sends it: a data event, then [DONE]. Two events,
    to be written one per write like every other event, and only ever between events."""
    return b"data: " + orjson.dumps(error_body(exc)) + b"\n\n", b"data: [DONE]\n\n"


def sse_error_event(exc: GatewayError) -> bytes:
    """``sse_error_events`` as one piece of bytes."""
    return b"".join(sse_error_events(exc))


def install_handlers(app: FastAPI) -> None:
    async def on_gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc, _request_id_header(request))

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        err = InvalidRequest(f"{first.get('msg', 'invalid request')} ({loc})", param=loc)
        return error_response(err, _request_id_header(request))

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        err: GatewayError
        if exc.status_code == 404:
            err = NotFound(f"Unknown path: {request.method} {request.url.path}")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}")
        else:
            etype = "invalid_request_error" if exc.status_code < 500 else "server_error"
            err = UpstreamError(exc.status_code, str(exc.detail), type=etype, param=None, code=None)
        return error_response(err, _request_id_header(request))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return internal_error_response(request)

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)


def internal_error_response(request: Request) -> Response:
    """A bug of ours: log the traceback (call from an except block), tell the client nothing internal."""
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    err = GatewayError("The gateway hit an internal error; it has been logged.", code="internal_error")
    return error_response(err, _request_id_header(request))


def _request_id_header(request: Request) -> dict[str, str]:
    rid = getattr(request.state, "request_id", None)
    return {"x-request-id": rid} if isinstance(rid, str) else {}
