"""Crash recovery of managed mode against a real vLLM (CPU build, the tiny model).

    python -m bench run restart [--clients 2] [--kill engine-core|api-server] [--repeat 3]

Each turn measures:

1. vLLM's bare start-up: process start -> ``/health`` and ``/v1/models`` answer 200;
2. the managed gateway's start-up (``vllm-guard serve --managed``) until its ``/health`` answers;
3. under a light load (``--clients``, after 5 s of warm steady load): SIGKILL of the engine (its engine core, or
   its API server) -> the first successful request through the gateway, over the bare start-up;
4. requests lost meanwhile (target 0): clients behave like the OpenAI SDKs, retrying 429/503 after Retry-After,
   so a request is lost only when it ends in any other error or runs out of time.

The first turn is drawn: requests completed per second and each request's latency at the time it was sent, the
kill and the first success marked (the ``bench`` extra, matplotlib; skipped without it).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench.harness import plots
from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.processes import Server, free_port, python
from bench.harness.results import Measure, Result
from bench.harness.target import Target
from bench.targets import engines
from bench.workloads.restart import crash_under_load
from testing.servers import DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_MODEL_LEN, SERVED_MODEL_NAME

SUMMARY = "managed mode: vLLM's bare start-up, the crash -> first success time under load, requests lost"
TARGETS = ["managed"]
DEFAULT_TARGETS = ["managed"]
MEASURES = [
    Measure("bare_startup_s", "vLLM bare start-up s", ".1f", "none"),
    Measure("managed_startup_s", "managed start-up (gateway ready) s", ".1f", "none"),
    Measure("recovery_s", "crash -> first success s", ".1f", "none"),
    Measure("recovery_over_bare", "crash -> first success / bare start-up", ".2f", "none"),
    Measure("engine_startup_s", "of it vLLM's own start-up s", ".1f", "none"),
    Measure("requests", "requests under load", ".0f", "none"),
    Measure("lost", "lost (all runs)", ".0f", "none", "sum"),
    Measure("retried", "503/429 answers retried (all runs)", ".0f", "none", "sum"),
    Measure("restarts", "restarts", ".0f", "none"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients of the light load (2)")
    parser.add_argument("--kill", choices=("engine-core", "api-server"), default="engine-core")
    parser.add_argument("--no-plot", action="store_true", help="draw no picture")


def managed(ctx: Context, turn: int) -> Target:
    model = engines.tiny_model()
    port = free_port()
    argv = [
        *python("gateway.cli", "serve"), "--managed", "--model", str(model), "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--startup-timeout", "600", "--hang-timeout", "60",
        "--drain-timeout", "10", *ctx.args.gateway_arg, "--",
        "--dtype", "float32", "--max-model-len", str(DEFAULT_MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES),
    ]  # fmt: skip
    server = Server(f"managed-{turn}", argv, port, ctx.log_path(f"managed-{turn}"))
    return Target(f"managed-{turn}", "gateway", server, ready_timeout=600,
                  about={"commit": ctx.source["gateway_commit"]})


def timed_start(ctx: Context, target: Target) -> float:
    t0 = time.monotonic()
    ctx.start(target)
    return time.monotonic() - t0


def figures(got: dict[str, Any], bare: float, started: float) -> dict[str, float]:
    rec = got["recovery_seconds"]
    nan = float("nan")
    return {"bare_startup_s": bare, "managed_startup_s": started, "recovery_s": nan if rec is None else rec,
            "recovery_over_bare": nan if rec is None else rec / bare,
            "engine_startup_s": got["engine_startup_seconds"] or nan, "requests": float(got["requests"]),
            "lost": float(got["lost"]), "retried": float(got["retried_503_or_429"]),
            "restarts": float(got["restarts"])}  # fmt: skip


def draw(ctx: Context, got: dict[str, Any]) -> str:
    timeline, rec, which = got["timeline"], got["recovery_seconds"], ctx.args.kill
    killed_at = float(timeline["killed_at"])
    marks = [plots.RequestMark(float(s), float(e), bool(ok), bool(r)) for s, e, ok, r in timeline["requests"]]
    title = (f"Managed mode: SIGKILL of vLLM's {which} under {ctx.args.clients} clients' light load\n"
             f"(vLLM CPU build, tiny model; back after {rec:.1f} s, {got['lost']} requests lost)" if rec is not None
             else f"Managed mode: SIGKILL of vLLM's {which}: no success within 600 s")
    path = ctx.picture("crash")
    plots.restart_figure(path, title, marks, killed_at, None if rec is None else killed_at + float(rec))
    return path.name


def run(ctx: Context) -> Result:
    args = ctx.args
    pictures: list[str] = []
    lost: list[str] = []

    def one(target: str, turn: int) -> dict[str, float]:
        bare_vllm = engines.vllm(ctx, f"bare-vllm-{turn}")
        bare = timed_start(ctx, bare_vllm)
        ctx.stop(bare_vllm.name)
        gateway = managed(ctx, turn)
        started = timed_start(ctx, gateway)
        got = asyncio.run(crash_under_load(gateway.url, args.clients, args.kill))
        ctx.stop(gateway.name)
        lost.extend(f"turn {turn + 1}: {e}" for e in got["lost_examples"])
        if turn == 0 and not args.no_plot and plots.unavailable() is None:
            pictures.append(draw(ctx, got))
        ctx.say(f"killed {got['killed']}; restarts {got['restarts']} ({got['last_restart_reason']})")
        return figures(got, bare, started)

    runs = in_turns(["managed"], args.repeat, one, lambda t, n, f: ctx.say(f"turn {n + 1}: {f}"))
    notes = [f"SIGKILL of vLLM's {args.kill} after 5 s of warm load from {args.clients} clients that retry 429/503 "
             "after Retry-After; every turn starts vLLM bare, then the managed gateway, afresh"]
    extra = "Lost requests:\n\n" + "\n".join(f"- {e}" for e in lost) if lost else ""
    return ctx.result(MEASURES, runs, [], notes=notes, extra_markdown=extra, pictures=pictures)
