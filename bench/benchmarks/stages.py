"""The gateway's CPU per request, stage by stage: one figure for each step of a short chat's path.

    python -m bench run stages [--repeat 3] [--seconds 20] [--connections 1]

The fast fake engine and wrk share core 0; the gateway runs alone on core 1. wrk sends the overhead benchmark's
short chat (``--connections`` at a time) for ``--seconds`` while py-spy samples the gateway's stacks without
stopping it (``--nonblocking``, 500 a second, every thread); the gateway's CPU per chat over the same window
comes from /proc, and the loop thread's time run and time runnable but waiting for a core from its schedstat.
Each sample is assigned to one stage of the path (``bench.workloads.stages``); the loop thread's samples stand
for its time run and waited, a stage's figure is its share of them, and the wait (which py-spy cannot tell from
work: the thread's stack sits just back from ``epoll_wait``) is taken out of the event loop's figure and shown
apart. The sampler adds a little CPU of its own to the gateway's (it reads the process's memory); ``overhead``
measures the CPU per chat without it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from bench.harness.context import Context
from bench.harness.cpu import Sched
from bench.harness.pairing import Figures, in_turns
from bench.harness.results import Measure, Result
from bench.targets import engines, proxies
from bench.workloads import wrk
from bench.workloads.stages import ORDER, shares, split_cpu

SUMMARY = "the gateway's CPU per short chat, stage by stage (py-spy's samples split the measured CPU)"
TARGETS = ["gateway", "baseline"]
DEFAULT_TARGETS = ["gateway"]
GATEWAY_FLAGS = ("--log-level", "warning", "--max-queue", "10000")
RATE = 500


def key(stage: str) -> str:
    return "us_" + "".join(c if c.isalnum() else "_" for c in stage).strip("_")


MEASURES = [
    Measure("cpu_us", "gateway's CPU per chat (us), sampled", ".0f"),
    Measure("per_s", "chats/s", ".0f"),
    *(Measure(key(s), f"of which: {s} (us)", ".1f") for s in ORDER),
    Measure("wait_us", "the loop thread runnable, waiting for a core (us): not CPU, out of the event loop's", ".1f"),
    Measure("samples", "samples (all runs)", ".0f", "none", "sum"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(seconds=20.0)
    parser.add_argument("--connections", type=int, default=1, help="chats at a time (1)")


def loop_thread(pid: int) -> Sched:
    """The loop's thread's (the process's main thread) schedstat: seconds run, seconds runnable but waiting."""
    fields = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    return Sched(int(fields[0]) / 1e9, int(fields[1]) / 1e9, int(fields[2]))


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("stages: py-spy is not installed (the bench extra installs it)")
    return found


def run(ctx: Context) -> Result:
    args = ctx.args
    engine = engines.fake(ctx, "engine", token_delay=0.0)
    tok = proxies.tokenizer_dir()
    started = {}
    for name in args.targets:
        commit = args.baseline_commit if name == "baseline" else None
        started[name] = proxies.gateway(ctx, name, [engine], flags=GATEWAY_FLAGS, tokenizer=tok, commit=commit)
    ctx.start(engine, *started.values())
    spy = py_spy()
    for t in started.values():  # warm-up: connections, caches, lazy imports
        wrk.run(t.url + "/v1/chat/completions", wrk.SHORT_CHAT, 4, 1.0, ctx.cores.client)

    def measure(name: str, turn: int) -> Figures:
        target = started[name]
        out = ctx.log_path(f"{name}-{turn + 1}.spy")
        sampler = subprocess.Popen(
            [spy, "record", "--pid", str(target.pid), "--rate", str(RATE), "--duration", f"{args.seconds + 2:g}",
             "--nonblocking", "--threads", "--format", "raw", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            cpu0, loop0 = target.cpu_seconds(), loop_thread(target.pid)
            done = wrk.run(target.url + "/v1/chat/completions", wrk.SHORT_CHAT, args.connections, args.seconds,
                           ctx.cores.client)
            cpu, loop = target.cpu_seconds() - cpu0, loop_thread(target.pid) - loop0
        finally:
            sampler.wait(args.seconds + 60)
        lines = out.read_text().splitlines() if out.exists() else []
        per = cpu * 1e6 / done.requests if done.requests else float("nan")
        stage_us = split_cpu(shares(lines), loop.ran, loop.waited, cpu, done.requests)
        figures: Figures = {"cpu_us": per, "per_s": done.per_second,
                            "samples": float(sum(int(ln.rpartition(" ")[2]) for ln in lines if ln.strip())),
                            "wait_us": loop.waited * 1e6 / done.requests if done.requests else float("nan")}
        figures |= {key(s): stage_us.get(s, 0.0) for s in ORDER}
        return figures

    def said(name: str, turn: int, f: Figures) -> None:
        ctx.say(f"turn {turn + 1} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in f.items()))

    runs = in_turns(args.targets, args.repeat, measure, said)
    notes = [f"{args.connections} chat(s) at a time for {args.seconds:g} s a run; py-spy at {RATE} samples/s, "
             "without stopping the gateway; a stage's figure is its share of the loop thread's samples times its "
             "time run and waited per chat, the wait taken out of the event loop's; other threads: the process's "
             "CPU beyond the loop thread's (bench/workloads/stages.py says which frames make each stage)"]
    return ctx.result(MEASURES, runs, ["baseline"], notes=notes)
