"""The restart benchmark's load and crash: clients that behave like the OpenAI SDKs (retrying 429/503 after
Retry-After, so a request is lost only when it ends in any other error or runs out of time) through a managed
gateway, SIGKILL of the engine under that load, and the time to the first success after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.scrape import get_json
from testing.servers import SERVED_MODEL_NAME

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


async def steady(load: Load, seconds: float, cap_s: float = 120.0) -> None:
    """Until the load is warm (at most ``cap_s``), then ``seconds`` more: vLLM's first answers are slow, slower
    on a busy host, and a crash among them would measure a cold start, not recovery from steady load."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(load.warm.wait(), cap_s)
    await asyncio.sleep(seconds)


async def crash_under_load(url: str, clients: int, which: str) -> dict[str, Any]:
    """Warm, steady load from ``clients``, SIGKILL of ``which`` (the engine core or the API server), the time to
    the first success after it, and what the clients saw (times from the load's start, for the picture)."""
    load = Load(url, warm_after=clients)
    timeout = aiohttp.ClientTimeout(total=REQUEST_DEADLINE + 60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        load_started = time.monotonic()
        tasks = [asyncio.create_task(load.client(session)) for _ in range(clients)]
        await steady(load, 5.0)  # 5 s of warm, steady load before the crash
        before = len(load.outcomes)
        status = await asyncio.to_thread(get_json, url + "/guard/status")
        victim = kill_target(status, which)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        recovered = await first_success_after(url, killed_at, timeout=600)
        await asyncio.sleep(5.0)  # and a little steady load after it
        load.stop = True
        await asyncio.gather(*tasks)
    after = await asyncio.to_thread(get_json, url + "/guard/status")
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
