"""Tracing's no-op, and the SDK-backed trace's spans (in memory) for what the request path tells it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.config import Settings
from gateway.errors import ContextLengthExceeded, UpstreamUnavailable
from gateway.observe import otel
from gateway.observe.otel import OtelRequestTrace, OtelTracing
from gateway.observe.trace_export import start_tracing
from gateway.observe.tracing import OFF, TRACESTATE_CHARS, NoTracing, carrier_of, trace_id_of_traceparent


@dataclass
class Counted:
    generated: int = 7  # the engine's own count, whatever the events look like


async def test_without_an_endpoint_every_hook_is_a_no_op() -> None:
    tracing = start_tracing(Settings())
    assert type(tracing) is NoTracing
    trace = tracing.start("chat", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert trace is OFF
    with trace.stage("parse"):
        trace.set_attributes({"gen_ai.request.model": "m"})
    assert trace.headers() == {}

    trace.stream_events([b"data: {}\n\n"])  # one method call per batch of events, nothing more
    trace.stream_end(Counted(), "ok")
    await tracing.close()


TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{PARENT_ID}-01"


def test_only_the_w3c_trace_headers_are_carried() -> None:
    headers = {"traceparent": VALID, "tracestate": "ts", "baggage": "b", "authorization": "Bearer k"}
    assert carrier_of(headers) == {"traceparent": VALID, "tracestate": "ts"}
    assert carrier_of({}) == {}


# (what the client sent, the trace id it gives): W3C Trace Context's traceparent, version 00 exactly, later versions
# read as 00 with their extra fields skipped.
TRACEPARENTS = [
    ("valid", VALID, TRACE_ID),
    ("sampled flag off", f"00-{TRACE_ID}-{PARENT_ID}-00", TRACE_ID),
    ("a later version with a field more", f"01-{TRACE_ID}-{PARENT_ID}-01-cafe", TRACE_ID),
    ("a later version as long as 00", f"cc-{TRACE_ID}-{PARENT_ID}-01", TRACE_ID),
    ("trailing garbage", f"{VALID}garbage", None),
    ("a field more on version 00", f"{VALID}-cafe", None),
    ("a trailing dash on version 00", f"{VALID}-", None),
    ("a later version followed by garbage", f"01-{TRACE_ID}-{PARENT_ID}-01garbage", None),
    ("version ff", f"ff-{TRACE_ID}-{PARENT_ID}-01", None),
    ("upper-case hex", f"00-{TRACE_ID.upper()}-{PARENT_ID}-01", None),
    ("all-zero trace id", f"00-{'0' * 32}-{PARENT_ID}-01", None),
    ("all-zero parent id", f"00-{TRACE_ID}-{'0' * 16}-01", None),
    ("a short trace id", f"00-{TRACE_ID[1:]}-{PARENT_ID}-01", None),
    ("a short parent id", f"00-{TRACE_ID}-{PARENT_ID[1:]}-01", None),
    ("one-digit flags", f"00-{TRACE_ID}-{PARENT_ID}-1", None),
    ("non-hex flags", f"00-{TRACE_ID}-{PARENT_ID}-0g", None),
    ("a newline after it", f"{VALID}\n", None),
    ("leading garbage", f"x{VALID}", None),
    ("empty", "", None),
]


@pytest.mark.parametrize(("value", "trace_id"), [c[1:] for c in TRACEPARENTS], ids=[c[0] for c in TRACEPARENTS])
def test_only_a_valid_traceparent_gives_a_trace_id_and_is_carried(value: str, trace_id: str | None) -> None:
    assert trace_id_of_traceparent(value) == trace_id
    carried = carrier_of({"traceparent": value, "tracestate": "vendor=1"})
    # An invalid traceparent is dropped with its tracestate (meaningless without it): nothing malformed goes on.
    assert carried == ({"traceparent": value, "tracestate": "vendor=1"} if trace_id else {})


def test_a_long_tracestate_is_cut_by_whole_entries_the_longest_first() -> None:
    entries = [f"v{i}={'x' * 40}" for i in range(20)]  # 20 entries of 44 characters: 899 in all
    long_entry = "big=" + "y" * 200
    carried = carrier_of({"traceparent": VALID, "tracestate": ",".join([entries[0], long_entry, *entries[1:]])})
    kept = carried["tracestate"].split(",")
    assert len(carried["tracestate"]) <= TRACESTATE_CHARS and long_entry not in kept
    assert kept == entries[: len(kept)] and len(kept) == 11  # the first ones, whole


# -- the SDK-backed trace, exported in memory -------------------------------------------------------
def in_memory() -> tuple[OtelTracing, InMemorySpanExporter]:
    tracing = OtelTracing("http://127.0.0.1:9/v1/traces")
    exporter = InMemorySpanExporter()
    tracing.provider.shutdown()  # its batch exporter's thread: nothing to export
    tracing.provider = TracerProvider()
    tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.tracer = tracing.provider.get_tracer("test")
    return tracing, exporter


class Clock:
    """``time.time_ns`` for the trace's own timings (the SDK keeps its own for spans it times itself)."""

    def __init__(self) -> None:
        self.ns = 1_000_000_000_000

    def time_ns(self) -> int:
        return self.ns


def test_a_request_span_has_a_child_per_stage_and_queue_wait_inside_admission(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(otel, "time", clock)
    tracing, exporter = in_memory()
    trace = tracing.start("completions", {}, "text_completion")
    assert isinstance(trace, OtelRequestTrace)
    with trace.stage("parse"):
        pass
    trace.set_attributes({"gen_ai.request.model": "tiny", "gen_ai.request.max_tokens": None})
    trace.admitting()
    clock.ns += 20_000_000  # 20 ms in admission, 12.5 of them queued
    trace.admitted(12.5)
    with trace.stage("exchange", {"vllm_guard.engine": "1"}):
        sent = trace.headers()
        trace.answer(b'{"id": "cmpl-1", "choices": [{"finish_reason": "stop"}], '
                     b'"usage": {"prompt_tokens": 3, "completion_tokens": 2}}')
    trace.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["text_completion tiny"]
    assert root.kind is SpanKind.SERVER and root.parent is None
    assert "gen_ai.request.max_tokens" not in root.attributes  # unknown values are left out
    assert {n: s.parent.span_id for n, s in spans.items() if s.parent is not None} == {
        "vllm_guard.parse": root.context.span_id,
        "vllm_guard.admission": root.context.span_id,
        "vllm_guard.queue": spans["vllm_guard.admission"].context.span_id,
        "vllm_guard.exchange": root.context.span_id,
    }
    queue, admission = spans["vllm_guard.queue"], spans["vllm_guard.admission"]
    assert (queue.end_time - queue.start_time, admission.end_time - admission.start_time) == (12_500_000, 20_000_000)
    assert queue.end_time == admission.end_time
    assert spans["vllm_guard.exchange"].kind is SpanKind.CLIENT
    assert sent["traceparent"].split("-")[2] == f"{spans['vllm_guard.exchange'].context.span_id:016x}"
    assert root.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert (root.attributes["gen_ai.usage.input_tokens"], root.attributes["gen_ai.usage.output_tokens"]) == (3, 2)
    assert root.attributes["gen_ai.response.id"] == "cmpl-1"
    assert root.attributes["vllm_guard.queue_ms"] == 12.5
    assert root.attributes["vllm_guard.outcome"] == "ok"


@pytest.mark.parametrize(
    ("error", "status", "outcome"),
    [
        (ContextLengthExceeded("too long"), StatusCode.UNSET, "error"),  # a client's mistake: no server error
        (UpstreamUnavailable("engine down", retry_after=5), StatusCode.ERROR, "error"),
        (RuntimeError("bug"), StatusCode.ERROR, "error"),
        (asyncio.CancelledError(), StatusCode.UNSET, "cancelled"),
    ],
)
def test_a_failure_marks_the_request_span(error: BaseException, status: StatusCode, outcome: str) -> None:
    tracing, exporter = in_memory()
    trace = tracing.start("chat", {})
    trace.admitting()
    trace.fail(error)
    trace.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["chat"]
    assert (root.status.status_code, root.attributes["vllm_guard.outcome"]) == (status, outcome)
    # Refused while admitting: the admission span is there, with the same mark.
    assert spans["vllm_guard.admission"].status.status_code == status


def test_a_stage_left_open_ends_with_the_request() -> None:
    tracing, exporter = in_memory()
    trace = tracing.start("chat", {})
    stage = trace.stage("exchange")
    stage.__enter__()
    trace.end()
    stage.__exit__(None, None, None)  # the inner generator closed after the outer one: ended once, no warning
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["chat", "vllm_guard.exchange"]


async def test_a_stream_reports_its_first_token_and_finish_reasons() -> None:
    tracing, exporter = in_memory()
    trace = tracing.start("chat", {})

    events = [
        b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n',
        b'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    with trace.stage("exchange"):
        trace.stream_events(events[:1])
        trace.stream_events(events[1:])
        trace.stream_end(Counted(), "ok")
    trace.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["vllm_guard.first_token"].parent.span_id == spans["vllm_guard.exchange"].context.span_id
    root = spans["chat"]
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert root.attributes["gen_ai.usage.output_tokens"] == 7
    assert root.attributes["vllm_guard.outcome"] == "ok"


def service_name() -> object:
    tracing = OtelTracing("http://127.0.0.1:9/v1/traces")
    tracing.provider.shutdown()
    return tracing.provider.resource.attributes["service.name"]


def test_the_service_is_named_unless_the_environment_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert service_name() == "vllm-guard"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gateway")
    assert service_name() == "edge-gateway"
