"""One run of the realistic benchmark against one target: the loads, the servers of an invocation, what is read
around each run (preemptions, refusals, CPU, where the time went), and the picture of a load's first turn."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import plots
from bench.harness.context import Context
from bench.harness.cpu import Meter, Spinner, own_seconds
from bench.harness.scrape import get_json, refusals, scrape
from bench.harness.target import Target
from bench.targets.engines import wait_idle
from bench.workloads.realistic import MIXES, Figures, Outcome, figures, plan, prompt
from bench.workloads.realistic_clients import CLIENTS, run_vllm_bench
from bench.workloads.time_split import (
    ENGINE_HISTOGRAMS,
    GATEWAY_HISTOGRAMS,
    Histograms,
    Waits,
    access_lines,
    labelled_processes,
    ttft_split,
)

PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass(frozen=True)
class Load:
    rate_factor: float  # of --rate
    duration_s: float
    read_timeout_s: float

    @property
    def sustained(self) -> bool:
        """An overload of the grid: 60 s of arrivals read by clients that give up after 30 s."""
        return self.read_timeout_s < 600.0


# ``overload`` is twice the capacity rate; the grid's other overloads, 1.5x and 3x (a grid of loads, not a point).
LOADS = {
    "capacity": Load(1.0, 30.0, 600.0),
    "double": Load(2.0, 30.0, 600.0),
    "overload": Load(2.0, 60.0, 30.0),
    "overload-1.5x": Load(1.5, 60.0, 30.0),
    "overload-3x": Load(3.0, 60.0, 30.0),
}


def quick_loads() -> dict[str, Load]:
    return {n: Load(s.rate_factor, 12.0 if s.sustained else 8.0, s.read_timeout_s) for n, s in LOADS.items()}


# The engine each target sends to (a gateway's: the one it fronts); the others send to ``direct``.
ENGINE_OF = {"watermark": "watermark", "default+watermark": "watermark"}

@dataclass
class Bench:
    """The servers of one invocation and how to send a run through each target."""

    ctx: Context
    engines: dict[str, Target]
    gateways: dict[str, Target]
    eos_id: int
    model: Path
    reasons: dict[str, Counter[str]] = field(default_factory=dict)

    def version(self) -> str:
        """vLLM's version, asked of the first engine, resumed first: a run through the watermark's stops it."""
        self.only(self.engines["direct"])
        return str(get_json(f"{self.engines['direct'].url}/version").get("version", "?"))

    def engine_of(self, target: str) -> Target:
        return self.engines[ENGINE_OF.get(target, "direct")]

    def only(self, engine: Target) -> None:
        """Stops the engines a run does not use (SIGSTOP to each server's group), resumes the one it does: an idle
        vLLM's CPU build still polls, and on two cores its processes took the CPU from the gateway in the runs
        that went through one."""
        for other in self.engines.values():
            if other.server.alive():
                other.server.signal(signal.SIGCONT if other is engine else signal.SIGSTOP)

    def send(self, base: str, plans: list[Any], texts: list[str], read_timeout: float) -> list[Outcome]:
        args = self.ctx.args
        if args.client == "vllm":
            return asyncio.run(run_vllm_bench(base, plans, texts, self.eos_id, read_timeout, str(self.model)))
        return asyncio.run(CLIENTS[args.client](base, plans, texts, self.eos_id, read_timeout))

    def run(self, target: str, load: Load, rate: float, seed: int, index: int,
            reasons: dict[str, Counter[str]] | None = None) -> tuple[Figures, list[Outcome], dict[str, float]]:
        args = self.ctx.args
        plans = plan(rate * load.rate_factor, load.duration_s, seed, MIXES[getattr(args, "mix", "chat")])
        texts = [prompt(p, i, seed, index) for i, p in enumerate(plans)]
        engine = self.engine_of(target)
        gateway = self.gateways.get(target)
        self.only(engine)
        wait_idle(engine)
        base = gateway.url if gateway is not None else engine.url
        preempted = scrape(engine.url, PREEMPTIONS)
        refused = refusals(base) if gateway is not None else {}
        marks = [Histograms(engine.url, ENGINE_HISTOGRAMS)]
        if gateway is not None:
            marks.append(Histograms(gateway.url, GATEWAY_HISTOGRAMS))
        pids = {"engine": engine.pid, "client": 0} | ({"gateway": gateway.pid} if gateway is not None else {})
        waits = Waits(self._labelled(engine, gateway)) if getattr(args, "schedstat", False) else None
        meter = Meter(pids).start()
        frontend0 = own_seconds(engine.pid)
        spinner = Spinner(args.busy_cores) if target == "busy" else None
        # The grid's CPU hog: a process of its own session spinning beside every target's run, as another
        # service on a shared host does; vLLM and the gateway lose cores to it alike.
        hog = Spinner(args.hog, session=True) if getattr(args, "hog", 0.0) > 0 else None
        with (
            hog if hog is not None else contextlib.nullcontext(),
            spinner if spinner is not None else contextlib.nullcontext(),
        ):
            outcomes = self.send(base, plans, texts, load.read_timeout_s)
        wait_idle(engine)
        cpu = meter.stop()
        frontend = own_seconds(engine.pid) - frontend0
        taken = spinner.cpu_s if spinner is not None else cpu.get("gateway", 0.0)
        fig = figures(outcomes, args.objective, scrape(engine.url, PREEMPTIONS) - preempted,
                      (cpu["engine"], taken, cpu["client"]))
        # vLLM's API server alone (its process, not the engine core it started): the frontend the gateway adds to.
        tokens = sum(o.tokens for o in outcomes)
        extra: dict[str, float] = {"frontend_cpu_us_token": 1e6 * frontend / tokens if tokens else math.nan}
        if hog is not None:
            extra["hog_cpu_s"] = hog.cpu_s
        for mark in marks:
            extra |= mark.means()
        if waits is not None:
            extra |= waits.figures()
        if gateway is not None:
            self._refusals(reasons, f"{target} at {rate * load.rate_factor:g}/s", base, refused)
            if getattr(args, "ttft_split", False):
                time.sleep(2)  # the access log's writer
                seen = [(o.request_id, o.sent_wall, o.first_wall) for o in outcomes if o.request_id and o.first_wall]
                extra |= ttft_split(seen, access_lines(gateway.server.log_path.read_text(errors="replace")))
        errors = sorted({o.error for o in outcomes if o.error})
        if errors:
            self.ctx.say(f"{target}: errors seen: {errors[:3]}")
        lost = losses(outcomes)
        if lost:
            self.ctx.say(f"{target}: not completed: " + ", ".join(f"{n} {kind}" for kind, n in sorted(lost.items())))
        return fig, outcomes, extra

    def _labelled(self, engine: Target, gateway: Target | None) -> dict[str, int]:
        named = labelled_processes(engine.pid, "API server") | {"client": os.getpid()}
        if gateway is not None:
            named["gateway"] = gateway.pid
        return named

    @staticmethod
    def _refusals(reasons: dict[str, Counter[str]] | None, key: str, base: str, before: dict[str, float]) -> None:
        if reasons is None:
            return
        counted = reasons.setdefault(key, Counter())
        for reason, value in refusals(base).items():
            counted[reason] += round(value - before.get(reason, 0.0))


def losses(outcomes: list[Outcome]) -> Counter[str]:
    """The requests that got no whole answer, by kind: a refusal or another status, a client timeout, a stream
    that ended without its usage, or the client's error (a connection closed under it: a read error)."""
    out: Counter[str] = Counter()
    for o in outcomes:
        if o.completed:
            continue
        if o.timed_out:
            out["client timeout"] += 1
        elif o.error:
            out[f"read error {o.error.partition('(')[0]}"] += 1
        elif o.status == 200:
            out["200 without a whole answer"] += 1
        else:
            out[str(o.status)] += 1
    return out


def picture(ctx: Context, load: str, first_run: dict[str, list[Outcome]], spec: Load, objective: float) -> str:
    """Each request's TTFT over the load's first turn, every target; the file's name, or '' when skipped."""
    why = plots.unavailable()
    if why is not None:
        ctx.say(f"picture skipped: {why}")
        return ""
    series = [plots.TtftSeries(
        target, [o.at for o in out if o.completed], [o.ttft or 0.0 for o in out if o.completed],
        [o.at for o in out if o.status in (429, 503)], [o.at for o in out if o.timed_out],
    ) for target, out in first_run.items()]  # fmt: skip
    path = ctx.picture(load)
    plots.ttft_figure(path, f"Time to first token over the run: {load} (first turn)", series, objective,
                      spec.read_timeout_s if spec.read_timeout_s < 600 else None)
    return path.name
