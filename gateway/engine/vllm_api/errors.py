"""vLLM's error answers (and those of anything in front of it) read into the gateway's domain errors.

vLLM since 0.10.1 answers ``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``, before that
the flat ``{"object": "error", "message", "type", "param", "code"}``; FastAPI answers ``{"detail": ...}`` and a
proxy in between an HTML page. Each becomes an ``UpstreamError`` with an OpenAI error type.

vLLM 0.29+ caps its own waiting queue (``--max-num-queued-reqs``, ``--max-num-queued-tokens``): over the cap it
answers 503 ``{"error": {"message": <one of QUEUE_FULL_MESSAGES>, "type": "Service Unavailable", "code": 503}}``
without a ``Retry-After`` (``vllm/exceptions.py``: ``QueueOverflowError``, ``MaxQueuedTokensError``; raised before
a stream starts, ``vllm/entrypoints/generate/base/serving.py``). That becomes ``EngineQueueFull``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.errors import BadUpstreamResponse, EngineQueueFull, UpstreamError

# The error types OpenAI's API and SDKs know; anything else the upstream says (vLLM's "BadRequestError",
# Starlette's "Method Not Allowed") is replaced by the one its status implies.
OPENAI_ERROR_TYPES = frozenset(
    {"invalid_request_error", "authentication_error", "permission_error", "rate_limit_error", "server_error"}
)
_TYPE_BY_STATUS = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_HTML_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
# The starts of vLLM 0.32's two queue-cap messages: max_num_queued_reqs, max_num_queued_tokens.
QUEUE_FULL_MESSAGES = (
    "The engine is currently busy and cannot accept new requests",
    "The engine has reached its prefill token backlog limit",
)
# vLLM sends no Retry-After with its queue cap: a second is about what a request of the tiny queue it caps takes
# to leave it, and the gateway holds the engine as full for that long (``engine.queue_cap``).
QUEUE_FULL_RETRY_AFTER = 1.0
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
    if status == 503 and message.startswith(QUEUE_FULL_MESSAGES):
        seconds = float(retry_after) if retry_after.isdigit() else QUEUE_FULL_RETRY_AFTER
        return EngineQueueFull(message, retry_after=seconds)
    kept = {"retry-after": retry_after} if _RETRY_AFTER.match(retry_after) else None
    return UpstreamError(status, message, type=etype, param=param, code=code, headers=kept)


def _plain_message(status: int, payload: bytes) -> str:
    """A message from a body that is not JSON: an HTML page's title (not its markup), else the text."""
    title = _HTML_TITLE.search(payload[:4096])
    if title is not None:
        text = " ".join(title.group(1).decode("utf-8", "replace").split())[:200]
        return f"The upstream answered HTTP {status} with an HTML page: {text}"
    return payload[:500].decode("utf-8", "replace").strip() or f"upstream answered HTTP {status}"
