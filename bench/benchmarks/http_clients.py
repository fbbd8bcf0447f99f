"""Which HTTP client should carry a proxy's upstream traffic: the same minimal pass-through with each client.

    python -m bench run http-clients [--seconds 5] [--repeat 3]

``bench.servers.passthrough`` (Starlette on uvicorn + uvloop + httptools) forwards short non-streamed chats to the
fast fake engine with ``aiohttp``, ``httpx`` or ``httpx`` over an aiohttp transport (``httpx-aiohttp``, where
that package is installed). Each pass-through alone on core 1, the engine and wrk on core 0, as in ``overhead``:
added p50 at one request at a time, requests a second and p99 at 64, the pass-through's CPU per request.
"""

from __future__ import annotations

import argparse
import importlib.util

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.processes import Server, free_port, python
from bench.harness.results import Measure, Result
from bench.harness.target import Target
from bench.targets import engines
from bench.workloads import wrk

SUMMARY = "a minimal pass-through with each upstream HTTP client (aiohttp, httpx): latency, req/s, CPU per request"
TARGETS = ["engine", "aiohttp", "httpx", "httpx-aiohttp"]
DEFAULT_TARGETS = ["engine", "aiohttp", "httpx"]
MEASURES = [
    Measure("c1_p50_ms", "one at a time: p50 (ms)", ".3f", "delta"),
    Measure("c64_per_s", "req/s at 64 concurrent", ".0f"),
    Measure("c64_p99_ms", "p99 at 64 concurrent (ms)", ".1f", "delta"),
    Measure("cpu_us_c64", "target's CPU per request, c=64 (us)", ".0f"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(seconds=5.0)


def run(ctx: Context) -> Result:
    names = [t for t in ctx.args.targets if t != "baseline"]
    if "httpx-aiohttp" in names and importlib.util.find_spec("httpx_aiohttp") is None:
        raise SystemExit("http-clients: target httpx-aiohttp needs the httpx-aiohttp package")
    engine = engines.fake(ctx, "engine", token_delay=0.0)
    ctx.start(engine)
    targets: dict[str, Target] = {"engine": engine}
    for kind in names:
        if kind != "engine":
            port = free_port()
            argv = python("bench.servers.passthrough", kind, engine.url + "/v1/chat/completions", str(port))
            server = Server(kind, argv, port, ctx.log_path(kind), cpus=ctx.cores.proxy)
            targets[kind] = Target(kind, "passthrough", server, upstreams=[engine], ready_timeout=60)
    ctx.start(*(t for n, t in targets.items() if n != "engine"))
    seconds, cores = ctx.args.seconds, ctx.cores.client

    def one(name: str, turn: int) -> dict[str, float]:
        url = targets[name].url + "/v1/chat/completions"
        wrk.run(url, wrk.SHORT_CHAT, 8, 1.0, cores)
        c1 = wrk.run(url, wrk.SHORT_CHAT, 1, seconds, cores)
        cpu0 = targets[name].cpu_seconds()
        c64 = wrk.run(url, wrk.SHORT_CHAT, 64, seconds, cores)
        cpu = targets[name].cpu_seconds() - cpu0
        return {"c1_p50_ms": c1.p50_ms, "c64_per_s": c64.per_second, "c64_p99_ms": c64.p99_ms,
                "cpu_us_c64": cpu * 1e6 / max(1, c64.requests)}

    runs = in_turns(list(targets), ctx.args.repeat, one, lambda t, n, f: ctx.say(f"turn {n + 1} {t}: {f}"))
    notes = [f"cores: pass-throughs {ctx.cores.proxy or 'any'}, the fake engine {ctx.cores.engine or 'any'}, wrk "
             f"{cores or 'any'}; {seconds:g} s a phase"]
    return ctx.result(MEASURES, runs, ["engine"], notes=notes)
