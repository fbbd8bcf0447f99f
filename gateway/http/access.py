"""One guarded request's access-log line in the making (``gateway/observe/access_log.py`` writes it).

The relay begins an ``AccessEntry`` as a request arrives, tells it what it learns (the context, as ``ctx``; a
refusal; a stream's first event) and finishes it exactly once, on whichever way the request ends: answered, refused,
failed upstream, its client gone before the answer or in the middle of a stream. Only guarded routes are logged:
the pass-through and gateway routes (``/metrics``, ``/health`` and the like) are scraped and probed every few
seconds and would bury the requests that matter.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gateway.errors import GatewayError
from gateway.guard.context import RequestContext
from gateway.guard.seams import AccessLogging
from gateway.http.errors import status_and_type
from gateway.observe.access_log import AccessRecord
from gateway.observe.tracing import trace_id_of_traceparent

# The fields a client states its output limit in, on any route (each endpoint's ``bound_fields``, in guard/endpoints/).
ASKED_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def trace_id_of(ctx: RequestContext | None, headers: Mapping[str, str]) -> str | None:
    """The request's trace id: the gateway's own trace's while tracing is on, else the caller's, from its W3C
    ``traceparent`` when that is valid (``tracing.trace_id_of_traceparent``); None when neither says."""
    if ctx is not None and (own := ctx.trace.trace_id()) is not None:
        return own
    return trace_id_of_traceparent(headers.get("traceparent"))


def asked_max_tokens(body: Mapping[str, Any]) -> int | None:
    for name in ASKED_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class AccessEntry:
    __slots__ = (
        "_done",
        "_first_event",
        "_headers",
        "_log",
        "_started",
        "_time",
        "ctx",
        "error",
        "request_id",
        "route",
    )

    def __init__(self, log: AccessLogging, route: str, request_id: str, headers: Mapping[str, str]) -> None:
        self._log = log
        self._started = time.perf_counter()
        self._time = time.time()
        self._headers = headers
        self.route, self.request_id = route, request_id
        # The request as read; its body is the client's, never edited on the way (the engine is sent a copy).
        self.ctx: RequestContext | None = None
        self.error: GatewayError | None = None
        self._first_event: float | None = None
        self._done = not log.on  # off: nothing to write, nothing more to note

    def first_event(self, at: float | None = None) -> None:
        """The stream's first event was written ``at`` (perf_counter; now when not given)."""
        if self._first_event is None:
            self._first_event = at if at is not None else time.perf_counter()

    def finish(self, status: int, outcome: str | None = None, error: GatewayError | None = None) -> None:
        """The request is over: write its line (once). ``outcome`` defaults from the status and the error."""
        if self._done:
            return
        self._done = True
        error = error or self.error
        if outcome is None:
            outcome = default_outcome(status, error)
        ctx = self.ctx
        out = ctx.outcome if ctx is not None else None
        counted = out is not None and out.prompt_tokens > 0
        model = ctx.body.get("model") if ctx is not None else None
        self._log.write(AccessRecord(
            time=self._time, request_id=self.request_id, tenant=ctx.tenant if ctx is not None else None,
            route=self.route, model=model if isinstance(model, str) else None, status=status, outcome=outcome,
            reason=error.reason or error.code if error is not None else None,
            prompt_tokens=out.prompt_tokens if counted and out is not None else None,
            max_tokens_asked=asked_max_tokens(ctx.body) if ctx is not None else None,
            max_tokens=out.max_tokens if counted and out is not None else None,
            truncated_tokens=out.truncated_tokens if counted and out is not None else None,
            queue_ms=out.queue_ms if out is not None and out.engine is not None else None,
            engine=out.engine if out is not None else None,
            ttft_ms=_ms(self._first_event - self._started) if self._first_event is not None else None,
            duration_ms=_ms(time.perf_counter() - self._started),
            completion_tokens=out.completion_tokens if out is not None else None,
            trace_id=trace_id_of(ctx, self._headers),
        ))


def default_outcome(status: int, error: GatewayError | None) -> str:
    """ok (2xx); cancelled (499: the client left); refused (4xx, or a 503 that says when to come back: a
    limit of the gateway's or the engine's, not a failure); error (any other 5xx)."""
    if status < 400:
        return "ok"
    if status == 499:
        return "cancelled"
    if status < 500 or (error is not None and status == 503 and error.retry_after is not None):
        return "refused"
    return "error"


def error_status(exc: GatewayError) -> int:
    return status_and_type(exc)[0]


def _ms(seconds: float) -> float:
    return seconds * 1000.0
