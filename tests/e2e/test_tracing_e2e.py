"""One trace through the gateway into a real vLLM (CPU build): a vLLM started with ``--otlp-traces-endpoint``
and a gateway with the same flag export to one OTLP/HTTP receiver, and a request that carries a client's
``traceparent`` comes back as one trace: the client's span, the gateway's request span with its stages, and
vLLM's own ``llm_request`` span under the gateway's exchange span.

vLLM exports over gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says ``http/protobuf``
(``vllm/tracing/otel.py``); both sides batch every 100 ms here (``OTEL_BSP_SCHEDULE_DELAY``) rather than 5 s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testing.otlp_receiver import OtlpReceiver, ReceivedSpan, run_otlp_receiver
from testing.servers import (
    API_KEY,
    GATEWAY_READY_PATHS,
    SERVED_MODEL_NAME,
    VLLM_READY_PATHS,
    ServerProcess,
    ServerStartError,
    gateway_server,
    vllm_server,
)

from .conftest import GATEWAY_START_TIMEOUT, VLLM_START_TIMEOUT, _import_failed, _log_dir, _start

pytestmark = pytest.mark.e2e

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
BATCH_EVERY_MS = "100"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with run_otlp_receiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced_vllm(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
    receiver: OtlpReceiver,
) -> Iterator[ServerProcess]:
    server = vllm_server(
        tiny_model, _log_dir(tmp_path_factory) / "traced_vllm.log",
        extra_args=["--otlp-traces-endpoint", f"{receiver.url}/v1/traces"],
    )
    server.name = "traced vLLM"
    server.env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": BATCH_EVERY_MS,
                  "OTEL_SERVICE_NAME": "vllm"}
    request.addfinalizer(server.stop)
    try:
        _start(request.config, server, VLLM_READY_PATHS, VLLM_START_TIMEOUT)
    except ServerStartError as exc:
        if _import_failed(server):
            pytest.skip(f"vLLM cannot run here, its import fails:\n{server.log_tail(15)}")
        if "OpenTelemetry" in server.log_tail(40):
            pytest.skip(f"vLLM's tracing cannot run here:\n{server.log_tail(15)}")
        raise exc
    yield server


@pytest.fixture(scope="module")
def traced_gateway(
    request: pytest.FixtureRequest, traced_vllm: ServerProcess, tmp_path_factory: pytest.TempPathFactory,
    receiver: OtlpReceiver,
) -> Iterator[ServerProcess]:
    server = gateway_server(
        traced_vllm.url, _log_dir(tmp_path_factory) / "traced_gateway.log",
        ["--api-key", API_KEY, "--otlp-traces-endpoint", receiver.url], name="traced_gateway",
    )
    server.env = {"OTEL_BSP_SCHEDULE_DELAY": BATCH_EVERY_MS}
    request.addfinalizer(server.stop)
    _start(request.config, server, GATEWAY_READY_PATHS, GATEWAY_START_TIMEOUT)
    yield server


def in_trace(*names: str) -> object:
    def found(spans: list[ReceivedSpan]) -> bool:
        return set(names) <= {s.name for s in spans if s.trace_id == TRACE_ID}
    return found


def test_one_request_is_one_trace_through_the_gateway_into_vllm(
    traced_gateway: ServerProcess, receiver: OtlpReceiver
) -> None:
    answer = httpx.post(
        f"{traced_gateway.url}/v1/chat/completions", timeout=120,
        headers={"authorization": f"Bearer {API_KEY}", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
        json={"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story"}],
              "max_tokens": 8},
    )
    assert answer.status_code == 200, answer.text
    spans = receiver.wait_for(in_trace(f"chat {SERVED_MODEL_NAME}", "vllm_guard.exchange", "llm_request"), 60)
    trace = {s.name: s for s in spans if s.trace_id == TRACE_ID}
    gateway, exchange, engine = trace[f"chat {SERVED_MODEL_NAME}"], trace["vllm_guard.exchange"], trace["llm_request"]
    assert gateway.parent_span_id == CLIENT_SPAN and gateway.service == "vllm-guard"
    assert exchange.parent_span_id == gateway.span_id
    assert engine.parent_span_id == exchange.span_id and engine.service == "vllm"
    # The same request, counted alike on both sides.
    usage = answer.json()["usage"]
    assert gateway.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert engine.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert engine.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert engine.attributes["gen_ai.request.max_tokens"] == gateway.attributes["vllm_guard.max_tokens"]
    assert exchange.start_ns <= engine.start_ns <= engine.end_ns <= exchange.end_ns
