"""Rolling restart under load: ``vllm-guard serve --managed --engine-devices "0;1"`` runs two real vLLM engines
(CPU build, the tiny model, each engine's threads on a core of its own: ``bench/servers/cpu_engine.py``), OpenAI
SDK clients keep sending completions (streamed and not, no SDK retries, so any failure is a lost request), and
``POST /guard/restart`` restarts both engines one at a time, once a turn, ``--repeat`` turns in one session.

    python -m bench run rolling [--repeat 3] [--clients 3]

Per round: the seconds the rolling restart took, requests answered while it ran and those that failed (target
0), the longest gap between two answers (serving never stops), ``/health`` answers other than 200 (target 0: the
gateway is ready while an engine is), the answers of each engine during the round, and output tokens/s during
the round over tokens/s in the 20 s before it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.processes import ROOT, Server, free_port, python
from bench.harness.results import Measure, Result
from bench.harness.target import Target
from bench.targets import engines
from bench.workloads.rolling import ADMIN, KEY, MAX_MODEL_LEN, Round, drive_rounds
from testing.servers import DEFAULT_KV_CACHE_BYTES, SERVED_MODEL_NAME

SUMMARY = "two managed engines restarted one at a time under load: failures, gaps, /health, throughput"
TARGETS = ["managed"]
DEFAULT_TARGETS = ["managed"]

MEASURES = [
    Measure("seconds", "rolling restart s", ".1f", "none"), Measure("answered", "answered during it", ".0f", "none"),
    Measure("failed", "failed during it (all rounds)", ".0f", "none", "sum"),
    Measure("longest_gap_s", "longest gap between answers s", ".2f", "none"),
    Measure("health_not_200", "/health not 200 (all rounds)", ".0f", "none", "sum"),
    Measure("engine_0", "answers from engine 0", ".0f", "none"), Measure("engine_1", "answers from engine 1", ".0f",
                                                                        "none"),
    Measure("throughput_ratio", "output tok/s during it / before it", ".2f", "none"),
]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--clients", type=int, default=3, help="client loops (3)")
    parser.add_argument("--startup-timeout", type=float, default=400.0, help="an engine's start, s (400)")


def managed(ctx: Context, startup_timeout: float) -> Target:
    port = free_port()
    model = engines.tiny_model(MAX_MODEL_LEN)
    argv = [
        *python("gateway.cli", "serve"), "--managed", "--engine-devices", "0;1", "--model", str(model),
        "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        # Each engine's OpenMP threads on a core of its own (bench/servers/cpu_engine.py says why).
        "--vllm-command", f"{sys.executable} {ROOT / 'bench' / 'servers' / 'cpu_engine.py'}",
        "--api-key", KEY, "--admin-api-key", ADMIN, "--startup-timeout", str(startup_timeout),
        "--drain-timeout", "30", "--queue-timeout", "300", *ctx.args.gateway_arg,
        "--", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES),
    ]  # fmt: skip
    server = Server("managed", argv, port, ctx.log_path("managed"))
    return Target("managed", "gateway", server, ready_paths=("/metrics",), ready_timeout=120,
                  about={"flags": argv[3:], "commit": ctx.source["gateway_commit"]})


def wait_both_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = httpx.get(url + "/guard/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
            if body.get("managed_engines") and all(e["state"] == "ready" for e in body["managed_engines"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the two managed engines were not ready within {timeout:g} s")


def figures(r: Round) -> dict[str, float]:
    return {"seconds": r.seconds, "answered": float(r.answered), "failed": float(r.failed),
            "longest_gap_s": r.longest_gap_s, "health_not_200": float(r.health_not_200),
            "engine_0": float(r.engines.get("0", 0)), "engine_1": float(r.engines.get("1", 0)),
            "throughput_ratio": r.throughput_ratio}  # fmt: skip


def run(ctx: Context) -> Result:
    args = ctx.args
    target = managed(ctx, args.startup_timeout)
    ctx.start(target)
    wait_both_ready(target.url, args.startup_timeout)
    # One session of load across every round: the rounds are this benchmark's turns.
    rounds = asyncio.run(drive_rounds(target.url, args.repeat, args.clients, 2 * args.startup_timeout))
    runs = in_turns(["managed"], args.repeat, lambda t, n: figures(rounds[n]),
                    lambda t, n, f: ctx.say(f"round {n + 1}: {f}"))
    errors = [e for r in rounds for e in r.errors]
    extra = "Failures:\n\n" + "\n".join(f"- {e}" for e in errors) if errors else ""
    notes = [f"{args.clients} OpenAI SDK clients (no retries), completions streamed and not; each round after 20 s "
             "of steady load; turns are rounds of one session"]
    return ctx.result(MEASURES, runs, [], notes=notes, extra_markdown=extra)
