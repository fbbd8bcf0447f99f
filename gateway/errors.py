"""One error hierarchy; each error knows its HTTP status and OpenAI type/code.

Stages raise ``GatewayError`` subclasses. ``error_response`` and ``install_handlers`` are the only
places where an error becomes an HTTP response, so every answer has OpenAI's nested shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    # The reason label for vllm_guard_rejections_total; None: not counted as a rejection.
    reason: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.headers: dict[str, str] = dict(headers or {})
        if retry_after is not None:
            # Whole seconds, at least 1: the OpenAI SDKs and browsers read integer Retry-After.
            self.headers["retry-after"] = str(max(1, math.ceil(retry_after)))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- client mistakes (4xx) ------------------------------------------------------------------------
class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    reason = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"
    reason = "context_length"


class MaxTokensExceeded(InvalidRequest):
    """max_tokens does not fit what the context leaves (policy reject)."""

    code = "context_length_exceeded"
    reason = "max_tokens"

    def __init__(self, message: str, **kw: Any) -> None:
        kw.setdefault("param", "max_tokens")
        super().__init__(message, **kw)


class KVBudgetExceeded(GatewayError):
    """A single request that could never fit the engine's whole KV budget: a client mistake like an
    over-long prompt. Retrying cannot help, so no Retry-After."""

    status = 400
    type = "invalid_request_error"
    code = "kv_budget_exceeded"
    reason = "kv_budget"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"
    reason = "model_not_found"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"
    reason = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"
    reason = "invalid_request"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    reason = "body_too_large"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    reason = "auth"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"
    code = "admin_key_required"
    reason = "auth"


class QueueFull(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    reason = "queue_full"


# -- our side or the upstream's (5xx) -------------------------------------------------------------
class QueueTimeout(GatewayError):
    status = 503
    type = "server_error"
    code = "queue_timeout"
    reason = "queue_timeout"


class UpstreamUnavailable(GatewayError):
    """The upstream cannot be reached, or is starting, restarting, draining or down."""

    status = 503
    type = "server_error"
    code = "upstream_unavailable"
    reason = "upstream_unavailable"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"
    reason = "upstream_timeout"


class BadUpstreamResponse(GatewayError):
    status = 502
    type = "server_error"
    code = "bad_upstream_response"
    reason = "bad_upstream_response"


class UpstreamError(GatewayError):
    """An error answer from the upstream, relayed with its status in OpenAI's nested shape."""

    reason = "upstream_error"

    def __init__(
        self, status: int, message: str, *, type: str, param: str | None, code: str | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code, headers=headers)
        self.status = status
        self.type = type



# -- connection and protocol limits (the HTTP server answers these itself) ------------------------
class RequestTimeout(GatewayError):
    """The request line, headers or body did not arrive in time."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    reason = "request_timeout"


class HeadersTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"
    reason = "headers_too_large"


class TooManyConnections(GatewayError):
    status = 503
    type = "server_error"
    code = "too_many_connections"
    reason = "too_many_connections"

# The error types OpenAI's API and SDKs know; anything else the upstream says (vLLM's "BadRequestError",
# Starlette's "Method Not Allowed") is replaced by the one its status implies.
OPENAI_ERROR_TYPES = frozenset(
    {"invalid_request_error", "authentication_error", "permission_error", "rate_limit_error", "server_error"}
)
_TYPE_BY_STATUS = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_HTML_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_RETRY_AFTER = re.compile(r"^(?:\d{1,9}|[A-Za-z]{3}, \d{2} [A-Za-z]{3} \d{4} \d{2}:\d{2}:\d{2} GMT)$")


def upstream_error_from(
    status: int, payload: bytes, headers: Mapping[str, str] | None = None
) -> UpstreamError | BadUpstreamResponse:
    """Normalise any upstream error answer (vLLM's nested body since 0.10.1, its flat one before, FastAPI's
    ``detail``, an HTML page) into OpenAI's shape; its ``Retry-After`` is kept."""
    if not 400 <= status <= 599:
        return BadUpstreamResponse(f"The upstream answered HTTP {status} where a result or an error was expected.")
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        src: dict[str, Any] = err
    elif isinstance(data, dict):
        src = data  # vLLM <= 0.10.0: {"object": "error", "message", "type", "param", "code"}
    else:
        src = {}
    message = str(src.get("message") or (err if isinstance(err, str) else "") or "")
    if not message and "detail" in src:
        detail = src["detail"]
        message = detail if isinstance(detail, str) else orjson.dumps(detail).decode()[:500]
    if not message:
        message = _plain_message(status, payload)
    raw_type = src.get("type")
    if isinstance(raw_type, str) and raw_type in OPENAI_ERROR_TYPES:
        etype = raw_type
    else:
        etype = _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
    param = src["param"] if isinstance(src.get("param"), str) else None
    # vLLM puts the HTTP status in code; only a string code says more than the status does.
    code = src["code"] if isinstance(src.get("code"), str) else None
    if code is None and "maximum context length" in message:
        code = "context_length_exceeded"
    if status == 404 and code is None and "model" in message.lower():
        code = "model_not_found"
    retry_after = (headers or {}).get("retry-after") or (headers or {}).get("Retry-After") or ""
    retry_after = retry_after.strip()
    kept = {"retry-after": retry_after} if _RETRY_AFTER.match(retry_after) else None
    return UpstreamError(status, message, type=etype, param=param, code=code, headers=kept)


def _plain_message(status: int, payload: bytes) -> str:
    """A message from a body that is not JSON: an HTML page's title (not its markup), else the text."""
    title = _HTML_TITLE.search(payload[:4096])
    if title is not None:
        text = " ".join(title.group(1).decode("utf-8", "replace").split())[:200]
        return f"The upstream answered HTTP {status} with an HTML page: {text}"
    return payload[:500].decode("utf-8", "replace").strip() or f"upstream answered HTTP {status}"


# -- the one place errors become responses --------------------------------------------------------
def error_response(exc: GatewayError, extra_headers: dict[str, str] | None = None) -> Response:
    headers = dict(exc.headers)
    if extra_headers:
        headers.update(extra_headers)
    return Response(
        content=orjson.dumps(exc.body()),
        status_code=exc.status,
        media_type="application/json",
        headers=headers,
    )


def sse_error_events(exc: GatewayError) -> tuple[bytes, bytes]:
    """An error inside an already-started stream, as vLLM sends it: a data event, then [DONE]. Two events,
    to be written one per write like every other event, and only ever between events."""
    return b"data: " + orjson.dumps(exc.body()) + b"\n\n", b"data: [DONE]\n\n"


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
            err = GatewayError(str(exc.detail))
            err.status = exc.status_code
            err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
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
