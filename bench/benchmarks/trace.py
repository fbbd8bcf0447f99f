"""One request's trace through the gateway into vLLM, drawn: the picture of docs/tracing.md.

    python -m bench run trace [--copy-to docs/img/trace.png]

Starts an OTLP/HTTP receiver (testing/otlp_receiver.py), a real vLLM (CPU build, the tests' tiny model) and
a gateway, both with ``--otlp-traces-endpoint`` pointing at the receiver; after one request that warms them up,
sends one streamed chat request carrying a client's ``traceparent`` per turn; reports each span's duration
(medians over turns) and draws the last turn's trace as a Gantt chart.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from bench.harness import plots
from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.targets import engines, proxies
from bench.workloads.trace import CLIENT_SPAN, ENV, draw, send_traced
from testing.otlp_receiver import ReceivedSpan, run_otlp_receiver
from testing.servers import SERVED_MODEL_NAME

SUMMARY = "one streamed chat's trace through the gateway into vLLM: each span's duration, drawn"
TARGETS = ["gateway"]
DEFAULT_TARGETS = ["gateway"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False, repeat=1)
    parser.add_argument("--copy-to", type=Path, default=None, help="also copy the picture here (docs/img/trace.png)")


def trace_id(turn: int) -> str:
    return f"{turn + 1:032x}"[:-4] + "cafe"


def run(ctx: Context) -> Result:
    args = ctx.args
    spans_by_turn: list[list[ReceivedSpan]] = []
    with run_otlp_receiver() as receiver:
        vllm = engines.vllm(ctx, "vllm", flags=("--otlp-traces-endpoint", f"{receiver.url}/v1/traces"))
        vllm.server.env |= {**ENV, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"}
        ctx.start(vllm)
        gateway = proxies.gateway(ctx, "gateway", [vllm], flags=("--otlp-traces-endpoint", receiver.url))
        gateway.server.env |= ENV
        ctx.start(gateway)
        send_traced(gateway.url)  # the tokenizer loaded, the engine warm

        def one(target: str, turn: int) -> dict[str, float]:
            tid = trace_id(turn)
            send_traced(gateway.url, tid)
            names = ("llm_request", f"chat {SERVED_MODEL_NAME}")
            got = receiver.wait_for(lambda s: set(names) <= {x.name for x in s if x.trace_id == tid}, 60)
            trace = sorted((s for s in got if s.trace_id == tid), key=lambda s: (s.start_ns, -s.end_ns))
            spans_by_turn.append(trace)
            return {f"{s.service}: {s.name}": (s.end_ns - s.start_ns) / 1e6 for s in trace}

        runs = in_turns(["gateway"], args.repeat, one, lambda t, n, f: ctx.say(f"turn {n + 1}: {f}"))
    keys = list(dict.fromkeys(k for r in runs["gateway"] for k in r))
    pictures = []
    if plots.unavailable() is None:
        path = ctx.picture("trace")
        draw(path, spans_by_turn[-1])
        pictures.append(path.name)
        if args.copy_to is not None:
            shutil.copyfile(path, args.copy_to)
    notes = [f"a client's traceparent (span {CLIENT_SPAN}) on one streamed chat of 64 tokens a turn; the gateway's "
             "spans and vLLM's in one trace; durations in ms"]
    return ctx.result([Measure(k, f"{k} (ms)", ".1f", "none") for k in keys], runs, [], notes=notes,
                      pictures=pictures)
