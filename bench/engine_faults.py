"""An engine killed, or frozen, under load: two vLLM servers behind one gateway, steady client load through the
gateway, and one server (engine 1) failed in the middle of each run.

Load: ``CLIENTS`` loops of the OpenAI SDK (``max_retries=0``, so a loss shows), each sending one completion after
another, streamed and not in turn, ~150 prompt tokens and ``MAX_TOKENS`` output tokens (``ignore_eos``). A watcher
reads the gateway's ``/guard/status`` and ``/health`` every ``WATCH_S``.

- ``killed``: after ``BEFORE_S`` of load, SIGKILL to the server's whole process group (API server and engine
  core); ``OUT_S`` later the same command is started again on the same port; the run ends ``AFTER_S`` after the
  gateway placed a request on it again.
- ``frozen``: the gateway runs with ``--hang-timeout HANG_TIMEOUT_S``; after ``BEFORE_S`` of load, SIGSTOP to the
  server's engine core only (its API server goes on answering ``/health`` and ``/metrics``); SIGCONT ``OUT_S``
  later; the run ends ``AFTER_S`` after the gateway placed a request on it again.

An answer counts as succeeded when it carries all ``MAX_TOKENS`` tokens. A failed request is *cut* when a stream
had its head (200) and then ended in an error event (a stream in flight on the failed engine: by design never sent
again), *lost* otherwise (an error answer, or no answer at all).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from bench.engine_servers import Pair, restarted, two_servers, wait_until_ready
from tests.e2e.servers import SERVED_MODEL_NAME, VLLM_READY_PATHS, get_json, metric_sum
from tests.e2e.test_hung_e2e import engine_core_pid

CLIENTS = 4
MAX_TOKENS = 32
PROMPT_WORDS = 60
IGNORE_EOS = {"ignore_eos": True}  # every answer runs to MAX_TOKENS, so a shorter one is a fault
VICTIM = 1  # the engine failed in each run: not the first, whose tokenizer counts
BEFORE_S = 12.0
OUT_S = 15.0
AFTER_S = 3.0
REJOIN_LIMIT_S = 300.0  # a killed server starts again under load on a small CPU box
HANG_TIMEOUT_S = 5.0
WATCH_S = 0.1
GATEWAY_ARGS = {"killed": ("--queue-timeout", "60"),
                "frozen": ("--queue-timeout", "60", "--hang-timeout", f"{HANG_TIMEOUT_S:g}")}
DECLARED = {"killed": "down", "frozen": "hung"}
FAILOVERS = "vllm_guard_failovers_total"


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it; times are ``time.monotonic()``."""

    started: float
    ended: float
    stream: bool
    engine: str | None  # the answer's x-guard-engine
    result: str  # ok | cut | lost | short
    detail: str = ""


@dataclass(frozen=True)
class Sample:
    """One look at the gateway: each engine's state and admissions, and its /health status."""

    at: float
    states: tuple[str, ...]
    admitted: tuple[int, ...]
    health: int


@dataclass
class FaultRun:
    outcomes: list[Outcome]
    samples: list[Sample]
    loaded: float  # load began
    fault: float  # SIGKILL or SIGSTOP
    healed: float  # restart or SIGCONT
    ended: float
    failovers: float


# -- accounting (pure) -------------------------------------------------------------------------------
def longest_gap(ends: Sequence[float], start: float, stop: float) -> tuple[float, float]:
    """The longest time without a success in [start, stop] and where it began: the gaps between consecutive
    success times, the one before the first and the one after the last included."""
    points = [start, *sorted(t for t in ends if start <= t <= stop), stop]
    return max(((b - a, a) for a, b in itertools.pairwise(points)), key=lambda gap: gap[0])


def first_at(samples: Sequence[Sample], after: float, holds: Callable[[Sample], bool]) -> float | None:
    """When the first sample taken at or after ``after`` for which ``holds`` is true was taken."""
    return next((s.at for s in samples if s.at >= after and holds(s)), None)


def admitted_at(samples: Sequence[Sample], engine: int, at: float) -> int:
    """The engine's admissions in the last sample taken at or before ``at`` (0 before the first)."""
    return max((s.admitted[engine] for s in samples if s.at <= at), default=0)


def tokens_per_s(outcomes: Sequence[Outcome], start: float, stop: float) -> float:
    done = sum(1 for o in outcomes if o.result == "ok" and start <= o.ended < stop)
    return done * MAX_TOKENS / (stop - start) if stop > start else math.nan


def figures(run: FaultRun, workload: str, victim: int = VICTIM) -> dict[str, float]:
    """One run's figures by name (NaN where an event never came); times in seconds from the event."""
    out = Counter(o.result for o in run.outcomes)
    state = DECLARED[workload]
    declared = first_at(run.samples, run.fault, lambda s: s.states[victim] == state)
    ready = first_at(run.samples, run.healed, lambda s: s.states[victim] == "ready")
    healed_with = admitted_at(run.samples, victim, run.healed)
    placed = first_at(run.samples, run.healed, lambda s: s.admitted[victim] > healed_with)
    out_from = declared if declared is not None else run.healed
    answered_while_out = sum(1 for o in run.outcomes if o.engine == str(victim) and out_from <= o.started < run.healed)
    gap, _ = longest_gap([o.ended for o in run.outcomes if o.result == "ok"], run.loaded, run.ended)
    return {
        "sent": len(run.outcomes), "ok": out["ok"], "lost": out["lost"], "cut": out["cut"], "short": out["short"],
        "failovers": run.failovers, "gap": gap,
        "declared": declared - run.fault if declared is not None else math.nan,
        "placed_out": healed_with - admitted_at(run.samples, victim, out_from) if declared is not None else math.nan,
        "answered_out": answered_while_out,
        "health_not_200": sum(1 for s in run.samples if s.health != 200),
        "tps_before": tokens_per_s(run.outcomes, run.loaded, run.fault),
        "tps_out": tokens_per_s(run.outcomes, out_from, run.healed),
        "rejoin_ready": ready - run.healed if ready is not None else math.nan,
        "rejoin_placed": placed - run.healed if placed is not None else math.nan,
    }


def figure_table(rows: Sequence[tuple[str, str]], runs: Sequence[dict[str, float]], digits: dict[str, int]) -> str:
    """A row per figure (label, key): each run's value, then the median of the runs that have one."""
    head = "| figure | " + " | ".join(f"run {i}" for i in range(1, len(runs) + 1)) + " | median |"
    lines = [head, "|" + " --- |" * (len(runs) + 2)]

    def shown(key: str, v: float) -> str:
        return "-" if math.isnan(v) else f"{v:.{digits.get(key, 0)}f}"

    for label, key in rows:
        values = [r[key] for r in runs]
        known = [v for v in values if not math.isnan(v)]
        med = statistics.median(known) if known else math.nan
        lines.append(f"| {label} | " + " | ".join(shown(key, v) for v in values) + f" | {shown(key, med)} |")
    return "\n".join(lines)


# -- load and watch ----------------------------------------------------------------------------------
async def one_request(client: AsyncOpenAI, prompt: str, stream: bool) -> Outcome:
    started = time.monotonic()
    engine: str | None = None
    headed = False
    tokens = 0
    try:
        if stream:
            async with client.completions.with_streaming_response.create(
                model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=IGNORE_EOS, stream=True,
                stream_options={"include_usage": True},
            ) as raw:
                engine, headed = raw.headers.get("x-guard-engine"), True
                async for chunk in await raw.parse():
                    tokens = chunk.usage.completion_tokens if chunk.usage is not None else tokens
        else:
            answer = await client.completions.with_raw_response.create(
                model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=IGNORE_EOS
            )
            engine = answer.headers.get("x-guard-engine")
            usage = answer.parse().usage
            tokens = usage.completion_tokens if usage is not None else 0
    except Exception as exc:  # every failure is counted, by how it showed
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        return Outcome(started, time.monotonic(), stream, engine, "cut" if headed else "lost", detail)
    result = "ok" if tokens == MAX_TOKENS else "short"
    return Outcome(started, time.monotonic(), stream, engine, result, f"{tokens} tokens" if result == "short" else "")


async def client_loop(base: str, k: int, seed: int, stop: asyncio.Event, outcomes: list[Outcome]) -> None:
    rng = random.Random(seed * 100 + k)
    async with AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120) as client:
        i = 0
        while not stop.is_set():
            # A fresh prompt each time: no prefix is shared, so placement goes by headroom over both engines.
            prompt = " ".join(f"w{rng.randrange(400)}" for _ in range(PROMPT_WORDS))
            outcomes.append(await one_request(client, prompt, stream=(i + k) % 2 == 0))
            i += 1


async def watch(base: str, stop: asyncio.Event, samples: list[Sample]) -> None:
    async with httpx.AsyncClient(timeout=5.0) as http:
        while not stop.is_set():
            try:
                rows = (await http.get(f"{base}/guard/status")).json()["engines"]
                health = (await http.get(f"{base}/health")).status_code
            except httpx.HTTPError:
                health, rows = 0, None
            if rows is not None:
                at = time.monotonic()
                samples.append(Sample(at, tuple(r["state"] for r in rows), tuple(r["admitted_total"] for r in rows),
                                      health))
            await asyncio.sleep(WATCH_S)


async def gateway_failovers(base: str) -> float:
    async with httpx.AsyncClient(timeout=10.0) as http:
        return metric_sum((await http.get(f"{base}/metrics")).text, FAILOVERS)


async def placed_again(samples: list[Sample], healed: float, limit_s: float) -> None:
    """Until the gateway places a request on the victim after ``healed``, or ``limit_s`` passed."""
    with_then = admitted_at(samples, VICTIM, healed)
    while time.monotonic() - healed < limit_s:
        if first_at(samples, healed, lambda s: s.admitted[VICTIM] > with_then) is not None:
            return
        await asyncio.sleep(0.2)


def kill(pair: Pair) -> None:
    proc = pair.servers[VICTIM].proc
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)  # the API server and its engine core: their own process group
    proc.wait(timeout=30)


async def fault_run(pair: Pair, workload: str, seed: int) -> FaultRun:
    base = pair.gateway.url
    stop, stop_watch = asyncio.Event(), asyncio.Event()
    outcomes: list[Outcome] = []
    samples: list[Sample] = []
    failovers = await gateway_failovers(base)
    watcher = asyncio.create_task(watch(base, stop_watch, samples))
    loaded = time.monotonic()
    clients = [asyncio.create_task(client_loop(base, k, seed, stop, outcomes)) for k in range(CLIENTS)]
    core: int | None = None
    try:
        await asyncio.sleep(BEFORE_S)
        if workload == "killed":
            fault = time.monotonic()
            await asyncio.to_thread(kill, pair)
        else:
            proc = pair.servers[VICTIM].proc
            assert proc is not None
            core = engine_core_pid(proc.pid)
            fault = time.monotonic()
            os.kill(core, signal.SIGSTOP)
        await asyncio.sleep(fault + OUT_S - time.monotonic())
        healed = time.monotonic()
        if core is not None:
            os.kill(core, signal.SIGCONT)
            core = None
        else:
            pair.servers[VICTIM] = restarted(pair.servers[VICTIM])
        await placed_again(samples, healed, REJOIN_LIMIT_S)
        await asyncio.sleep(AFTER_S)
    finally:
        if core is not None:
            os.kill(core, signal.SIGCONT)
        stop.set()
        await asyncio.gather(*clients)
        ended = time.monotonic()
        stop_watch.set()
        await watcher
    return FaultRun(outcomes, samples, loaded, fault, healed, ended, await gateway_failovers(base) - failovers)


def warm(pair: Pair) -> None:
    """Each server ready (one started again last run may still be starting), its engine ready in the gateway,
    and one request straight to it: a fresh engine's first step can outlast the hang bound."""
    for server in pair.servers:
        server.wait_ready(VLLM_READY_PATHS, REJOIN_LIMIT_S)
    wait_until_ready(pair.gateway)
    for server in pair.servers:
        httpx.post(f"{server.url}/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": "warm up",
                                                         "max_tokens": 4}, timeout=120).raise_for_status()


# -- the report --------------------------------------------------------------------------------------
ROWS = {
    "killed": [
        ("requests sent", "sent"), ("succeeded", "ok"), ("lost (failed with no answer)", "lost"),
        ("streams cut after their head", "cut"), ("short answers", "short"),
        ("failovers (`vllm_guard_failovers_total`)", "failovers"), ("longest gap between successes, s", "gap"),
        ("SIGKILL -> engine `down` in /guard/status, s", "declared"),
        ("requests the gateway placed on it while down", "placed_out"),
        ("answers from it (x-guard-engine) while down", "answered_out"), ("/health not 200, samples", "health_not_200"),
        ("output tok/s, both engines", "tps_before"), ("output tok/s, one engine", "tps_out"),
        ("restart -> `ready` in /guard/status, s", "rejoin_ready"),
        ("restart -> first request placed on it, s", "rejoin_placed"),
    ],
    "frozen": [
        ("requests sent", "sent"), ("succeeded", "ok"), ("lost (failed with no answer)", "lost"),
        ("streams cut after their head", "cut"), ("short answers", "short"),
        ("failovers (`vllm_guard_failovers_total`)", "failovers"), ("longest gap between successes, s", "gap"),
        ("SIGSTOP -> engine `hung` in /guard/status, s", "declared"),
        ("requests the gateway placed on it while hung", "placed_out"),
        ("answers from it (x-guard-engine) while hung", "answered_out"), ("/health not 200, samples", "health_not_200"),
        ("output tok/s, both engines", "tps_before"), ("output tok/s, one hung", "tps_out"),
        ("SIGCONT -> `ready` in /guard/status, s", "rejoin_ready"),
        ("SIGCONT -> first request placed on it, s", "rejoin_placed"),
    ],
}
DIGITS = {"gap": 2, "declared": 2, "rejoin_ready": 1, "rejoin_placed": 1}


def failures(runs: Sequence[FaultRun]) -> str:
    """Each failed request's error as the client saw it, counted by run, kind and message."""
    lines = []
    for i, run in enumerate(runs, 1):
        seen = Counter((o.result, "stream" if o.stream else "whole", o.engine, o.detail) for o in run.outcomes
                       if o.result != "ok")
        lines += [f"- run {i}: {n} x {kind} ({how}, engine {engine}): `{detail}`"
                  for (kind, how, engine, detail), n in seen.items()]
    return "\n\nFailed requests:\n" + "\n".join(lines) if lines else ""


def run_faults(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    workload = args.workload
    logs = Path(tempfile.mkdtemp(prefix="engines-bench-"))
    print(f"engines: logs in {logs}", file=sys.stderr)
    started = time.monotonic()
    runs: list[FaultRun] = []
    with two_servers(logs, GATEWAY_ARGS[workload]) as pair:
        version = str(get_json(f"{pair.servers[0].url}/version").get("version", "?"))
        for rep in range(args.repeat):
            warm(pair)
            runs.append(asyncio.run(fault_run(pair, workload, seed=rep)))
            print(f"engines: run {rep + 1} {workload}: {figures(runs[-1], workload)}", file=sys.stderr)
    fault = "SIGKILL to its process group, started again" if workload == "killed" else (
        f"SIGSTOP to its engine core, SIGCONT (gateway --hang-timeout {HANG_TIMEOUT_S:g})")
    report = (
        f"{date.today().isoformat()}: vLLM {version} (CPU build), 2 servers of one 32-block KV cache each behind "
        f"one gateway; {CLIENTS} OpenAI SDK clients (max_retries=0), streamed and whole completions in turn, "
        f"~150 + {MAX_TOKENS} tokens; engine {VICTIM}: {fault} {OUT_S:g} s later; {args.repeat} runs, "
        f"{time.monotonic() - started:.0f} s in all; command: "
        f"`.venv/bin/python bench/engines.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
        f"{figure_table(ROWS[workload], [figures(r, workload) for r in runs], DIGITS)}{failures(runs)}\n"
    )
    print(report)
    if args.out is not None:
        args.out.write_text(report, encoding="utf-8")
    return 0
