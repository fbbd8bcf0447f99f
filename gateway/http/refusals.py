"""What the server's protocol answers by itself, before or instead of the app: its refusals, in OpenAI's shape,
as the bytes of a whole HTTP response that ends the connection."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from gateway.errors import GatewayError, HeadersTooLarge, InvalidRequest, PayloadTooLarge
from gateway.http.errors import error_body, error_headers, status_and_type
from gateway.http.limits import ConnectionLimits

log = logging.getLogger(__name__)

# Headers every refusal has; an error's own headers (Retry-After) follow them.
_WRITTEN = frozenset({"content-type", "content-length", "connection"})


def render(error: GatewayError, default_headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The whole response for ``error``, with ``connection: close``: the connection ends after it."""
    body = orjson.dumps(error_body(error))
    lines = [STATUS_LINE[status_and_type(error)[0]]]
    lines.extend(name + b": " + value + b"\r\n" for name, value in default_headers)
    lines.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body))
    lines.extend(
        f"{name}: {value}\r\n".encode("latin-1")
        for name, value in error_headers(error).items()
        if name.lower() not in _WRITTEN
    )
    lines.append(b"\r\n")
    lines.append(body)
    return b"".join(lines)


def head_too_large(size: int, limits: ConnectionLimits) -> HeadersTooLarge:
    return HeadersTooLarge(
        f"The request line and headers are at least {size} bytes; the limit is {limits.max_header_bytes} bytes."
    )


def parse_error(exc: httptools.HttpParserError, limits: ConnectionLimits) -> GatewayError:
    reason = str(exc)
    if reason == "Content-Length overflow":
        return PayloadTooLarge(
            f"The request body's Content-Length is beyond any limit; the limit is {limits.body.max_bytes} bytes."
        )
    if isinstance(exc, httptools.HttpParserCallbackError) or not reason:
        # uvicorn's own reading of the head failed (a URL it cannot parse, say): the parser's words for that
        # ("User callback error") would tell the client nothing.
        log.debug("request head refused by uvicorn", exc_info=exc.__context__)
        reason = "the request line or headers cannot be read"
    return InvalidRequest(f"Malformed HTTP request: {reason}.", code="malformed_request")
