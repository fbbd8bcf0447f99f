"""One request's trace through the gateway into vLLM, drawn: the picture of docs/tracing.md and the README.

Starts an OTLP/HTTP receiver (tests/support/otlp_receiver.py), a real vLLM (CPU build, the tests' tiny model)
and a gateway, both with ``--otlp-traces-endpoint`` pointing at the receiver; after one request that warms them
up, sends one streamed chat request carrying a client's ``traceparent``; then prints every span of its trace and
draws them as a Gantt chart (matplotlib, the ``bench`` extra).

    .venv/bin/python bench/trace.py                       # writes docs/img/trace.png
    .venv/bin/python bench/trace.py --out /tmp/trace.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.e2e.servers import (  # noqa: E402
    GATEWAY_READY_PATHS,
    SERVED_MODEL_NAME,
    VLLM_READY_PATHS,
    ensure_tiny_model,
    gateway_server,
    vllm_server,
)
from tests.support.otlp_receiver import ReceivedSpan, run_otlp_receiver  # noqa: E402

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
WARM_UP_TRACE = "1" * 32
ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


def send_traced(url: str, trace_id: str = WARM_UP_TRACE) -> None:
    body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story " * 20}],
            "max_tokens": 64, "stream": True, "ignore_eos": True}
    headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as answer:
        answer.raise_for_status()
        for _ in answer.iter_lines():
            pass


def run(out: Path) -> list[ReceivedSpan]:
    with tempfile.TemporaryDirectory() as tmp, run_otlp_receiver() as receiver:
        model = ensure_tiny_model(2048)
        vllm = vllm_server(model, Path(tmp) / "vllm.log", extra_args=["--otlp-traces-endpoint",
                                                                      f"{receiver.url}/v1/traces"])
        vllm.env = {**ENV, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"}
        gateway = gateway_server(vllm.url, Path(tmp) / "gateway.log",
                                 ["--otlp-traces-endpoint", receiver.url])
        gateway.env = ENV
        try:
            vllm.start().wait_ready(VLLM_READY_PATHS, 300)
            gateway.start().wait_ready(GATEWAY_READY_PATHS, 90)
            send_traced(gateway.url)  # the tokenizer loaded, the engine warm
            send_traced(gateway.url, TRACE_ID)
            spans = receiver.wait_for(lambda got: "llm_request" in {s.name for s in got if s.trace_id == TRACE_ID}
                                      and f"chat {SERVED_MODEL_NAME}" in {s.name for s in got
                                                                          if s.trace_id == TRACE_ID}, 60)
        finally:
            gateway.stop()
            vllm.stop()
    trace = sorted((s for s in spans if s.trace_id == TRACE_ID), key=lambda s: (s.start_ns, -s.end_ns))
    draw(out, trace)
    return trace


def depth(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> int:
    d = 0
    while span.parent_span_id in by_id:
        span, d = by_id[span.parent_span_id], d + 1
    return d


def draw(out: Path, spans: list[ReceivedSpan]) -> None:
    from matplotlib.figure import Figure

    by_id = {s.span_id: s for s in spans}
    t0 = min(s.start_ns for s in spans)
    fig = Figure(figsize=(10, 0.45 * len(spans) + 1.4), dpi=100)
    ax = fig.add_subplot()
    colours = {"vllm-guard": "tab:blue", "vllm": "tab:red"}
    for row, span in enumerate(spans):
        start, width = (span.start_ns - t0) / 1e6, max((span.end_ns - span.start_ns) / 1e6, 0.05)
        ax.barh(row, width, left=start, color=colours.get(span.service, "tab:grey"), height=0.6)
        label, indent = f"{span.name}  ({span.service})", depth(span, by_id)
        ax.text(start + width, row, f"  {width:.1f} ms", va="center", fontsize=8)
        ax.set_yticks(range(len(spans)), labels=[""] * len(spans))
        ax.text(-0.58 + 0.03 * indent, row, ("└ " if indent else "") + label, va="center", ha="left", fontsize=9,
                transform=ax.get_yaxis_transform())
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the gateway received the request")
    ax.set_title("One streamed chat request, one trace: the gateway's spans (blue), vLLM's (red)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.36, right=0.95)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "trace.png")
    args = parser.parse_args()
    for span in run(args.out):
        attrs = {k: v for k, v in span.attributes.items() if k.startswith(("gen_ai.", "vllm_guard."))}
        print(f"{span.service:10} {span.name:24} {(span.end_ns - span.start_ns) / 1e6:9.1f} ms  {attrs}")
    print(f"picture: {args.out}")


if __name__ == "__main__":
    main()
