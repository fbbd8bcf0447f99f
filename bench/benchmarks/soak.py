"""Bounded soak: ordinary and hostile clients mixed at a fixed rate against the gateway in front of the vLLM
simulator, on loopback, for a fixed time; the gateway's memory and open file descriptors before and after, and its
ledger.

    python -m bench run soak [--seconds 120] [--rate 40] [--clients 4] [--repeat 1]

The simulator and the gateway (small connection limits, so that slow clients are cut off within seconds) start on
free ports. ``--clients`` client tasks each start requests on a fixed schedule (``--rate`` a second in all), drawn
from a seeded mix: ordinary chats, streams and completions, and the hostile cases of tests/integration/hostile.
Each answer is checked against what the case expects. After the load the soak waits for idle connections to be
closed, then measures again; the gateway's log is scanned for tracebacks. A turn is one soak (``--seconds``,
at most 600, plus a few seconds of settling).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.targets import engines, proxies
from bench.workloads.soak import BODY_LIMIT, KEY, Tally, soak

SUMMARY = "ordinary and hostile clients mixed against the gateway: memory, descriptors, ledger, unexpected answers"
TARGETS = ["gateway"]
DEFAULT_TARGETS = ["gateway"]
# Small limits, so that a slow client is cut off within seconds and the soak measures their cleanup.
GATEWAY_LIMITS = (
    "--max-body-bytes", str(BODY_LIMIT), "--header-timeout", "1", "--keep-alive-timeout", "1",
    "--body-timeout", "2", "--body-rate-grace", "0.5", "--min-body-rate", "1024", "--max-connections", "512",
    "--queue-timeout", "5", "--max-queue", "1024", "--api-key", KEY, "--log-level", "warning",
)  # fmt: skip
MEASURES = [
    Measure("requests", "requests sent", ".0f", "none", "sum"),
    Measure("unexpected", "answered otherwise than expected (all runs)", ".0f", "none", "sum"),
    Measure("tracebacks", "tracebacks in the gateway's log", ".0f", "none", "max"),
    Measure("rss_before_mib", "RSS before (MiB)", ".1f", "none"), Measure("rss_after_mib", "RSS after (MiB)", ".1f",
                                                                         "none"),
    Measure("rss_peak_mib", "RSS peak during the load (MiB)", ".1f", "none", "max"),
    Measure("fds_before", "open file descriptors before", ".0f", "none"),
    Measure("fds_after", "open file descriptors after", ".0f", "none"),
    Measure("fds_peak", "open file descriptors, peak", ".0f", "none", "max"),
    Measure("ledger_after_blocks", "ledger after: committed blocks", ".0f", "none", "max"),
    Measure("ledger_after_in_flight", "ledger after: in flight", ".0f", "none", "max"),
    Measure("ledger_after_queued", "ledger after: queued", ".0f", "none", "max"),
]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False, seconds=120.0, repeat=1)
    parser.add_argument("--rate", type=float, default=40.0, help="requests started per second, all clients (40)")
    parser.add_argument("--clients", type=int, default=4, help="client tasks sharing the rate (4)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the request mix (1)")


def cases_table(tallies: dict[str, Tally]) -> str:
    lines = ["| case | sent | unexpected | p50 (ms) | example of an unexpected answer |", "|" + " --- |" * 5]
    for name, t in tallies.items():
        p50 = f"{statistics.median(t.latencies) * 1000:.1f}" if t.latencies else ""
        example = t.examples[0].replace("|", "\\|") if t.examples else ""
        lines.append(f"| {name} | {t.sent} | {t.unexpected} | {p50} | {example} |")
    return "\n".join(lines)


def run(ctx: Context) -> Result:
    args = ctx.args
    seconds = min(args.seconds, 600.0)
    tok = proxies.tokenizer_dir()
    sim = engines.simulator(ctx, "simulator", token_delay=0.002, tokenizer=tok, num_blocks=4096, max_model_len=512,
                            max_num_seqs=1024)
    ctx.start(sim)
    gateway = proxies.gateway(ctx, "gateway", [sim], flags=[*GATEWAY_LIMITS, "--tokenizer", str(tok)])
    ctx.start(gateway)
    tables: list[str] = []

    def one(target: str, turn: int) -> dict[str, float]:
        before, after, peak, tallies = asyncio.run(soak(gateway.pid, gateway.url, seconds, args.rate, args.clients,
                                                        args.seed + turn))
        tables.append(cases_table(tallies))
        blocks, in_flight, queued = (float(x) for x in after.ledger.split(" / "))
        return {"requests": float(sum(t.sent for t in tallies.values())),
                "unexpected": float(sum(t.unexpected for t in tallies.values())),
                "tracebacks": float(gateway.server.log_path.read_text(errors="replace").count("Traceback")),
                "rss_before_mib": before.rss_mib, "rss_after_mib": after.rss_mib, "rss_peak_mib": peak.rss_mib,
                "fds_before": float(before.fds), "fds_after": float(after.fds), "fds_peak": float(peak.fds),
                "ledger_after_blocks": blocks, "ledger_after_in_flight": in_flight, "ledger_after_queued": queued}

    runs = in_turns(["gateway"], args.repeat, one, lambda t, n, f: ctx.say(f"soak {n + 1}: {f}"))
    notes = [f"{seconds:g} s at {args.rate:g} requests/s from {args.clients} client tasks a soak; the vLLM simulator "
             "(2 ms a token) behind the gateway; the gateway with small connection limits: " + " ".join(GATEWAY_LIMITS)]
    return ctx.result(MEASURES, runs, [], notes=notes, extra_markdown="The cases of the last soak:\n\n" + tables[-1])
