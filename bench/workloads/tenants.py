"""The tenants benchmark's traffic: a tenant flooding long streamed completions back to back and a quiet one
sending a short one every interval, through one gateway; what each request saw (``Answer``), and a run's figures
for the quiet tenant (``Run``).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from testing.payloads import token_ids
from testing.servers import SERVED_MODEL_NAME

BLOCK_TOKENS = 128
KV_BLOCKS = 33  # the default cache; vLLM keeps one as its null block: 32 for requests
TOKEN_BYTES = 1024  # the tiny model: 2 (K, V) x 1 KV head x 64 dims x 4 bytes x 2 layers
KEYS = {"flood": "bench-flood", "quiet": "bench-quiet"}
ENGINE = "engine"  # the quiet requests sent straight to vLLM (``--engine-floor``), counted apart from both tenants
STATUS_INTERVAL_S = 0.25
GATEWAY_ARGS = ("--queue-timeout", "600", "--max-queue", "1024")


@dataclass(frozen=True)
class Options:
    duration_s: float
    warmup_s: float
    flood_clients: int
    flood_prompt: int
    flood_max_tokens: int
    quiet_prompt: int
    quiet_max_tokens: int
    quiet_interval_s: float
    idle_samples: int
    timeout_s: float
    flood_kv_share: float
    kv_blocks: int = KV_BLOCKS
    engine_floor: bool = False


@dataclass
class Answer:
    tenant: str
    started: float
    finished: float
    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float | None = None
    ttft_s: float | None = None
    error: str = ""


@dataclass
class Run:
    mode: str
    answers: list[Answer]
    window: tuple[float, float]  # while the quiet tenant was sending
    idle_ttft_s: float | None
    tenants: list[dict[str, dict[str, float]]]  # ``/guard/status``'s tenants, read through the window

    def quiet(self) -> list[Answer]:
        return [a for a in self.answers if a.tenant == "quiet" and a.ok]

    def in_window(self) -> list[Answer]:
        start, end = self.window
        return [a for a in self.answers if a.ok and start <= a.finished <= end]

    def figures(self) -> dict[str, float]:
        quiet = self.quiet()
        waits = sorted(a.queue_ms / 1000 for a in quiet if a.queue_ms is not None)
        ttfts = sorted(a.ttft_s for a in quiet if a.ttft_s is not None)
        floor = sorted(a.ttft_s for a in self.answers if a.tenant == ENGINE and a.ok and a.ttft_s is not None)
        served = [a for a in self.in_window() if a.tenant in KEYS]
        tokens = {t: sum(a.prompt_tokens + a.completion_tokens for a in served if a.tenant == t) for t in KEYS}
        total = sum(tokens.values())
        seconds = self.window[1] - self.window[0]
        flood_held = [s["flood"]["held_blocks"] for s in self.tenants if "flood" in s]
        quiet_demand = [s["quiet"]["demand_blocks"] for s in self.tenants if "quiet" in s]
        return {
            "quiet_p50_wait_s": nearest_rank(waits, 0.50), "quiet_p99_wait_s": nearest_rank(waits, 0.99),
            "quiet_p50_ttft_s": nearest_rank(ttfts, 0.50), "quiet_p99_ttft_s": nearest_rank(ttfts, 0.99),
            "floor_p50_ttft_s": nearest_rank(floor, 0.50), "floor_p99_ttft_s": nearest_rank(floor, 0.99),
            "idle_ttft_s": math.nan if self.idle_ttft_s is None else self.idle_ttft_s,
            "flood_share": tokens["flood"] / total if total else math.nan,
            "quiet_share": tokens["quiet"] / total if total else math.nan,
            "tokens_per_s": sum(a.completion_tokens for a in served) / seconds,
            "flood_held_blocks": statistics.mean(flood_held) if flood_held else math.nan,
            "quiet_demand_blocks": max(quiet_demand) if quiet_demand else math.nan,
            "quiet_answered": float(len(quiet)), "failed": float(sum(not a.ok for a in self.answers)),
        }  # fmt: skip


# Each figure of a run and what it says, in the table's order.
LABELS = {
    "quiet_p50_wait_s": "quiet p50 queue wait (s)", "quiet_p99_wait_s": "quiet p99 queue wait (s)",
    "quiet_p50_ttft_s": "quiet p50 TTFT (s)", "quiet_p99_ttft_s": "quiet p99 TTFT (s)",
    "floor_p50_ttft_s": "quiet p50 TTFT straight to vLLM (s)",
    "floor_p99_ttft_s": "quiet p99 TTFT straight to vLLM (s)",
    "idle_ttft_s": "quiet TTFT on an idle engine, p50 (s)", "flood_share": "flood share of tokens served",
    "quiet_share": "quiet share of tokens served", "tokens_per_s": "output tokens/s (both tenants)",
    "flood_held_blocks": "flood blocks held, mean", "quiet_demand_blocks": "quiet demand (blocks), most seen",
    "quiet_answered": "quiet requests answered", "failed": "failed requests",
}  # fmt: skip


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    # Nearest rank: with 30 samples p99 is the slowest one, not an interpolation past it.
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


# -- the clients -------------------------------------------------------------------------------------
async def complete(
    session: aiohttp.ClientSession, base: str, tenant: str, prompt: list[int], max_tokens: int
) -> Answer:
    """One streamed completion as ``tenant`` (``ENGINE``: no key, ``base`` is vLLM's): its queue wait, time to
    first token and usage."""
    body = {
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    headers = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant in KEYS else {}
    started = time.monotonic()
    answer = Answer(tenant, started, started, False)
    try:
        async with session.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                answer.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return answer
            queue_ms = resp.headers.get("x-guard-queue-ms")
            answer.queue_ms = float(queue_ms) if queue_ms is not None else None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise ValueError(f"error event: {json.dumps(chunk)[:160]}")
                if answer.ttft_s is None and chunk.get("choices"):
                    answer.ttft_s = time.monotonic() - started
                if chunk.get("usage"):
                    answer.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                    answer.completion_tokens = int(chunk["usage"]["completion_tokens"])
            answer.ok = answer.completion_tokens > 0
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:200]
    answer.finished = time.monotonic()
    return answer


async def idle_ttft(session: aiohttp.ClientSession, base: str, opts: Options, seed: int) -> float | None:
    """The quiet tenant's median TTFT with nothing else running, one request after another."""
    ttfts: list[float] = []
    for i in range(opts.idle_samples):
        a = await complete(session, base, "quiet", token_ids(opts.quiet_prompt, seed=seed + i), opts.quiet_max_tokens)
        if a.ok and a.ttft_s is not None:
            ttfts.append(a.ttft_s)
    return statistics.median(ttfts) if ttfts else None


async def contend(base: str, mode: str, opts: Options, seed: int, floor_url: str | None = None) -> Run:
    """The flood, and the quiet tenant's trickle once the flood has filled the queue; with ``floor_url`` (vLLM)
    each quiet request is sent there too, half an interval later."""
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        idle = await idle_ttft(session, base, opts, seed * 100_000 + 90_000)
        answers: list[Answer] = []
        stop = asyncio.Event()
        sequence = iter(range(seed * 100_000, seed * 100_000 + 90_000))  # distinct prompts: no prefix shared

        async def flood_client() -> None:
            while not stop.is_set():
                prompt = token_ids(opts.flood_prompt, seed=next(sequence))
                answers.append(await complete(session, base, "flood", prompt, opts.flood_max_tokens))

        async def quiet_one() -> None:
            prompt = token_ids(opts.quiet_prompt, seed=next(sequence))
            answers.append(await complete(session, base, "quiet", prompt, opts.quiet_max_tokens))

        async def straight_one() -> None:
            assert floor_url is not None
            await asyncio.sleep(opts.quiet_interval_s / 2)
            prompt = token_ids(opts.quiet_prompt, seed=next(sequence))
            answers.append(await complete(session, floor_url, ENGINE, prompt, opts.quiet_max_tokens))

        tenants: list[dict[str, dict[str, float]]] = []

        async def watch() -> None:
            headers = {"authorization": f"Bearer {KEYS['quiet']}"}
            while True:
                async with session.get(f"{base}/guard/status", headers=headers) as resp:
                    tenants.append((await resp.json())["tenants"])
                await asyncio.sleep(STATUS_INTERVAL_S)

        flood = [asyncio.create_task(flood_client()) for _ in range(opts.flood_clients)]
        await asyncio.sleep(opts.warmup_s)
        start = time.monotonic()
        watcher = asyncio.create_task(watch())
        trickle: list[asyncio.Task[None]] = []
        while time.monotonic() < start + opts.duration_s:
            trickle.append(asyncio.create_task(quiet_one()))
            if floor_url is not None:
                trickle.append(asyncio.create_task(straight_one()))
            await asyncio.sleep(opts.quiet_interval_s)
        end = time.monotonic()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await asyncio.gather(*trickle)
        stop.set()
        await asyncio.gather(*flood)
    return Run(mode, answers, (start, end), idle, tenants)


def keys_file(path: Path, flood_kv_share: float | None = None) -> Path:
    lines = ["tenants:"]
    for tenant, key in KEYS.items():
        lines += [f"  {tenant}:", "    weight: 1", f"    keys: [{key}]"]
        if tenant == "flood" and flood_kv_share is not None:
            lines.append(f"    limits: {{kv_share: {flood_kv_share}}}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
