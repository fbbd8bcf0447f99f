"""The live page: ``GET /guard/ui`` (one static, self-contained HTML file) and ``GET /guard/ui/data`` (JSON).

The page holds no data: it is served to anyone, and everything it shows comes from the data route, which
takes the admin key when one is configured (``--admin-api-key``) and otherwise follows the client routes' rule
(open until ``--api-key`` is set). A browser cannot send a bearer header when it loads a page, so the page asks
for the key itself (or reads it from the URL's ``#key=`` fragment, which never leaves the browser), keeps it in
the tab's session storage and sends it as ``Authorization: Bearer`` from its requests.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.config import Settings
from gateway.errors import InvalidRequest
from gateway.http.auth import authenticate
from gateway.observe.history import History, Sampler

# Nothing the page loads may come from elsewhere: no CDN, no fonts, no images but its own canvases.
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
DATA_HEADERS = {"cache-control": "no-store", "x-content-type-options": "nosniff"}


def load_page() -> bytes:
    """The page's HTML, shipped inside the package (package data)."""
    return (resources.files("gateway.http") / "static" / "ui.html").read_bytes()


def authorize(settings: Settings, request: Request) -> None:
    """The admin key when one is configured; else the client routes' rule. 401 otherwise."""
    authenticate(settings, request, admin=any(settings.admin_api_key))


def page(html: bytes) -> Response:
    return Response(html, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


def data(settings: Settings, request: Request, sampler: Sampler | None, upstream: dict[str, Any]) -> Response:
    """The samples after ``?since=<id>`` (all of them without it), the events in them, and the limits."""
    authorize(settings, request)
    after = since(request.query_params.get("since"))
    history = sampler.history if sampler is not None else History(size=1)
    body = {
        "started": sampler.started if sampler is not None else None,
        "last_id": history.last_id,
        "interval_s": sampler.interval if sampler is not None else None,
        "size": history.size,
        "sampler_ms": round(sampler.cost_s * 1000.0, 3) if sampler is not None else None,
        "limits": limits(settings, upstream, history),
        "samples": history.since(after),
        "events": history.events_since(after),
    }
    return Response(orjson.dumps(body), media_type="application/json", headers=DATA_HEADERS)


def since(raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise InvalidRequest(f"since must be a sample id (a whole number >= 0); got {raw[:40]!r}.", param="since")
    return int(raw)


def limits(settings: Settings, upstream: dict[str, Any], history: History) -> dict[str, Any]:
    """The limits in force now: the context, the KV budget, and the queue's and policies' settings."""
    latest = history.latest
    kv = latest["kv"] if latest is not None else {}
    return {
        "model": upstream.get("model"),
        "upstream_url": upstream.get("url"),
        "max_model_len": upstream.get("effective_max_model_len"),
        "upstream_max_model_len": upstream.get("max_model_len"),
        "max_prompt_tokens": settings.max_prompt_tokens,
        "max_output_tokens": settings.max_output_tokens,
        "on_prompt_overflow": settings.on_prompt_overflow,
        "on_max_tokens_overflow": settings.on_max_tokens_overflow,
        "block_size": kv.get("block_size"),
        "capacity_blocks": kv.get("capacity"),
        "budget_blocks": kv.get("budget"),
        "kv_target": settings.kv_target,
        "admission_policy": settings.admission_policy,
        "max_queue": settings.max_queue,
        "queue_timeout_s": settings.queue_timeout,
        "max_concurrency": settings.max_concurrency,
        "managed": settings.managed,
    }
