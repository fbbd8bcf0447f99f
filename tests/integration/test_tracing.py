"""Traces over HTTP: the gateway exports its spans to a real OTLP/HTTP receiver, continues the client's trace,
and hands the engine a traceparent under its exchange span; with tracing off it exports nothing and the engine
gets the client's own trace headers.

The simulator is wrapped in a recorder of the trace headers each generating request reached it with."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import Settings
from gateway.observe.access_log import LOGGER_NAME
from testing.gateway_thread import run_gateway
from testing.otlp_receiver import OtlpReceiver, ReceivedSpan, run_otlp_receiver
from testing.vllm_sim import SimConfig, SimServer, run_sim_server
from testing.vllm_sim import app as vllm_sim

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
STAGES = ["vllm_guard.parse", "vllm_guard.count", "vllm_guard.tenant", "vllm_guard.admission",
          "vllm_guard.exchange"]


@dataclass
class TraceRecorder:
    """The simulator's app, keeping the W3C trace headers of each request to a generating route."""

    app: ASGIApp
    seen: dict[str, dict[str, str]] = field(default_factory=dict)  # by x-request-id

    @property
    def state(self) -> Any:
        return self.app.state  # type: ignore[attr-defined]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in ("/v1/chat/completions", "/v1/completions", "/version"):
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            rid = headers.get("x-request-id", "")
            self.seen[rid] = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
        await self.app(scope, receive, send)


@dataclass
class Engine:
    server: SimServer
    recorder: TraceRecorder


@pytest.fixture(scope="module")
def engine(tokenizer: Any, tokenizer_dir: Path) -> Iterator[Engine]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), max_model_len=512, num_blocks=256, block_size=16,
                       tokenizer=tokenizer)
    recorders: list[TraceRecorder] = []
    create = vllm_sim.create_sim_app

    def recorded(config: SimConfig) -> TraceRecorder:
        recorders.append(TraceRecorder(create(config)))
        return recorders[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_sim, "create_sim_app", recorded)
        runner = run_sim_server(config)
    with runner as server:
        yield Engine(server, recorders[0])


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with run_otlp_receiver() as r:
        yield r


def settings_for(engine: Engine, tokenizer_dir: Path, **kw: Any) -> Settings:
    return Settings(tokenizer=str(tokenizer_dir), upstream=engine.server.url, scrape_interval=0.05,
                    queue_timeout=5.0, read_timeout=5.0, **kw)


@pytest.fixture(scope="module")
def traced(engine: Engine, tokenizer_dir: Path, receiver: OtlpReceiver) -> Iterator[str]:
    """A gateway exporting to the receiver (given its base URL: the SDK posts to /v1/traces), batches sent
    every 20 ms (OTEL_BSP_SCHEDULE_DELAY, read by the SDK) so that tests do not wait the default 5 s."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
        mp.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        with run_gateway(settings_for(engine, tokenizer_dir, otlp_traces_endpoint=receiver.url)) as gw:
            yield gw.url


def chat(url: str, rid: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=15,
                      headers={"x-request-id": rid, **(headers or {})})


def request_span(spans: list[ReceivedSpan], trace_id: str) -> ReceivedSpan:
    return next(s for s in spans if s.trace_id == trace_id and s.kind == "server")


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans if s.parent_span_id == parent.span_id}


def whole(trace_id: str, *names: str) -> Any:
    def found(spans: list[ReceivedSpan]) -> bool:
        got = {s.name for s in spans if s.trace_id == trace_id}
        return "chat tiny" in got and set(names) <= got
    return found


def test_a_request_continues_the_clients_trace_with_a_span_per_stage(
    traced: str, receiver: OtlpReceiver, engine: Engine
) -> None:
    answer = chat(traced, "traced-1", {"traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=1"})
    assert answer.status_code == 200
    spans = receiver.wait_for(whole(CLIENT_TRACE, *STAGES))
    root = request_span(spans, CLIENT_TRACE)
    assert (root.name, root.parent_span_id, root.service) == ("chat tiny", CLIENT_SPAN, "vllm-guard")
    assert root.resource["deployment.environment"] == "test"  # OTEL_RESOURCE_ATTRIBUTES, as the SDK reads it
    stages = children(spans, root)
    assert set(STAGES) <= set(stages)
    # Stages in the order the request went through them, inside the request's span.
    starts = [stages[name].start_ns for name in STAGES]
    assert starts == sorted(starts)
    assert root.start_ns <= starts[0] and stages["vllm_guard.exchange"].end_ns <= root.end_ns
    assert stages["vllm_guard.exchange"].kind == "client"
    usage = answer.json()["usage"]
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.model"] == "tiny"
    assert root.attributes["gen_ai.request.max_tokens"] == 5
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root.attributes["gen_ai.usage.input_tokens"] == int(answer.headers["x-guard-prompt-tokens"])
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert root.attributes["gen_ai.response.finish_reasons"] == [answer.json()["choices"][0]["finish_reason"]]
    assert root.attributes["vllm_guard.clamped"] is False
    assert root.attributes["vllm_guard.queue_ms"] >= 0
    assert root.attributes["vllm_guard.outcome"] == "ok"
    assert root.status == "unset"


def test_the_engine_gets_a_traceparent_under_the_exchange_span(
    traced: str, receiver: OtlpReceiver, engine: Engine
) -> None:
    trace_id = "2" * 32
    assert chat(traced, "traced-2", {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}).status_code == 200
    version, sent_trace, parent_id, flags = engine.recorder.seen["traced-2"]["traceparent"].split("-")
    assert (version, sent_trace, flags) == ("00", trace_id, "01")
    spans = receiver.wait_for(whole(trace_id, "vllm_guard.exchange"))
    exchange = next(s for s in spans if s.trace_id == trace_id and s.name == "vllm_guard.exchange")
    assert parent_id == exchange.span_id
    assert exchange.parent_span_id == request_span(spans, trace_id).span_id


def test_a_request_without_a_traceparent_starts_a_trace(traced: str, receiver: OtlpReceiver, engine: Engine) -> None:
    assert chat(traced, "traced-3").status_code == 200
    trace_id = engine.recorder.seen["traced-3"]["traceparent"].split("-")[1]
    assert trace_id != CLIENT_TRACE
    spans = receiver.wait_for(whole(trace_id, *STAGES))
    assert request_span(spans, trace_id).parent_span_id == ""


def test_the_access_log_names_the_gateways_own_trace(
    traced: str, receiver: OtlpReceiver, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    assert chat(traced, "traced-logged").status_code == 200
    trace_id = engine.recorder.seen["traced-logged"]["traceparent"].split("-")[1]
    receiver.wait_for(whole(trace_id, *STAGES))  # the request is over once its span is exported
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME and "traced-logged" in r.getMessage()]
    assert len(lines) == 1 and f"trace_id={trace_id}" in lines[0].split()


def test_a_stream_has_its_first_token_under_the_exchange(traced: str, receiver: OtlpReceiver, engine: Engine) -> None:
    with httpx.stream(
        "POST", f"{traced}/v1/chat/completions", timeout=15, headers={"x-request-id": "traced-4"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
    ) as answer:
        events = [line for line in answer.iter_lines() if line.startswith("data: {")]
    trace_id = engine.recorder.seen["traced-4"]["traceparent"].split("-")[1]
    spans = receiver.wait_for(whole(trace_id, "vllm_guard.first_token"))
    root = request_span(spans, trace_id)
    exchange = children(spans, root)["vllm_guard.exchange"]
    first = children(spans, exchange)["vllm_guard.first_token"]
    assert exchange.start_ns == first.start_ns < first.end_ns <= exchange.end_ns
    assert root.attributes["vllm_guard.stream"] is True
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["vllm_guard.ttft_ms"] >= 0
    last = orjson.loads(events[-1].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"


def test_a_refusal_says_why_on_the_request_span(traced: str, receiver: OtlpReceiver) -> None:
    answer = chat(traced, "traced-5", {"traceparent": f"00-{'5' * 32}-{CLIENT_SPAN}-01"},
                  messages=[{"role": "user", "content": "word " * 600}])
    assert answer.status_code == 400
    spans = receiver.wait_for(lambda got: any(s.trace_id == "5" * 32 and s.kind == "server" for s in got))
    root = request_span(spans, "5" * 32)
    assert root.attributes["vllm_guard.refusal"] == "context_length"
    assert root.attributes["error.type"] == "context_length_exceeded"
    assert root.attributes["vllm_guard.outcome"] == "error"
    assert root.status == "unset"  # a client's mistake is no server error (OpenTelemetry's rule for 4xx)
    assert children(spans, root)["vllm_guard.count"].attributes["vllm_guard.refusal"] == "context_length"
    assert "vllm_guard.exchange" not in children(spans, root)


def test_an_engine_failure_marks_the_request_span_an_error(
    engine: Engine, tokenizer_dir: Path, receiver: OtlpReceiver
) -> None:
    # A gateway whose engine is gone: 503 at once, the span's status an error with its message.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
        settings = Settings(tokenizer=str(tokenizer_dir), upstream="http://127.0.0.1:9", scrape_interval=0.05,
                            otlp_traces_endpoint=receiver.url)
        with run_gateway(settings) as gw:
            answer = chat(gw.url, "traced-6", {"traceparent": f"00-{'6' * 32}-{CLIENT_SPAN}-01"})
    assert answer.status_code == 503
    spans = receiver.wait_for(lambda got: any(s.trace_id == "6" * 32 and s.kind == "server" for s in got))
    root = request_span(spans, "6" * 32)
    assert root.status == "error" and root.status_message == answer.json()["error"]["message"]
    assert root.attributes["vllm_guard.refusal"] == "upstream_unavailable"


def test_tracing_is_off_by_default_and_the_engine_gets_the_clients_trace_headers(
    engine: Engine, tokenizer_dir: Path
) -> None:
    # The SDK's own endpoint variable alone does not turn tracing on: the flag does, as in vLLM.
    with run_otlp_receiver() as quiet, pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{quiet.url}/v1/traces")
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
        with run_gateway(settings_for(engine, tokenizer_dir)) as gw:
            assert gw.parts.settings.otlp_traces_endpoint is None
            assert chat(gw.url, "untraced-1", {"traceparent": CLIENT_TRACEPARENT, "tracestate": "v=1"}).is_success
            assert chat(gw.url, "untraced-2").is_success
        # The gateway has shut down: anything it would have buffered is sent by now.
        assert quiet.spans == [] and quiet.paths == []
    assert engine.recorder.seen["untraced-1"] == {"traceparent": CLIENT_TRACEPARENT, "tracestate": "v=1"}
    assert engine.recorder.seen["untraced-2"] == {}


def test_a_pass_through_route_forwards_the_clients_trace_headers(traced: str, engine: Engine) -> None:
    answer = httpx.get(f"{traced}/version", timeout=15,
                       headers={"x-request-id": "traced-7", "traceparent": CLIENT_TRACEPARENT})
    assert answer.status_code == 200
    assert engine.recorder.seen["traced-7"] == {"traceparent": CLIENT_TRACEPARENT}
