"""An engine killed, or frozen, under load: two vLLM servers behind one gateway, steady client load through it,
and one server (engine 1) failed in the middle of each run.

    python -m bench run faults --fault killed [--repeat 3]
    python -m bench run faults --fault frozen

Load: 4 loops of the OpenAI SDK (``max_retries=0``, so a loss shows), each sending one completion after another,
streamed and not in turn, ~150 prompt tokens and 32 output tokens (``ignore_eos``). A watcher reads the gateway's
``/guard/status`` and ``/health`` every 0.1 s. Each server: the tiny model, a 32-block KV cache, its worker on a
core of its own.

- ``killed``: after 12 s of load, SIGKILL to the server's whole process group (API server and engine core); 15 s
  later the same command is started again on the same port; the run ends 3 s after the gateway placed a request
  on it again;
- ``frozen``: the gateway runs with ``--hang-timeout 5``; after 12 s of load, SIGSTOP to the server's engine core
  only (its API server goes on answering ``/health`` and ``/metrics``); SIGCONT 15 s later; the run ends 3 s after
  the gateway placed a request on it again.

An answer succeeded when it carries all 32 tokens. A failed request is *cut* when a stream had its head (200) and
then ended in an error event (a stream in flight on the failed engine: by design never sent again), *lost*
otherwise (an error answer, or no answer at all). Per run: the requests, failovers, the longest gap between
successes, how soon the gateway declared the engine out and took it back, what it placed on it meanwhile,
``/health`` answers other than 200, and tokens/s with both engines and with one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections import Counter

import httpx

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.harness.scrape import get_json
from bench.harness.target import Target
from bench.targets import engines, proxies
from bench.workloads.engine_faults import (
    AFTER_S,
    BEFORE_S,
    CLIENTS,
    GATEWAY_ARGS,
    HANG_TIMEOUT_S,
    MAX_TOKENS,
    OUT_S,
    REJOIN_LIMIT_S,
    VICTIM,
    FaultRun,
    Outcome,
    Sample,
    client_loop,
    figures,
    gateway_failovers,
    placed_again,
    watch,
)

SUMMARY = "one of two engines SIGKILLed (or its engine core frozen) under load: lost requests, failover, rejoin"
TARGETS = ["gateway"]
DEFAULT_TARGETS = ["gateway"]
SERVERS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--fault", choices=sorted(GATEWAY_ARGS), default="killed", help="killed (default), frozen")


def measures(fault: str) -> list[Measure]:
    out = "down" if fault == "killed" else "hung"
    event, heal = ("SIGKILL", "restart") if fault == "killed" else ("SIGSTOP", "SIGCONT")
    rows = [("sent", "requests sent", "sum"), ("ok", "succeeded", "sum"), ("lost", "lost (failed with no answer)",
            "sum"), ("cut", "streams cut after their head", "sum"), ("short", "short answers", "sum"),
            ("failovers", "failovers (vllm_guard_failovers_total)", "sum"),
            ("gap", "longest gap between successes, s", "median"),
            ("declared", f"{event} -> engine `{out}` in /guard/status, s", "median"),
            ("placed_out", f"requests the gateway placed on it while {out}", "sum"),
            ("answered_out", f"answers from it (x-guard-engine) while {out}", "sum"),
            ("health_not_200", "/health not 200, samples", "sum"), ("tps_before", "output tok/s, both engines",
            "median"), ("tps_out", f"output tok/s, one {out}", "median"),
            ("rejoin_ready", f"{heal} -> `ready` in /guard/status, s", "median"),
            ("rejoin_placed", f"{heal} -> first request placed on it, s", "median")]  # fmt: skip
    digits = {"gap": ".2f", "declared": ".2f", "rejoin_ready": ".1f", "rejoin_placed": ".1f", "tps_before": ".0f",
              "tps_out": ".0f"}
    return [Measure(key, label, digits.get(key, ".0f"), "none", agg) for key, label, agg in rows]


async def fault_run(servers: list[Target], gateway: Target, fault: str, seed: int) -> FaultRun:
    base = gateway.url
    stop, stop_watch = asyncio.Event(), asyncio.Event()
    outcomes: list[Outcome] = []
    samples: list[Sample] = []
    failovers = await gateway_failovers(base)
    watcher = asyncio.create_task(watch(base, stop_watch, samples))
    loaded = time.monotonic()
    clients = [asyncio.create_task(client_loop(base, k, seed, stop, outcomes)) for k in range(CLIENTS)]
    victim = servers[VICTIM]
    core: int | None = None
    try:
        await asyncio.sleep(BEFORE_S)
        fault_at = time.monotonic()
        if fault == "killed":
            victim.server.signal(signal.SIGKILL)  # the API server and its engine core: their own process group
            await asyncio.to_thread(victim.server.proc.wait, 30)  # type: ignore[union-attr]
        else:
            core = engines.engine_core_pid(victim)
            os.kill(core, signal.SIGSTOP)
        await asyncio.sleep(fault_at + OUT_S - time.monotonic())
        healed = time.monotonic()
        if core is not None:
            os.kill(core, signal.SIGCONT)
            core = None
        else:
            victim.server.restart()  # the main thread's: asyncio.run runs here
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
    return FaultRun(outcomes, samples, loaded, fault_at, healed, ended, await gateway_failovers(base) - failovers)


def warm(servers: list[Target], gateway: Target) -> None:
    """Each server ready (one started again last run may still be starting), its engine ready in the gateway,
    and one request straight to it: a fresh engine's first step can outlast the hang bound."""
    for s in servers:
        s.server.wait_ready(s.ready_paths, REJOIN_LIMIT_S)
    proxies.wait_engines_ready(gateway, SERVERS)
    for s in servers:
        httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "warm up", "max_tokens": 4},
                   timeout=120).raise_for_status()


def failures(runs: list[FaultRun]) -> str:
    """Each failed request's error as the client saw it, counted by run, kind and message."""
    lines = []
    for i, r in enumerate(runs, 1):
        seen = Counter((o.result, "stream" if o.stream else "whole", o.engine, o.detail) for o in r.outcomes
                       if o.result != "ok")
        lines += [f"- run {i}: {n} x {kind} ({how}, engine {engine}): `{detail}`"
                  for (kind, how, engine, detail), n in seen.items()]
    return "Failed requests:\n\n" + "\n".join(lines) if lines else ""


def run(ctx: Context) -> Result:
    fault = ctx.args.fault
    model = engines.tiny_model()
    servers = [engines.vllm(ctx, f"vllm{i}", model=model, core=i) for i in range(SERVERS)]
    ctx.start(*servers)
    gateway = proxies.gateway(ctx, "gateway", servers, flags=GATEWAY_ARGS[fault])
    ctx.start(gateway)
    proxies.wait_engines_ready(gateway, SERVERS)
    fault_runs: list[FaultRun] = []

    def measure(target: str, turn: int) -> dict[str, float]:
        warm(servers, gateway)
        fault_runs.append(asyncio.run(fault_run(servers, gateway, fault, seed=turn)))
        return {k: float(v) for k, v in figures(fault_runs[-1], fault).items()}

    runs = in_turns(["gateway"], ctx.args.repeat, measure, lambda t, n, f: ctx.say(f"run {n + 1}: {f}"))
    how = ("SIGKILL to its process group, started again" if fault == "killed" else
           f"SIGSTOP to its engine core, SIGCONT (gateway --hang-timeout {HANG_TIMEOUT_S:g})")
    version = get_json(f"{servers[0].url}/version").get("version", "?")
    notes = [f"vLLM {version} (CPU build), 2 servers of one 32-block KV cache each behind one gateway; {CLIENTS} "
             f"OpenAI SDK clients (max_retries=0), streamed and whole completions in turn, ~150 + {MAX_TOKENS} tokens; "
             f"engine {VICTIM}: {how} {OUT_S:g} s later, after {BEFORE_S:g} s of load; counts summed over the runs"]
    return ctx.result(measures(fault), runs, [], notes=notes, extra_markdown=failures(fault_runs))
