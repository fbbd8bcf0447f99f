"""Traces of the request path, for operators who follow a request from their client through the gateway into
vLLM (``--otlp-traces-endpoint``).

The pipeline calls small hooks on the request's ``RequestTrace``: a named stage (``stage``: parse, count,
tenant, exchange), the attributes it learned (``set_attributes``), admission and its wait in the queue (``admitting``,
``admitted``), the headers that carry the trace to the engine (``headers``), the engine's answer (``answer``,
``stream``), a failure (``fail``), the end (``end``). This module declares them (``RequestTrace``, ``Tracing``) and
holds the no-op versions, used when tracing is off: each hook costs one method call, and the OpenTelemetry SDK is
never imported. With an endpoint,
``start_tracing`` (``gateway/observe/trace_export.py``) builds the SDK-backed ``Tracing`` of
``gateway/observe/otel.py``.

Span and attribute names follow OpenTelemetry's GenAI semantic conventions (``gen_ai.*``); the gateway's own
are under ``vllm_guard.*`` (docs/tracing.md lists them).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

AttrValue = str | bool | int | float | Sequence[str]

# W3C Trace Context: what a client sends to be continued, and what the engine gets from the gateway.
TRACE_HEADERS = ("traceparent", "tracestate")


class Generated(Protocol):
    """What counts a stream's generated tokens as they come (a reservation)."""

    @property
    def generated(self) -> int: ...


class RequestTrace(Protocol):
    """One request's spans: what the request path tells them. ``NoTrace`` (tracing off) and ``otel.OtelRequestTrace``
    keep it."""

    def stage(self, name: str, attributes: Mapping[str, AttrValue] | None = None) -> AbstractContextManager[None]:
        """A child span of the request's span around one stage; an exception leaving it marks it failed."""

    def set_attributes(self, attributes: Mapping[str, AttrValue | None]) -> None:
        """Attributes of the request's span (None values are left out)."""

    def admitting(self) -> None:
        """Admission starts: the request is reserved its blocks, or queued, or shed."""

    def admitted(self, waited_ms: float) -> None:
        """Admission let the request in after waiting this long in the queue (0: at once)."""

    def headers(self) -> dict[str, str]:
        """The trace context to send the engine: its parent is the innermost stage open now."""

    def answer(self, payload: bytes) -> None:
        """A whole answer from the engine: its usage and finish reasons."""

    def stream_events(self, events: list[bytes]) -> None:
        """Events of the stream as they pass to the client (its first token, finish reasons, usage)."""

    def stream_end(self, counted: Generated, outcome: str, error: BaseException | None = None) -> None:
        """The stream is over (``outcome``: ok, error, cancelled; ``error``: what broke it): the tokens ``counted``
        generated (the reservation's count, the engine's own)."""

    def fail(self, exc: BaseException) -> None:
        """The request failed or was refused: the request's span says why."""

    def end(self) -> None:
        """The request is over (answered, refused, failed, or its client gone)."""

    def trace_id(self) -> str | None:
        """The request's trace id (32 hex digits) for the access log; None while tracing is off."""


class NoTrace:
    """A request's trace while tracing is off: every hook does nothing, for the cost of one method call."""

    __slots__ = ()

    def stage(self, name: str, attributes: Mapping[str, AttrValue] | None = None) -> AbstractContextManager[None]:
        return _NO_STAGE  # one shared no-op context, not a generator per stage

    def set_attributes(self, attributes: Mapping[str, AttrValue | None]) -> None:
        pass

    def admitting(self) -> None:
        pass

    def admitted(self, waited_ms: float) -> None:
        pass

    def headers(self) -> dict[str, str]:
        return {}

    def answer(self, payload: bytes) -> None:
        pass

    def stream_events(self, events: list[bytes]) -> None:
        pass

    def stream_end(self, counted: Generated, outcome: str, error: BaseException | None = None) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        pass

    def end(self) -> None:
        pass

    def trace_id(self) -> str | None:
        return None


_NO_STAGE: AbstractContextManager[None] = contextlib.nullcontext()
OFF: RequestTrace = NoTrace()


class Tracing(Protocol):
    """Where requests' traces go: ``NoTracing`` (no ``--otlp-traces-endpoint``) or ``otel.OtelTracing``."""

    def start(self, route: str, carrier: Mapping[str, str], operation: str | None = None) -> RequestTrace:
        """A request's trace, continuing the client's (``carrier``: its W3C trace headers), else a new one.
        ``operation``: its ``gen_ai.operation.name`` (the route's name when it has none of the well-known ones)."""

    async def close(self) -> None:
        """Export what is still buffered, then stop exporting (on shutdown)."""


class NoTracing:
    """Tracing off: every request's trace is ``OFF``."""

    def start(self, route: str, carrier: Mapping[str, str], operation: str | None = None) -> RequestTrace:
        return OFF

    async def close(self) -> None:
        pass


# W3C Trace Context (www.w3.org/TR/trace-context/#traceparent-header): version "-" trace-id "-" parent-id "-"
# trace-flags, each lowercase hex of 2, 32, 16 and 2 digits. Version 00 is exactly that (55 characters); a later
# version may add fields after a "-", which a reader of version 00 skips; version ff is invalid, and so is a
# trace-id or parent-id of zeros only.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?", re.DOTALL)
_ZERO_TRACE, _ZERO_PARENT = "0" * 32, "0" * 16
# tracestate: what the spec asks to propagate at least (characters, commas included); past it, whole entries are
# dropped, those over 128 characters first, then from the end (www.w3.org/TR/trace-context/#tracestate-limits).
TRACESTATE_CHARS = 512
_TRACESTATE_ENTRY_CHARS = 128


def trace_id_of_traceparent(value: str | None) -> str | None:
    """The trace id of a valid W3C ``traceparent``; None for any other value (absent, malformed, trailing
    characters on version 00, version ff, zero ids)."""
    match = _TRACEPARENT.fullmatch(value) if value is not None and len(value) >= 55 else None
    if match is None:
        return None
    version, trace_id, parent_id, extra = match.groups()
    if version == "ff" or (version == "00" and extra is not None):
        return None
    return None if trace_id == _ZERO_TRACE or parent_id == _ZERO_PARENT else trace_id


def tracestate_within(value: str) -> str:
    """``tracestate`` within ``TRACESTATE_CHARS``, whole entries dropped as the spec says when it is longer."""
    if len(value) <= TRACESTATE_CHARS:
        return value
    kept: list[str] = []
    size = -1  # the commas between entries: one fewer than the entries
    for entry in (e.strip() for e in value.split(",")):
        if not entry or len(entry) > _TRACESTATE_ENTRY_CHARS:
            continue
        if size + 1 + len(entry) > TRACESTATE_CHARS:
            break  # this one and every later one: dropped from the end
        kept.append(entry)
        size += 1 + len(entry)
    return ",".join(kept)


def carrier_of(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace headers of a request, the only ones a trace is continued from: a valid ``traceparent``
    only (else none: the gateway's trace starts anew, and the engine gets no malformed header from it), and
    its ``tracestate`` (meaningless without it, the spec says) within ``TRACESTATE_CHARS``."""
    parent = headers.get("traceparent")
    if trace_id_of_traceparent(parent) is None or parent is None:
        return {}
    state = headers.get("tracestate")
    return {"traceparent": parent} if not state else {"traceparent": parent, "tracestate": tracestate_within(state)}
