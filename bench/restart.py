"""Crash recovery of managed mode against a real vLLM (CPU build, tiny local model).

Measures, in one run:
  1. vLLM's bare start-up: process start -> /health and /v1/models answer 200;
  2. managed mode under a light load: SIGKILL of the engine -> first successful request through the gateway;
  3. requests lost while that happens (target 0): clients behave like the OpenAI SDKs, retrying 429/503
     after Retry-After, so a request is lost only when it ends in any other error or runs out of time.

Unless ``--no-plot``, it also draws the run (``--plot PATH``, default restart.png in the logs directory):
requests completed per second and each request's latency at the time it was sent, with the kill and the time
to the first success marked. That needs the ``bench`` extra (matplotlib); without it the picture is skipped.

    python bench/restart.py [--clients 2] [--kill engine-core|api-server] [--json] [--plot docs/img/restart.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness.plots import RequestMark, restart_figure, unavailable  # noqa: E402
from tests.e2e.servers import (  # noqa: E402
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    SERVED_MODEL_NAME,
    VENV_BIN,
    VLLM_READY_PATHS,
    ServerProcess,
    ensure_tiny_model,
    free_port,
    get_json,
    vllm_server,
)

PROMPT = "The gateway keeps the engine alive while clients keep asking questions about it. " * 4
REQUEST_DEADLINE = 240.0


@dataclass
class Outcome:
    started: float
    ended: float
    status: int | None
    attempts: int
    error: str | None = None


@dataclass
class Load:
    url: str
    outcomes: list[Outcome] = field(default_factory=list)
    retries_503: int = 0
    stop: bool = False
    # Set once ``warm_after`` requests were answered: the load is steady.
    warm_after: int = 1
    warm: asyncio.Event = field(default_factory=asyncio.Event)

    async def one(self, session: aiohttp.ClientSession) -> Outcome:
        started = time.monotonic()
        attempts = 0
        body = {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
        while True:
            attempts += 1
            try:
                async with session.post(self.url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    if resp.status in (429, 503) and time.monotonic() - started < REQUEST_DEADLINE:
                        # What the OpenAI SDKs do: wait Retry-After (they cap it at 60 s), try again.
                        self.retries_503 += 1
                        wait = float(resp.headers.get("retry-after", "1"))
                        await asyncio.sleep(min(wait, 60.0))
                        continue
                    return Outcome(started, time.monotonic(), resp.status, attempts)
            except (aiohttp.ClientError, TimeoutError) as exc:
                return Outcome(started, time.monotonic(), None, attempts, f"{type(exc).__name__}: {exc}")

    async def client(self, session: aiohttp.ClientSession) -> None:
        while not self.stop:
            self.outcomes.append(await self.one(session))
            if len(self.outcomes) >= self.warm_after:
                self.warm.set()


async def first_success_after(url: str, since: float, timeout: float) -> float | None:
    """Seconds from ``since`` to the first 200 of a fresh request sent every 0.25 s (Retry-After ignored)."""
    body = {"model": SERVED_MODEL_NAME, "prompt": "ping", "max_tokens": 4}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        while time.monotonic() - since < timeout:
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    if resp.status == 200:
                        return time.monotonic() - since
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.25)
    return None


def engine_core_pid(pgid: int) -> int | None:
    """vLLM's engine-core process of the managed group (it names itself VLLM::EngineCore)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and ("EngineCore" in title or "EngineCor" in stat):
            return int(entry.name)
    return None


def kill_target(status: dict[str, Any], which: str) -> int:
    engine = status["engine"]
    if which == "engine-core":
        core = engine_core_pid(int(engine["pgid"]))
        if core is None:
            raise RuntimeError(f"no EngineCore process in the managed group {engine['pgid']}")
        return core
    return int(engine["pid"])


def bare_startup(model: Path, logs: Path) -> float:
    server = vllm_server(model, logs / "bare-vllm.log")
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_ready(VLLM_READY_PATHS, timeout=600)
        return time.monotonic() - t0
    finally:
        server.stop()


def managed_gateway(model: Path, logs: Path) -> ServerProcess:
    script = VENV_BIN / "vllm-guard"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]
    port = free_port()
    argv = [
        *command, "serve", "--managed", "--model", str(model), "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--startup-timeout", "600", "--hang-timeout", "60",
        "--drain-timeout", "10", "--",
        "--dtype", "float32", "--max-model-len", str(DEFAULT_MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES),
    ]  # fmt: skip
    return ServerProcess("managed gateway", argv, port, logs / "managed-gateway.log")


async def steady(load: Load, seconds: float, cap_s: float = 120.0) -> None:
    """Until the load is warm (at most ``cap_s``), then ``seconds`` more: vLLM's first answers are slow, slower
    on a busy host, and a crash among them would measure a cold start, not recovery from steady load."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(load.warm.wait(), cap_s)
    await asyncio.sleep(seconds)


async def crash_under_load(gateway: ServerProcess, clients: int, which: str) -> dict[str, Any]:
    import os
    import signal

    load = Load(gateway.url, warm_after=clients)
    timeout = aiohttp.ClientTimeout(total=REQUEST_DEADLINE + 60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        load_started = time.monotonic()
        tasks = [asyncio.create_task(load.client(session)) for _ in range(clients)]
        await steady(load, 5.0)  # 5 s of warm, steady load before the crash
        before = len(load.outcomes)
        status = await asyncio.to_thread(get_json, gateway.url + "/guard/status")
        victim = kill_target(status, which)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        recovered = await first_success_after(gateway.url, killed_at, timeout=600)
        await asyncio.sleep(5.0)  # and a little steady load after it
        load.stop = True
        await asyncio.gather(*tasks)
    after = await asyncio.to_thread(get_json, gateway.url + "/guard/status")
    lost = [o for o in load.outcomes if o.status != 200]
    return {
        "killed": f"{which} (pid {victim})",
        "recovery_seconds": recovered,
        "requests": len(load.outcomes),
        "requests_before_crash": before,
        "lost": len(lost),
        "lost_examples": [{"status": o.status, "error": o.error} for o in lost[:5]],
        "retried_503_or_429": load.retries_503,
        "restarts": after["engine"]["restarts"],
        "last_restart_reason": after["engine"]["last_restart_reason"],
        "engine_startup_seconds": after["engine"].get("startup_seconds"),
        # Seconds since the load started: the picture's time axis.
        "timeline": {
            "killed_at": killed_at - load_started,
            "requests": [
                [o.started - load_started, o.ended - load_started, o.status == 200, o.attempts > 1]
                for o in load.outcomes
            ],
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=2, help="concurrent clients of the light load")
    p.add_argument("--kill", choices=("engine-core", "api-server"), default="engine-core")
    p.add_argument("--logs", type=Path, default=None, help="directory for the server logs")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--plot", type=Path, default=None, help="where the PNG goes (default: restart.png in the logs)")
    p.add_argument("--no-plot", action="store_true", help="draw no picture")
    args = p.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-restart-"))
    skipped = "--no-plot" if args.no_plot else unavailable()
    model = ensure_tiny_model(DEFAULT_MAX_MODEL_LEN)

    bare = bare_startup(model, logs)
    gateway = managed_gateway(model, logs)
    t0 = time.monotonic()
    gateway.start()
    try:
        gateway.wait_ready(("/health",), timeout=600)
        managed_start = time.monotonic() - t0
        result = asyncio.run(crash_under_load(gateway, args.clients, args.kill))
    finally:
        gateway.stop()
    result |= {"bare_startup_seconds": bare, "managed_startup_seconds": managed_start, "logs": str(logs)}
    rec = result["recovery_seconds"]
    result["recovery_over_bare_startup"] = rec / bare if rec is not None else None
    result["plot"] = None if skipped else str(draw(result, args.plot or logs / "restart.png", args.kill, args.clients))
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=2))  # the picture has it
        return 0
    print(f"vLLM bare start-up:                {bare:6.1f} s")
    print(f"managed start-up (gateway ready):  {managed_start:6.1f} s")
    if rec is None:
        print("crash -> first success:            never (within 600 s)")
    else:
        print(f"crash ({args.kill}) -> first success: {rec:6.1f} s  = {rec / bare:.2f} x bare start-up")
        engine = result["engine_startup_seconds"]
        if engine is not None:
            print(f"  of which vLLM's own start-up:      {engine:6.1f} s; detection, drain, stop and first "
                  f"request: {rec - engine:.1f} s")
    print(f"restarts: {result['restarts']} ({result['last_restart_reason']})")
    print(f"requests under load: {result['requests']}, lost: {result['lost']}, "
          f"503/429 answers retried: {result['retried_503_or_429']}")
    for example in result["lost_examples"]:
        print(f"  lost: {example}")
    print(f"picture: {result['plot'] or f'skipped ({skipped})'}")
    print(f"logs: {logs}")
    return 0 if rec is not None and result["lost"] == 0 and result["restarts"] >= 1 else 1


def draw(result: dict[str, Any], path: Path, which: str, clients: int) -> Path:
    timeline = result["timeline"]
    killed_at = float(timeline["killed_at"])
    rec = result["recovery_seconds"]
    marks = [RequestMark(float(s), float(e), bool(ok), bool(retried)) for s, e, ok, retried in timeline["requests"]]
    title = (
        f"Managed mode: SIGKILL of vLLM's {which} under {clients} clients' light load\n"
        f"(vLLM CPU build, tiny model; back after {rec:.1f} s, {result['lost']} requests lost)"
        if rec is not None
        else f"Managed mode: SIGKILL of vLLM's {which}: no success within 600 s"
    )
    return restart_figure(path, title, marks, killed_at, None if rec is None else killed_at + float(rec))


if __name__ == "__main__":
    sys.exit(main())
