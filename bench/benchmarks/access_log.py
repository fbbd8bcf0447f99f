"""What one access-log record costs the event loop, in-process: an ordinary record, and one whose model name is
1 MiB or 8 MiB of a client's text. No server.

    python -m bench run access-log [--target text] [--target json] [--repeat 3] [--scale 1]

``AccessLog.write`` runs as ``vllm-guard serve`` runs it: the process-wide log redaction installed, the default
handler's queue and writer thread, writing to a pipe read at once (10,000 ordinary records a run, 20 of 1 MiB, 10 of
8 MiB). Per record: the caller's time (what the event loop pays: a put on the writer's queue), the time until all
were written (the writer thread formats, redacts and writes them), and the process's CPU meanwhile (the writer's
work holds the interpreter's lock the loop needs). Every field is cut to a bounded form before the line is
formatted, so the huge records should cost about what an ordinary one does (before the bound, an 8 MiB model name
held the loop 1.3-1.6 s in text, 0.32-0.37 s in JSON: docs/security.md). The two formats are the targets, in turns.
"""

from __future__ import annotations

import argparse
from typing import cast

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.workloads.access_log import caller_cost, cases
from gateway.observe.access_log import AccessLogFormat

SUMMARY = "the caller's cost of one access-log record, ordinary and with a 1 or 8 MiB model name, text and json"
TARGETS = ["text", "json"]
DEFAULT_TARGETS = ["text", "json"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies the records written per run (10,000 ordinary, 20 and 10 huge: 1)")


def measures() -> list[Measure]:
    out = []
    for c in cases():
        stem = c.key.removesuffix("_us")
        out += [Measure(c.key, f"{c.label}: the caller's time per record (us)", ".1f"),
                Measure(f"{stem}_written_us", f"{c.label}: time per record until written (us)", ".1f"),
                Measure(f"{stem}_cpu_us", f"{c.label}: the process's CPU per record (us)", ".1f")]
    return out


def run(ctx: Context) -> Result:
    def one(target: str, turn: int) -> dict[str, float]:
        return caller_cost(cast(AccessLogFormat, target), ctx.args.scale)

    def report(target: str, turn: int, figures: dict[str, float]) -> None:
        ctx.say(f"turn {turn + 1} {target}: " + ", ".join(f"{k} {v:.0f}" for k, v in figures.items()))

    runs = in_turns(ctx.args.targets, ctx.args.repeat, one, report)
    notes = ["records written to a pipe a thread reads at once; a fresh writer for each kind of record"]
    return ctx.result(measures(), runs, [t for t in TARGETS if t in runs][:1], notes=notes)
