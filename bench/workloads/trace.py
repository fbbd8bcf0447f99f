"""The trace benchmark's request and picture: one streamed chat carrying a client's ``traceparent``, and its
trace's spans drawn as a Gantt chart (matplotlib, the ``bench`` extra).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from testing.otlp_receiver import ReceivedSpan
from testing.servers import SERVED_MODEL_NAME

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
