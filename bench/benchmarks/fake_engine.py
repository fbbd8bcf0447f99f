"""How fast the fake engine is: what it can answer on one core, so that the proxy benchmarks know their engine side
is not what binds.

    python -m bench run fake-engine [--repeat 3] [--seconds 5]

The fake engine alone on core 0 (``--engine-cpus``), wrk on core 1 (``--client-cpus``): short non-streamed chats
64 at a time, ``GET /health`` 64 at a time, and 256 streams of 200 tokens at 10 ms a token from the relay
benchmark's client. Its CPU per request gives the requests a second one core of it would answer (the measured
rate also depends on wrk and on what else runs on the machine).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess

from bench.harness.context import Context
from bench.harness.pairing import Figures, in_turns
from bench.harness.processes import pinned, python
from bench.harness.results import Measure, Result
from bench.targets import engines
from bench.workloads import wrk

SUMMARY = "the fake engine's own speed on one core: chats/s, /health/s, CPU per chat and per streamed token"
TARGETS = ["engine"]
DEFAULT_TARGETS = ["engine"]

MEASURES = [
    Measure("chats_per_s", "chats/s at 64 concurrent", ".0f"),
    Measure("cpu_us_chat", "CPU per chat (us)", ".1f"),
    Measure("chats_per_core_s", "chats/s one core would answer (1 / CPU per chat)", ".0f"),
    Measure("health_per_s", "/health/s at 64 concurrent", ".0f"),
    Measure("cpu_us_health", "CPU per /health (us)", ".1f"),
    Measure("stream_tokens_per_s", "streamed tokens/s, 256 streams at 10 ms", ".0f"),
    Measure("cpu_us_token", "CPU per streamed token (us)", ".2f"),
    Measure("client_cpu_us_token", "stream client's CPU per token (us)", ".2f"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(seconds=5.0, client_cpus="1")


def streams(ctx: Context, url: str) -> dict[str, float]:
    argv = [*pinned(ctx.cores.client), *python("bench.workloads.streams", "--url", url, "--streams", "256",
                                                "--tokens", "200", "--token-delay", "0.01", "--seconds",
                                                f"{ctx.args.seconds:g}")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=ctx.args.seconds + 180)
    out: dict[str, float] = json.loads(done.stdout)
    return out


def run(ctx: Context) -> Result:
    engine = engines.fake(ctx, "engine", token_delay=0.01, cpus=ctx.cores.engine)
    ctx.start(engine)
    seconds, cores = ctx.args.seconds, ctx.cores.client

    def measure(name: str, turn: int) -> Figures:
        f: Figures = {}
        cpu0 = engine.cpu_seconds()
        chats = wrk.run(engine.url + "/v1/chat/completions", wrk.SHORT_CHAT, 64, seconds, cores)
        cpu1 = engine.cpu_seconds()
        health = wrk.run(engine.url + "/health", None, 64, seconds, cores)
        cpu2 = engine.cpu_seconds()
        seen = streams(ctx, engine.url)
        cpu3 = engine.cpu_seconds()
        f["chats_per_s"], f["health_per_s"] = chats.per_second, health.per_second
        f["cpu_us_chat"] = (cpu1 - cpu0) * 1e6 / max(1, chats.requests)
        f["chats_per_core_s"] = 1e6 / f["cpu_us_chat"] if f["cpu_us_chat"] else math.nan
        f["cpu_us_health"] = (cpu2 - cpu1) * 1e6 / max(1, health.requests)
        tokens = max(1.0, seen["tokens"])
        f["stream_tokens_per_s"] = seen["tokens"] / seen["wall_s"] if seen["wall_s"] else math.nan
        f["cpu_us_token"] = (cpu3 - cpu2) * 1e6 / tokens
        f["client_cpu_us_token"] = seen["client_cpu_s"] * 1e6 / tokens
        return f

    runs = in_turns(["engine"], ctx.args.repeat, measure, lambda n, t, f: ctx.say(f"turn {t + 1}: {f}"))
    notes = [f"the fake engine on cores {ctx.cores.engine or 'any'}, wrk and the stream client on "
             f"{ctx.cores.client or 'any'}; {seconds:g} s a phase"]
    return ctx.result(MEASURES, runs, [], notes=notes)
