"""Slow readers: many clients that ask for a stream and never read it, and what the gateway holds for them.

    python -m bench run slow-readers [--readers 2000] [--seconds 20] [--bound 268435456] [--repeat 3]

The fast fake engine streams large tokens (``--token-bytes``, 16 KiB by default) as fast as it can; ``--readers``
clients each ask for one stream and read nothing. Each stream may hold ``--max-buffered-bytes`` (4 MiB) for its
reader, so 2,000 of them could hold 8 GiB; all streams together may hold ``--max-total-buffered-bytes``, past
which the streams holding the most are cut first. Targets: ``bounded`` (the total bound at ``--bound``),
``default`` (the default bound, 2 GiB) and ``per-stream`` (a total bound too large to matter: each stream's own
bound alone, as before the total existed). Per run: the gateway's resident memory before, at its peak and after
the readers hung up, ``/health`` on a fresh connection meanwhile (the loop stays responsive), and the requests
still in flight afterwards (the ledger must return to zero).
"""

from __future__ import annotations

import argparse
import asyncio

from bench.harness.context import Context
from bench.harness.pairing import Figures, in_turns
from bench.harness.results import Measure, Result
from bench.targets import engines, proxies
from bench.workloads.slow_readers import hold

SUMMARY = "thousands of clients that never read their streams: the gateway's memory, /health, the ledger after"
TARGETS = ["bounded", "per-stream", "default"]
DEFAULT_TARGETS = ["bounded", "per-stream"]
GATEWAY_FLAGS = ("--log-level", "warning", "--max-queue", "10000", "--max-connections", "8192")
TOTAL_BOUND = {"default": None, "per-stream": 1 << 40}
MEASURES = [
    Measure("connected", "readers connected", ".0f", "none"),
    Measure("rss_before_mib", "gateway RSS before (MiB)", ".0f", "none"),
    Measure("rss_peak_mib", "gateway RSS, peak (MiB)", ".0f", "ratio", "max"),
    Measure("rss_after_mib", "gateway RSS after the readers left (MiB)", ".0f"),
    Measure("health_p50_ms", "/health meanwhile, p50 (ms)", ".1f"),
    Measure("health_max_ms", "/health meanwhile, slowest (ms)", ".1f", "ratio", "max"),
    Measure("health_failed", "/health failed meanwhile (all runs)", ".0f", "none", "sum"),
    Measure("in_flight_after", "requests in flight afterwards", ".0f", "none", "max"),
]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(seconds=20.0)
    parser.add_argument("--readers", type=int, default=2000, help="clients that never read (2000)")
    parser.add_argument("--tokens", type=int, default=4000, help="tokens asked of each stream (4000)")
    parser.add_argument("--token-bytes", type=int, default=16384, help="bytes of each token's text (16384)")
    parser.add_argument("--bound", type=int, default=256 << 20,
                        help="--max-total-buffered-bytes of the 'bounded' target (256 MiB)")


def run(ctx: Context) -> Result:
    args = ctx.args
    engine = engines.fake(ctx, "engine", token_delay=0.0)
    tok = proxies.tokenizer_dir()
    bounds = {**TOTAL_BOUND, "bounded": args.bound}
    gateways = {}
    for name in args.targets:
        bound = bounds[name]
        flags = [*GATEWAY_FLAGS, *(("--max-total-buffered-bytes", str(bound)) if bound is not None else ())]
        gateways[name] = proxies.gateway(ctx, name, [engine], flags=flags, tokenizer=tok)
    ctx.start(engine, *gateways.values())

    def measure(name: str, turn: int) -> Figures:
        g = gateways[name]
        held = asyncio.run(hold(g.pid, g.url, args.readers, args.seconds, args.tokens, args.token_bytes))
        return held.figures()

    def said(name: str, turn: int, f: Figures) -> None:
        ctx.say(f"turn {turn + 1} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in f.items()))

    runs = in_turns(args.targets, args.repeat, measure, said)
    notes = [f"{args.readers} readers for {args.seconds:g} s a run, each asking {args.tokens} tokens of "
             f"{args.token_bytes} bytes; 'bounded': --max-total-buffered-bytes {args.bound}, 'per-stream': "
             f"{1 << 40} (no total bound to speak of), 'default': the default (2 GiB); each stream's own bound is "
             "the default --max-buffered-bytes (4 MiB)"]
    return ctx.result(MEASURES, runs, ["per-stream", "default"], notes=notes)
