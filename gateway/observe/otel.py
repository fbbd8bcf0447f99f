"""Traces exported with the OpenTelemetry SDK: OTLP over HTTP/protobuf, spans batched by the SDK's own
``BatchSpanProcessor`` (its background thread exports; the request path only records). Imported only when
``--otlp-traces-endpoint`` is set.

The provider is the gateway's own (never installed as OpenTelemetry's global one), so nothing else in the
process exports through it by accident. Spans are parented explicitly rather than through the current context:
the pipeline is a generator that a stream suspends across writes, where an attached context would leak.
The SDK's environment variables apply as the SDK reads them: ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (the resource), ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``/``_TIMEOUT``/``_COMPRESSION``
(the exporter), ``OTEL_BSP_*`` (batching), ``OTEL_PROPAGATORS`` (the headers read and sent, W3C by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import orjson
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from gateway import __version__
from gateway.clip import clip
from gateway.errors import GatewayError
from gateway.observe.tracing import AttrValue, Generated, RequestTrace

SCOPE = "vllm_guard"
# A stream's events that may carry what the request's span reports at its end (the last chunks).
_FINISH_REASON = re.compile(rb'"finish_reason":\s*"([A-Za-z_]+)"')
_USAGE = re.compile(rb'"usage":\s*\{')
# An exception's message and stack trace on a span (``exception`` event): bounded like every attribute, larger.
EXCEPTION_CHARS = 8192


class OtelTracing:
    def __init__(self, url: str) -> None:
        resource = Resource.create()  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, as the SDK reads them
        if str(resource.attributes.get(SERVICE_NAME, "unknown_service")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "vllm-guard"}))
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # closed by close()
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self.tracer = self.provider.get_tracer(SCOPE, __version__)

    def start(self, route: str, carrier: Mapping[str, str], operation: str | None = None) -> RequestTrace:
        parent = propagate.extract(carrier) if carrier else None
        operation = operation or route
        span = self.tracer.start_span(
            operation, context=parent, kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "vllm_guard.route": route},
        )
        return OtelRequestTrace(self.tracer, span, operation)

    async def close(self) -> None:
        # Exports what is buffered (an HTTP post, bounded by the exporter's timeout): off the event loop.
        await asyncio.to_thread(self.provider.shutdown)


class OtelRequestTrace:
    """One request's span (kind server) with a child span per stage, each ended exactly once."""

    __slots__ = ("_admitting", "_done", "_first", "_open", "_operation", "_outcome", "_reasons", "_span", "_tracer")

    def __init__(self, tracer: trace.Tracer, span: Span, operation: str) -> None:
        self._tracer, self._span, self._operation = tracer, span, operation
        self._admitting: int | None = None  # when admission started, until it let the request in
        self._open: list[tuple[Span, int]] = []  # the stages open now, innermost last, with their start (ns)
        self._outcome: str | None = None  # "ok", "error" or "cancelled" once known
        self._done = False
        self._first = True  # a stream's first event is still to come
        self._reasons: set[str] = set()  # a stream's finish reasons seen so far

    def trace_id(self) -> str | None:
        return format(self._span.get_span_context().trace_id, "032x")

    def _context(self) -> Context:
        return trace.set_span_in_context(self._open[-1][0] if self._open else self._span)

    @contextlib.contextmanager
    def stage(self, name: str, attributes: Mapping[str, AttrValue] | None = None) -> Iterator[None]:
        kind = SpanKind.CLIENT if name == "exchange" else SpanKind.INTERNAL
        start = time.time_ns()
        span = self._tracer.start_span(
            f"vllm_guard.{name}", context=self._context(), kind=kind, attributes=attributes, start_time=start
        )
        self._open.append((span, start))
        try:
            yield
        except GeneratorExit:  # the HTTP layer closed the pipeline: the answer is out
            raise
        except BaseException as exc:
            _failed(span, exc)
            raise
        finally:
            self._close((span, start))

    def _close(self, stage: tuple[Span, int]) -> None:
        if stage in self._open:  # not yet ended with the request's span
            self._open.remove(stage)
            stage[0].end()

    def set_attributes(self, attributes: Mapping[str, AttrValue | None]) -> None:
        # Every text clipped (gateway/clip.py): a model name is the client's, up to the body limit in size.
        self._span.set_attributes({k: bounded(v) for k, v in attributes.items() if v is not None})
        model = attributes.get("gen_ai.request.model")
        if isinstance(model, str):  # GenAI's span name: "{gen_ai.operation.name} {gen_ai.request.model}"
            self._span.update_name(f"{self._operation} {clip(model)}")

    def admitting(self) -> None:
        self._admitting = time.time_ns()

    def admitted(self, waited_ms: float) -> None:
        """The admission span (reserve, or queue then reserve), with the queue's wait as a span of its own."""
        now = time.time_ns()
        start, self._admitting = self._admitting or now, None
        self._span.set_attribute("vllm_guard.queue_ms", round(waited_ms, 1))
        span = self._tracer.start_span("vllm_guard.admission", context=self._context(), start_time=start)
        if waited_ms > 0:
            queued = self._tracer.start_span(
                "vllm_guard.queue", context=trace.set_span_in_context(span),
                start_time=max(start, now - int(waited_ms * 1e6)),
            )
            queued.end(end_time=now)
        span.end(end_time=now)

    def _refused_in_admission(self, exc: BaseException) -> None:
        if self._admitting is not None:
            span = self._tracer.start_span("vllm_guard.admission", context=self._context(), start_time=self._admitting)
            self._admitting = None
            _failed(span, exc)
            span.end()

    def headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=self._context())
        return carrier

    def answer(self, payload: bytes) -> None:
        self._outcome = "ok"
        with contextlib.suppress(orjson.JSONDecodeError):
            data = orjson.loads(payload)
            if isinstance(data, dict):
                self._usage(data.get("usage"))
                self._finish_reasons([c.get("finish_reason") for c in _choices(data)])
                self.set_attributes({
                    "gen_ai.response.id": _str(data.get("id")), "gen_ai.response.model": _str(data.get("model")),
                })

    def stream_events(self, events: list[bytes]) -> None:
        for event in events:
            if self._first:
                self._first = False
                self._first_token()
            if _FINISH_REASON.search(event) is not None:
                self._reasons.update(m.decode() for m in _FINISH_REASON.findall(event))
            if _USAGE.search(event) is not None:  # a client that asked for usage gets it in the last chunk
                self._usage_of_event(event)

    def stream_end(self, counted: Generated, outcome: str, error: BaseException | None = None) -> None:
        if error is not None:
            self.fail(error)
            if self._open:
                _failed(self._open[-1][0], error)
        elif outcome == "ok":
            self._outcome = "ok"
        else:
            self._outcome = self._outcome or "cancelled"
        self._span.set_attribute("gen_ai.usage.output_tokens", counted.generated)
        self._finish_reasons(sorted(self._reasons))

    def _first_token(self) -> None:
        """A span from the exchange's start to the stream's first event (vLLM's time to first token, as the
        gateway sees it)."""
        now = time.time_ns()
        parent, start = self._open[-1] if self._open else (self._span, now)
        span = self._tracer.start_span(
            "vllm_guard.first_token", context=trace.set_span_in_context(parent), start_time=start
        )
        span.end(end_time=now)
        self._span.set_attribute("vllm_guard.ttft_ms", round((now - start) / 1e6, 1))

    def _usage_of_event(self, event: bytes) -> None:
        with contextlib.suppress(orjson.JSONDecodeError):
            data = orjson.loads(event.partition(b":")[2])
            if isinstance(data, dict):
                self._usage(data.get("usage"))

    def _usage(self, usage: object) -> None:
        if isinstance(usage, dict):
            self.set_attributes({
                "gen_ai.usage.input_tokens": _int(usage.get("prompt_tokens", usage.get("input_tokens"))),
                "gen_ai.usage.output_tokens": _int(usage.get("completion_tokens", usage.get("output_tokens"))),
            })

    def _finish_reasons(self, reasons: list[Any]) -> None:
        known = [r for r in reasons if isinstance(r, str)]
        if known:
            self._span.set_attribute("gen_ai.response.finish_reasons", bounded(known))

    def fail(self, exc: BaseException) -> None:
        self._outcome = "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
        self._refused_in_admission(exc)
        _failed(self._span, exc)

    def end(self) -> None:
        if self._done:
            return
        self._done = True
        # The pipeline's inner generators may be closed after its outer one: their stages end here.
        for stage in reversed(self._open):
            self._close(stage)
        self._span.set_attribute("vllm_guard.outcome", self._outcome or "cancelled")
        self._span.end()


def _failed(span: Span, exc: BaseException) -> None:
    """An error leaves its mark: a refusal's reason and type; status error for what is not the client's own
    mistake (OpenTelemetry's rule for server spans: a 4xx is not the server's error)."""
    if isinstance(exc, asyncio.CancelledError):
        span.set_attribute("vllm_guard.cancelled", True)
        return
    if isinstance(exc, GatewayError):
        span.set_attributes({
            "error.type": clip(exc.code or type(exc).__name__), "vllm_guard.refusal": clip(exc.reason or ""),
        })
        if not exc.client_fault:  # an engine's message may quote what the client sent
            span.set_status(Status(StatusCode.ERROR, clip(exc.message, EXCEPTION_CHARS)))
        return
    message = clip(str(exc), EXCEPTION_CHARS)
    span.set_attribute("error.type", type(exc).__qualname__)
    # The SDK's record_exception, with its message and stack trace bounded.
    module, name = type(exc).__module__, type(exc).__qualname__
    span.add_event("exception", {
        "exception.type": f"{module}.{name}" if module and module != "builtins" else name, "exception.message": message,
        "exception.stacktrace": clip("".join(traceback.format_exception(exc)), EXCEPTION_CHARS),
    })
    span.set_status(Status(StatusCode.ERROR, message))


def bounded(value: AttrValue) -> AttrValue:
    """An attribute's value with its text clipped (a list: each item, and at most 128 of them)."""
    if isinstance(value, str):
        return clip(value)
    if isinstance(value, (bool, int, float)):
        return value
    return [clip(item) for item in value[:128]]


def _choices(data: dict[str, Any]) -> list[dict[str, Any]]:
    choices = data.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None
