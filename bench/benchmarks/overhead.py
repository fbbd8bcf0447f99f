"""What a proxy adds to short requests: the engine alone, the gateway and vllm-router on the same cores and traffic.

    python -m bench run overhead [--repeat 3] [--seconds 5] [--baseline-commit SHA] [--gateway-arg=--workers=2]
    python -m bench run overhead --target gateway --target frontend --phase vllm --repeat 1

The fast fake engine (``bench.servers.fake_engine``: answers at once) and the load generator (wrk, one thread)
share core 0; each proxy runs alone on core 1 (``--gateway-cpus`` gives it more). Per turn, each phase runs
against every target in a rotating order:

- ``c=1``: one short non-streamed chat at a time (a system prompt and a numbered one-word question, ``max_tokens``
  1): p50 and p99 latency, what the proxy adds to the engine alone's;
- ``c=64``: the same chats 64 at a time: chats a second and p99;
- ``health``: ``GET /health`` one at a time: p50;
- ``streams``: streams of 20 tokens with no delay between them, 16 at a time: streams a second.

Each target's CPU per request (its process and children, every thread, from /proc) and the engine's; the load
generator's own CPU. Target ``workers`` is this tree's gateway with ``--workers N`` (``--workers``, 2) on the same
core(s) as the others: the coordination's cost, not more cores. Target ``page`` is the gateway measured again
with its live page open (``/guard/ui/data`` polled once a second, as an open page does); ``--engine simulator``
puts the test suite's vLLM simulator behind the proxies instead of the fake engine (slower: its own CPU then
binds first on the shared core).

Target ``floor`` (``bench.servers.floor``) is the least a Python proxy on the gateway's own stack (uvloop, an
asyncio protocol, httptools) can do: parse the request, forward it on a pooled connection, hand the answer back byte
for byte. What the gateway spends above it is its own work; what it spends above vllm-router is the language's and
the event loop's price for the same bytes. Target ``floor-count`` is the same proxy with the one piece of a guard's
work no design avoids: each chat parsed and its prompt's ids counted by the gateway's own counter (its template
rendered, its text tokenized), inline: what a lean guard would cost before admission and bookkeeping. Target
``floor-asgi`` (``bench.servers.floor_asgi``) is the floor served through uvicorn's request-response cycle, as the
gateway's server runs (the body read through ``receive``, the answer handed to ``send``): against ``floor``, the
price of the ASGI cycle alone.

Target ``frontend`` is vLLM's own API server (the CPU build on the tiny model, on the engine's core), which renders
the chat template and counts the prompt as the gateway does: phase ``vllm`` sends it the short chats
(``max_tokens`` 1) 16 at a time and reads the API server process's CPU per chat (its threads, not the engine
core's process); for target ``gateway`` the same phase sends the same chats through a second gateway in front of
that vLLM, so that the table's "gateway vs frontend" is the gateway's CPU per chat against the API server's on
the same chats. Without vLLM installed (``pip install -e .[cpu]``) the target is left out, said in the notes.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from bench.harness.context import Context
from bench.harness.cpu import own_seconds
from bench.harness.pairing import Figures, in_turns
from bench.harness.results import Measure, Result
from bench.harness.target import Target
from bench.targets import engines, frontend, proxies
from bench.workloads import wrk
from bench.workloads.streams import stream_body

SUMMARY = "added latency, chats/s at 64 concurrent, /health, CPU per request: engine alone, gateway, vllm-router"
TARGETS = ["engine", "gateway", "router", "floor", "floor-asgi", "floor-count", "frontend", "page", "workers"]
DEFAULT_TARGETS = ["engine", "gateway", "router", "floor", "floor-count", "frontend"]
# Each target against those before it in this order: the gateway against the engine, the router, the floor...
REFERENCES = ["engine", "router", "floor", "floor-asgi", "floor-count", "frontend", "baseline", "gateway"]
GATEWAY_FLAGS = ("--log-level", "warning", "--max-queue", "10000")
PHASES = ("c1", "c64", "health", "streams", "vllm")
VLLM_CONNECTIONS = 16
# Phase vllm runs against these targets only (the gateway through its second instance, in front of vLLM).
VLLM_TARGETS = ("gateway", "frontend")

MEASURES = [
    Measure("c1_p50_ms", "one chat at a time: p50 (ms)", ".3f", "delta"),
    Measure("c1_p99_ms", "one chat at a time: p99 (ms)", ".3f", "delta"),
    Measure("c64_per_s", "chats/s at 64 concurrent", ".0f"),
    Measure("c64_p50_ms", "p50 at 64 concurrent (ms)", ".1f", "delta"),
    Measure("c64_p99_ms", "p99 at 64 concurrent (ms)", ".1f", "delta"),
    Measure("c64_max_ms", "the slowest at 64 concurrent (ms): 64 new connections at once", ".1f", "delta"),
    Measure("health_p50_ms", "/health one at a time: p50 (ms)", ".3f", "delta"),
    Measure("streams_per_s", "streams/s (20 tokens, 16 concurrent)", ".0f"),
    Measure("cpu_us_c1", "target's CPU per chat, c=1 (us)", ".0f"),
    Measure("cpu_us_c64", "target's CPU per chat, c=64 (us)", ".0f"),
    Measure("engine_cpu_us_c64", "engine's CPU per chat, c=64 (us)", ".0f"),
    Measure("cpu_us_stream", "target's CPU per stream (us)", ".0f"),
    Measure("client_cpu_us_c64", "wrk's CPU per chat, c=64 (us)", ".1f"),
    Measure("vllm_cpu_us", "on vLLM's CPU build, 16 chats at a time: CPU per chat of the gateway / of vLLM's API "
            "server process (us)", ".0f"),
    Measure("vllm_per_s", "on vLLM's CPU build, 16 at a time: chats/s", ".0f"),
    Measure("vllm_engine_cpu_us", "on vLLM's CPU build: its engine core process's CPU per chat (us)", ".0f"),
    Measure("errors", "errors (non-2xx, socket)", ".0f", "none"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(seconds=5.0)
    parser.add_argument("--engine", choices=("fake", "simulator"), default="fake",
                        help="the engine behind every target (default: the fast fake engine)")
    parser.add_argument("--workers", type=int, default=2,
                        help="the 'workers' target: the gateway with --workers N on the proxies' cores (2)")
    parser.add_argument("--phase", action="append", choices=PHASES, default=None, help="repeatable; default all")
    parser.add_argument("--vllm-seconds", type=float, default=None,
                        help="how long phase vllm sends (default --seconds; vLLM's CPU build answers some 50 a second)")


def start_targets(ctx: Context, names: list[str]) -> dict[str, Target]:
    args = ctx.args
    if args.engine == "fake":
        engine = engines.fake(ctx, "engine", token_delay=0.0)
    else:
        engine = engines.simulator(ctx, "engine", cpus=ctx.cores.engine)
    tok = proxies.tokenizer_dir()
    started = [engine]
    if {"gateway", "page"} & set(names):
        started.append(proxies.gateway(ctx, "gateway", [engine], flags=GATEWAY_FLAGS, tokenizer=tok))
    if "baseline" in names:
        started.append(proxies.gateway(ctx, "baseline", [engine], flags=GATEWAY_FLAGS, tokenizer=tok,
                                       commit=args.baseline_commit))
    if "workers" in names:
        started.append(proxies.gateway(ctx, "workers", [engine], flags=(*GATEWAY_FLAGS, "--workers", str(args.workers)),
                                       tokenizer=tok))
    if "router" in names:
        started.append(proxies.router(ctx, "router", [engine]))
    if "floor" in names:
        started.append(proxies.floor(ctx, "floor", [engine]))
    if "floor-asgi" in names:
        started.append(proxies.floor(ctx, "floor-asgi", [engine], asgi=True))
    if "floor-count" in names:
        started.append(proxies.floor(ctx, "floor-count", [engine], count=tok))
    ctx.start(*started)
    by_name = {t.name: t for t in started}
    if "frontend" in names:
        if (why := frontend.unavailable()) is not None:
            ctx.say(f"target frontend left out: {why}")
            ctx.args.frontend_left_out = why
        by_name |= frontend.start(ctx, names, GATEWAY_FLAGS)
    if "page" in names:
        by_name["page"] = by_name["gateway"]
    return by_name


@contextmanager
def page_open(url: str, stop_after_s: float = 600.0) -> Iterator[list[float]]:
    """Polls ``/guard/ui/data`` once a second in a thread, asking only for new samples, as the page does; yields
    the sampler's reported cost per one-second sample (ms)."""
    import httpx

    sampler_ms: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        last = 0
        with httpx.Client(timeout=5) as client:
            deadline = time.monotonic() + stop_after_s
            while not stop.is_set() and time.monotonic() < deadline:
                body = client.get(url + "/guard/ui/data", params={"since": last} if last else None).json()
                last = body["last_id"]
                if body.get("sampler_ms") is not None:
                    sampler_ms.append(body["sampler_ms"])
                stop.wait(1.0)

    thread = threading.Thread(target=poll, name="page-poll", daemon=True)
    thread.start()
    try:
        yield sampler_ms
    finally:
        stop.set()
        thread.join(10)


def vllm_phase(ctx: Context, name: str, targets: dict[str, Target]) -> Figures:
    """The short chats, 16 at a time, to vLLM's API server (target ``frontend``: that process's own CPU, not its
    engine core's) or through the gateway in front of it (target ``gateway``: the gateway's CPU)."""
    from bench.targets.engines import engine_core_pid

    vllm = targets[frontend.NAME]
    via = vllm if name == frontend.NAME else targets[frontend.GATEWAY]
    core = engine_core_pid(vllm)

    def cpu() -> float:
        return own_seconds(vllm.pid) if name == "frontend" else via.cpu_seconds()

    cpu0, core0 = cpu(), own_seconds(core)
    done = wrk.run(via.url + "/v1/chat/completions", wrk.SHORT_CHAT, VLLM_CONNECTIONS,
                   ctx.args.vllm_seconds or ctx.args.seconds, ctx.cores.client)
    spent, core_spent = cpu() - cpu0, own_seconds(core) - core0
    per = (lambda s: s * 1e6 / done.requests) if done.requests else (lambda s: math.nan)
    return {"vllm_cpu_us": per(spent), "vllm_per_s": done.per_second, "vllm_engine_cpu_us": per(core_spent),
            "errors": float(done.errors)}


def phase(ctx: Context, name: str, target: Target, engine: Target, page: bool) -> Figures:
    """One phase against one target: wrk for its seconds, the target's and the engine's CPU over it."""
    seconds, cores = ctx.args.seconds, ctx.cores.client
    url = target.url
    runs: dict[str, tuple[str, dict[str, Any] | None, int]] = {
        "c1": (url + "/v1/chat/completions", wrk.SHORT_CHAT, 1),
        "c64": (url + "/v1/chat/completions", wrk.SHORT_CHAT, 64),
        "health": (url + "/health", None, 1),
        "streams": (url + "/v1/chat/completions", stream_body(20, "none", 0.0), 16),
    }
    where, body, connections = runs[name]
    cpu0, eng0 = target.cpu_seconds(), engine.cpu_seconds()
    with page_open(url) if page else nullcontext():
        done = wrk.run(where, body, connections, seconds, cores)
    cpu, eng = target.cpu_seconds() - cpu0, engine.cpu_seconds() - eng0
    per = (lambda s: s * 1e6 / done.requests) if done.requests else (lambda s: math.nan)
    out: Figures = {"errors": float(done.errors)}
    if name == "c1":
        out |= {"c1_p50_ms": done.p50_ms, "c1_p99_ms": done.p99_ms, "cpu_us_c1": per(cpu)}
    elif name == "c64":
        out |= {"c64_per_s": done.per_second, "c64_p50_ms": done.p50_ms, "c64_p99_ms": done.p99_ms,
                "c64_max_ms": done.max_ms, "cpu_us_c64": per(cpu),
                "engine_cpu_us_c64": per(eng), "client_cpu_us_c64": per(done.cpu_s)}
    elif name == "health":
        out |= {"health_p50_ms": done.p50_ms}
    else:
        out |= {"streams_per_s": done.per_second, "cpu_us_stream": per(cpu)}
    return out


def run(ctx: Context) -> Result:
    names = ctx.args.targets
    targets = start_targets(ctx, names)
    engine = targets["engine"]
    phases = ctx.args.phase or list(PHASES)
    vllm = [frontend.GATEWAY, frontend.NAME] if frontend.NAME in names else []
    warm = [n for n in names if n != frontend.NAME] + vllm
    for name in warm:  # warm-up: connections, caches, lazy imports (vLLM's first requests are slow)
        if name in targets:
            wrk.run(targets[name].url + "/v1/chat/completions", wrk.SHORT_CHAT, 4, 1.0, ctx.cores.client)

    def measure(name: str, turn: int) -> Figures:
        figures: Figures = {}
        for ph in phases:
            if ph == "vllm":
                if name not in VLLM_TARGETS or "frontend" not in targets:
                    continue
                got = vllm_phase(ctx, name, targets)
            elif name == "frontend":
                continue  # vLLM's CPU build is measured by phase vllm only
            else:
                got = phase(ctx, ph, targets[name], engine, page=name == "page")
            figures |= {k: v for k, v in got.items() if k != "errors"}
            figures["errors"] = figures.get("errors", 0.0) + got["errors"]
        return figures

    def said(name: str, turn: int, f: Figures) -> None:
        ctx.say(f"turn {turn + 1} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in f.items()))

    runs = in_turns(names, ctx.args.repeat, measure, said)
    notes = [f"targets: {describe(targets, names)}",
             f"cores: proxies {ctx.cores.proxy or 'any'}, engine {ctx.cores.engine or 'any'}, wrk "
             f"{ctx.cores.client or 'any'}; {ctx.args.seconds:g} s a phase"]  # fmt: skip
    if getattr(ctx.args, "frontend_left_out", None):
        notes.append(f"target frontend (vLLM's API server) left out: {ctx.args.frontend_left_out}")
    if "frontend" in targets and "vllm" in phases:
        notes.append("phase vllm: vLLM's CPU build on the tiny model, on the engine's core(s); the short chats "
                     f"(max_tokens 1) {VLLM_CONNECTIONS} at a time for {ctx.args.vllm_seconds or ctx.args.seconds:g} "
                     "s, to vLLM's API server (frontend: that process's CPU, not its engine core's) and through a "
                     "second gateway in front of it (gateway: the gateway's CPU); gateway vs frontend is the ratio")
    return ctx.result(MEASURES, runs, REFERENCES, notes=notes)


def describe(targets: dict[str, Target], names: list[str]) -> str:
    words = {"engine": "the fake engine alone" if targets["engine"].kind == "fake" else "the simulator alone",
             "gateway": "vllm-guard of this tree", "baseline": "vllm-guard at the baseline commit",
             "router": f"vllm-router {proxies.ROUTER_VERSION}",
             "floor": "the floor: a minimal Python proxy on the gateway's stack (bench/servers/floor.py)",
             "floor-asgi": "the floor served through uvicorn's ASGI cycle (bench/servers/floor_asgi.py)",
             "floor-count": "the floor with each chat parsed and its prompt's ids counted by the gateway's counter",
             "page": "the gateway with its live page open",
             "workers": "vllm-guard of this tree with --workers N (the proxies' cores shared)",
             "frontend": "vLLM's own API server (CPU build, tiny model): phase vllm only"}
    return "; ".join(f"{n}: {words.get(n, n)}" for n in names)
