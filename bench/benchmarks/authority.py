"""The admission authority's own work for a worker's request, in-process, this tree against a commit's.

    python -m bench run authority --baseline-commit 975986e [--requests 20000] [--batch 1 16] [--repeat 3]

``bench/workloads/authority.py`` in a process of its own for each target and turn, with that target's gateway
first on the path: the CPU per request of the authority's side of a worker's channel given a short chat's frames
(``Admit``, ``Release``, ``End``), ``--batch`` requests to a read, and of the same admission entered directly. No
socket, no other process: what the scaling benchmark's ``c`` (the coordination per request a worker served)
holds besides the system calls, wake-ups and loop iterations that carry the frames, measured apart from them and
from the load of the machine (a process's own CPU time).
"""

from __future__ import annotations

import argparse
import os
import subprocess

import orjson

from bench.harness.context import Context
from bench.harness.pairing import Figures, in_turns
from bench.harness.processes import ROOT, python
from bench.harness.results import Measure, Result
from bench.targets.proxies import source_at

SUMMARY = "the admission authority's CPU per worker request in-process (its channel's frames vs admission alone)"
TARGETS = ["gateway"]
DEFAULT_TARGETS = ["gateway"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--requests", type=int, default=20000, help="requests a figure (20000)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="requests' frames to a read (1 16)")


def measures(batches: list[int]) -> list[Measure]:
    out = [Measure("alone", "admission alone (async with the reservation), CPU us per request", ".1f", "ratio")]
    for b in batches:
        out += [Measure(f"authority_b{b}", f"authority, {b} request(s) to a read, CPU us per request", ".1f", "ratio"),
                Measure(f"turns_b{b}", f"of it the loop's turns, {b} to a read, CPU us per request", ".1f", "none")]
    return out


def run(ctx: Context) -> Result:
    args = ctx.args
    sources = {"gateway": ROOT}
    if "baseline" in args.targets:
        sources["baseline"] = source_at(args.baseline_commit)[0]

    def one(target: str, turn: int) -> Figures:
        src = sources[target]
        argv = [*python("bench.workloads.authority"), "--requests", str(args.requests), "--batch",
                *map(str, args.batch)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(src), str(ROOT)]))}
        done = subprocess.run(argv, cwd=src, env=env, capture_output=True, text=True, timeout=600, check=True)
        figures: Figures = orjson.loads(done.stdout.strip().splitlines()[-1])
        ctx.say(f"turn {turn + 1} {target}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
        return figures

    runs = in_turns(args.targets, args.repeat, one)
    notes = [f"target baseline: the gateway at {args.baseline_commit}" if args.baseline_commit else "",
             f"{args.requests} requests a figure, in a process "
             "of its own a target and turn; CPU time of that process"]
    return ctx.result(measures(args.batch), runs, ["baseline"], notes=[n for n in notes if n])
