"""The rolling benchmark's load: OpenAI SDK clients sending completions (streamed and not, no retries) and a
watcher of ``/health`` through a managed gateway, and one round: ``POST /guard/restart`` after 20 s of steady
load, until the restart ends; what the clients saw during it (``Round``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import openai

from testing.servers import SERVED_MODEL_NAME

KEY, ADMIN = "bench-key", "bench-admin"
MAX_MODEL_LEN = 2048
PROMPT = "A rolling restart keeps one engine serving while the other comes back. " * 6
STEADY_S = 20.0


@dataclass
class Answer:
    at: float
    ok: bool
    engine: str | None
    tokens: int
    error: str | None = None


@dataclass
class Load:
    http: httpx.AsyncClient
    client: openai.AsyncOpenAI
    answers: list[Answer] = field(default_factory=list)
    health: list[tuple[float, int]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def one(self, i: int) -> None:
        stream = i % 2 == 1
        try:
            raw = await self.client.completions.with_raw_response.create(
                model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0, stream=stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            )
            body = raw.parse()
            tokens = 0
            if stream:
                async for chunk in body:  # type: ignore[union-attr]
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            else:
                tokens = body.usage.completion_tokens if body.usage else 0  # type: ignore[union-attr]
            self.answers.append(Answer(time.monotonic(), True, raw.headers.get("x-guard-engine"), tokens))
        except openai.OpenAIError as exc:
            self.answers.append(Answer(time.monotonic(), False, None, 0, f"{type(exc).__name__}: {exc}"[:200]))

    async def loop(self, offset: int) -> None:
        i = offset
        while not self.stop.is_set():
            await self.one(i)
            i += 1

    async def watch(self) -> None:
        while not self.stop.is_set():
            try:
                code = (await self.http.get("/health")).status_code
            except httpx.HTTPError:
                code = 0
            self.health.append((time.monotonic(), code))
            await asyncio.sleep(0.25)


@dataclass
class Round:
    seconds: float
    answered: int
    failed: int
    longest_gap_s: float
    health_not_200: int
    engines: dict[str, int]
    throughput_ratio: float
    errors: list[str]


async def status(http: httpx.AsyncClient) -> dict[str, object]:
    r = await http.get("/guard/status", headers={"Authorization": f"Bearer {KEY}"})
    body: dict[str, object] = r.json()
    return body


def tokens_per_s(answers: list[Answer], start: float, end: float) -> float:
    return sum(a.tokens for a in answers if start <= a.at < end) / max(end - start, 1e-9)


async def one_round(load: Load, http: httpx.AsyncClient, timeout: float) -> Round:
    await asyncio.sleep(STEADY_S)
    t0 = time.monotonic()
    rounds_before = (await status(http))["rolling_restart"]["rounds"]  # type: ignore[index]
    r = await http.post("/guard/restart", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 202, r.text
    while True:
        rolling = (await status(http))["rolling_restart"]
        if rolling["rounds"] > rounds_before and not rolling["in_progress"]:  # type: ignore[index,operator]
            break
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the rolling restart did not end within {timeout:g} s: {rolling}")
        await asyncio.sleep(0.5)
    t1 = time.monotonic()
    during = [a for a in load.answers if t0 <= a.at < t1]
    ok_times = [t0] + [a.at for a in during if a.ok] + [t1]
    return Round(
        seconds=t1 - t0,
        answered=sum(a.ok for a in during),
        failed=sum(not a.ok for a in during),
        longest_gap_s=max(b - a for a, b in itertools.pairwise(ok_times)),
        health_not_200=sum(code != 200 for at, code in load.health if t0 <= at < t1),
        engines=dict(Counter(a.engine or "?" for a in during if a.ok)),
        throughput_ratio=tokens_per_s(load.answers, t0, t1) / max(tokens_per_s(load.answers, t0 - STEADY_S, t0), 1e-9),
        errors=[a.error for a in during if a.error][:3],
    )


async def drive_rounds(url: str, rounds: int, clients: int, timeout: float) -> list[Round]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        load = Load(http, client)
        tasks = [asyncio.create_task(load.loop(i)) for i in range(clients)]
        tasks.append(asyncio.create_task(load.watch()))
        try:
            return [await one_round(load, http, timeout) for _ in range(rounds)]
        finally:
            load.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()
