"""What relaying streams costs a proxy: CPU per relayed token, time to first byte, tokens a second.

    python -m bench run relay [--repeat 3] [--seconds 15] [--load 128x200@0.02 --load 256x200@0.01] [--usage final]

The fast fake engine streams one SSE event per token (``--load STREAMSxTOKENS@SECONDS_A_TOKEN``: by default 128
streams of 200 tokens at 20 ms a token, then 256 at 10 ms), usage on every chunk, as the gateway asks vLLM for it;
the engine alone, the gateway and vllm-router relay them. The engine and the client (a raw asyncio client that
counts bytes and event boundaries: ``bench.workloads.streams``) share core 0; each proxy runs alone on core 1
(``--gateway-cpus`` gives it more). Target ``workers`` is this tree's gateway with ``--workers N`` (2) on the
same cores: what the split into processes costs per token. Each slot of the client keeps one stream open at a
time, the first ones spread over one stream's length, for ``--seconds``.

The client asks what ``--usage`` says of usage (``none``, ``final``: the usage chunk at the end, ``continuous``:
on every chunk) when it talks to a gateway, which asks the engine for usage on every chunk and takes out what the
client did not ask for; to the engine alone and to vllm-router, which forward bodies as they are, it asks for usage
on every chunk itself, so that the engine sends every target the same events.

Per target and load: the proxy's CPU per relayed token (its process, every thread and child, from /proc) and the
cores it kept busy, time to first byte (p50, p99), relayed tokens a second, failed streams, and the engine's and
the client's CPU per token (the client must not be what binds: its cores busy are shown).

Target ``floor`` (``bench.servers.floor``) is the least a Python proxy on the gateway's own stack can do per event:
one client write of the bytes of each upstream read, nothing parsed but where the answer ends (asked for usage on
every chunk, as vllm-router is). Target ``floor-asgi`` (``bench.servers.floor_asgi``) is the same proxy served
through uvicorn's ASGI cycle: each upstream read's bytes one ``send`` from the request's task.

Target ``frontend`` is vLLM's own API server (the CPU build on the tiny model, on the engine's core), which
detokenizes and writes each event itself: ``--vllm-load`` streams (16 of 64 tokens, vLLM's own pace, usage on
every chunk as the gateway asks for it) go to it, and the API server process's CPU per token is read (not its
engine core's); for target ``gateway`` the same streams go through a second gateway in front of that vLLM, the
client asking for the final usage: "gateway vs frontend" is the gateway's CPU per relayed token against the API
server's per generated token. Left out, said in the notes, without vLLM installed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from bench.harness.context import Context
from bench.harness.cpu import own_seconds
from bench.harness.pairing import Figures, in_turns
from bench.harness.processes import pinned, python
from bench.harness.results import Measure, Result
from bench.harness.target import Target
from bench.targets import engines, frontend, proxies
from bench.workloads.streams import USAGE_OPTIONS

SUMMARY = "CPU per relayed token, time to first byte and tokens/s of streams: engine alone, gateway, vllm-router"
TARGETS = ["engine", "gateway", "router", "floor", "floor-asgi", "frontend", "workers"]
DEFAULT_TARGETS = ["engine", "gateway", "router", "floor", "frontend"]
# Each target against those before it in this order: the gateway against the engine, the router, the floor...
REFERENCES = ["engine", "router", "floor", "floor-asgi", "frontend", "baseline", "gateway"]
GATEWAY_FLAGS = ("--log-level", "warning", "--max-queue", "10000")


@dataclass(frozen=True)
class Load:
    streams: int
    tokens: int
    token_delay: float

    @property
    def key(self) -> str:
        return f"s{self.streams}"

    @property
    def label(self) -> str:
        return f"{self.streams} x {self.tokens} tokens at {self.token_delay * 1000:g} ms"


def load_spec(text: str) -> Load:
    """``128x200@0.02``: 128 streams of 200 tokens, 20 ms a token."""
    m = re.fullmatch(r"(\d+)x(\d+)@([0-9.]+)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"a load is STREAMSxTOKENS@SECONDS_A_TOKEN (128x200@0.02), got {text!r}")
    return Load(int(m[1]), int(m[2]), float(m[3]))


DEFAULT_LOADS = [Load(128, 200, 0.02), Load(256, 200, 0.01)]
VLLM_MEASURES = [
    Measure("vllm_cpu_us_token", "on vLLM's CPU build: CPU per token of the gateway / of vLLM's API server (us)",
            ".1f"),
    Measure("vllm_tokens_per_s", "on vLLM's CPU build: tokens/s", ".0f"),
    Measure("vllm_failed", "on vLLM's CPU build: failed streams", ".0f", "none"),
]


def vllm_spec(text: str) -> tuple[int, int]:
    """``16x64``: 16 streams of 64 tokens at a time, at vLLM's own pace."""
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"--vllm-load is STREAMSxTOKENS (16x64), got {text!r}")
    return int(m[1]), int(m[2])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(seconds=15.0)
    parser.add_argument("--load", action="append", type=load_spec, default=None,
                        help="STREAMSxTOKENS@SECONDS_A_TOKEN, repeatable (default 128x200@0.02 and 256x200@0.01)")
    parser.add_argument("--workers", type=int, default=2,
                        help="the 'workers' target: the gateway with --workers N on the proxies' cores (2)")
    parser.add_argument("--usage", choices=sorted(USAGE_OPTIONS), default="final",
                        help="what the client asks of usage from a gateway (default final)")
    parser.add_argument("--vllm-load", type=vllm_spec, default=(16, 64),
                        help="STREAMSxTOKENS of the streams on vLLM's CPU build (targets frontend and gateway; 16x64)")


def measures(loads: list[Load]) -> list[Measure]:
    out = []
    for load in loads:
        k, at = load.key, f", {load.label}"
        out += [
            Measure(f"{k}_cpu_us_token", f"target's CPU per relayed token (us){at}", ".1f"),
            Measure(f"{k}_cores", f"target's cores busy{at}", ".2f"),
            Measure(f"{k}_ttfb_p50_ms", f"time to first byte p50 (ms){at}", ".1f", "delta"),
            Measure(f"{k}_ttfb_p99_ms", f"time to first byte p99 (ms){at}", ".1f", "delta"),
            Measure(f"{k}_tokens_per_s", f"relayed tokens/s{at}", ".0f"),
            Measure(f"{k}_failed", f"failed streams{at}", ".0f", "none"),
            Measure(f"{k}_engine_cpu_us_token", f"engine's CPU per token (us){at}", ".1f"),
            Measure(f"{k}_client_cores", f"client's cores busy{at}", ".2f"),
        ]
    return out


def client(ctx: Context, target: Target, load: Load, usage: str, token_delay: bool = True) -> dict[str, Any]:
    """The stream client against ``target``; without ``token_delay`` the engine keeps its own pace (vLLM)."""
    pace = ("--token-delay", f"{load.token_delay:g}") if token_delay else ("--spread", "1", "--any-events")
    argv = [*pinned(ctx.cores.client), *python(
        "bench.workloads.streams", "--url", target.url, "--streams", str(load.streams), "--tokens", str(load.tokens),
        *pace, "--seconds", f"{ctx.args.seconds:g}", "--usage", usage)]
    limit = ctx.args.seconds + load.tokens * load.token_delay * 4 + 120
    done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the stream client failed against {target.name}: {done.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def one_run(ctx: Context, target: Target, engine: Target, load: Load) -> Figures:
    usage = ctx.args.usage if target.kind == "gateway" else "continuous"
    cpu0, eng0, t0 = target.cpu_seconds(), engine.cpu_seconds(), time.monotonic()
    seen = client(ctx, target, load, usage)
    wall = time.monotonic() - t0
    cpu, eng = target.cpu_seconds() - cpu0, engine.cpu_seconds() - eng0
    tokens, k = seen["tokens"], load.key
    per = (lambda s: s * 1e6 / tokens) if tokens else (lambda s: math.nan)
    if seen["failed"]:
        ctx.say(f"{target.name}: {seen['failed']} failed streams: {seen['errors']}")
    time.sleep(1.0)  # the proxy's last releases and access-log lines, outside the next run
    return {
        f"{k}_cpu_us_token": per(cpu), f"{k}_cores": cpu / wall, f"{k}_ttfb_p50_ms": seen["ttfb_p50_ms"],
        f"{k}_ttfb_p99_ms": seen["ttfb_p99_ms"],
        f"{k}_tokens_per_s": tokens / seen["wall_s"] if seen["wall_s"] else math.nan,
        f"{k}_failed": float(seen["failed"]), f"{k}_engine_cpu_us_token": per(eng),
        f"{k}_client_cores": seen["client_cpu_s"] / wall,
    }  # fmt: skip


def vllm_run(ctx: Context, name: str, targets: dict[str, Target]) -> Figures:
    """Streams on vLLM's CPU build: to its API server (target frontend: that process's CPU, not its engine
    core's) or through the gateway in front of it (target gateway: the gateway's CPU)."""
    vllm = targets[frontend.NAME]
    via = vllm if name == frontend.NAME else targets[frontend.GATEWAY]
    streams, tokens = ctx.args.vllm_load

    def cpu() -> float:
        return own_seconds(vllm.pid) if name == frontend.NAME else via.cpu_seconds()

    cpu0 = cpu()
    seen = client(ctx, via, Load(streams, tokens, 0.0), "continuous" if name == frontend.NAME else ctx.args.usage,
                  token_delay=False)
    spent = cpu() - cpu0
    if seen["failed"]:
        ctx.say(f"{name} on vLLM: {seen['failed']} failed streams: {seen['errors']}")
    return {"vllm_cpu_us_token": spent * 1e6 / seen["tokens"] if seen["tokens"] else math.nan,
            "vllm_tokens_per_s": seen["tokens"] / seen["wall_s"] if seen["wall_s"] else math.nan,
            "vllm_failed": float(seen["failed"])}


def run(ctx: Context) -> Result:
    names = ctx.args.targets
    loads = ctx.args.load or DEFAULT_LOADS
    if len({ld.key for ld in loads}) != len(loads):
        raise SystemExit("relay: two loads with the same number of streams")
    engine = engines.fake(ctx, "engine", token_delay=loads[0].token_delay)
    tok = proxies.tokenizer_dir()
    started = [engine]
    if "gateway" in names:
        started.append(proxies.gateway(ctx, "gateway", [engine], flags=GATEWAY_FLAGS, tokenizer=tok))
    if "baseline" in names:
        started.append(proxies.gateway(ctx, "baseline", [engine], flags=GATEWAY_FLAGS, tokenizer=tok,
                                       commit=ctx.args.baseline_commit))
    if "workers" in names:
        started.append(proxies.gateway(ctx, "workers", [engine], flags=(*GATEWAY_FLAGS, "--workers",
                                                                        str(ctx.args.workers)), tokenizer=tok))
    if "router" in names:
        started.append(proxies.router(ctx, "router", [engine]))
    if "floor" in names:
        started.append(proxies.floor(ctx, "floor", [engine]))
    if "floor-asgi" in names:
        started.append(proxies.floor(ctx, "floor-asgi", [engine], asgi=True))
    ctx.start(*started)
    targets = {t.name: t for t in started}
    left_out = frontend.unavailable() if frontend.NAME in names else None
    if frontend.NAME in names:
        targets |= frontend.start(ctx, names, GATEWAY_FLAGS)

    def measure(name: str, turn: int) -> Figures:
        figures: Figures = {}
        if name != frontend.NAME:
            for load in loads:
                figures |= one_run(ctx, targets[name], engine, load)
        if name in ("gateway", frontend.NAME) and frontend.NAME in targets:
            figures |= vllm_run(ctx, name, targets)
        return figures

    def said(name: str, turn: int, f: Figures) -> None:
        ctx.say(f"turn {turn + 1} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in f.items()))

    runs = in_turns(names, ctx.args.repeat, measure, said)
    notes = [f"the client asks a gateway for usage: {ctx.args.usage}; the engine alone, vllm-router and the floor: "
             "on every chunk (the engine's traffic the gateway asks for)",
             f"cores: proxies {ctx.cores.proxy or 'any'}, engine {ctx.cores.engine or 'any'}, client "
             f"{ctx.cores.client or 'any'}; streams started for {ctx.args.seconds:g} s a run"]
    if left_out is not None:
        notes.append(f"target frontend (vLLM's API server) left out: {left_out}")
    if frontend.NAME in targets:
        streams, tokens = ctx.args.vllm_load
        notes.append(f"on vLLM's CPU build (the tiny model, the engine's core): {streams} streams of {tokens} tokens "
                     "at a time at vLLM's pace; frontend: its API server process's CPU (usage on every chunk, as a "
                     "gateway asks); gateway: the gateway's CPU in front of it")
    return ctx.result([*measures(loads), *VLLM_MEASURES], runs, REFERENCES, notes=notes)
