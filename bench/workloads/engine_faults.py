"""The faults benchmark's load, watcher and accounting: steady client load through a gateway over two vLLM
servers while one (engine 1) fails in the middle of each run, and the run's figures from what the clients saw
and what the gateway said of its engines.

Load: ``CLIENTS`` loops of the OpenAI SDK (``max_retries=0``, so a loss shows), each sending one completion after
another, streamed and not in turn, ~150 prompt tokens and ``MAX_TOKENS`` output tokens (``ignore_eos``). A watcher
reads the gateway's ``/guard/status`` and ``/health`` every ``WATCH_S``.

- ``killed``: after ``BEFORE_S`` of load, SIGKILL to the server's whole process group (API server and engine
  core); ``OUT_S`` later the same command is started again on the same port; the run ends ``AFTER_S`` after the
  gateway placed a request on it again.
- ``frozen``: the gateway runs with ``--hang-timeout HANG_TIMEOUT_S``; after ``BEFORE_S`` of load, SIGSTOP to the
  server's engine core only (its API server goes on answering ``/health`` and ``/metrics``); SIGCONT ``OUT_S``
  later; the run ends ``AFTER_S`` after the gateway placed a request on it again.

An answer counts as succeeded when it carries all ``MAX_TOKENS`` tokens. A failed request is *cut* when a stream
had its head (200) and then ended in an error event (a stream in flight on the failed engine: by design never sent
again), *lost* otherwise (an error answer, or no answer at all).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from openai import AsyncOpenAI

from bench.harness.scrape import metric_sum
from testing.servers import SERVED_MODEL_NAME

CLIENTS = 4
MAX_TOKENS = 32
PROMPT_WORDS = 60
IGNORE_EOS = {"ignore_eos": True}  # every answer runs to MAX_TOKENS, so a shorter one is a fault
VICTIM = 1  # the engine failed in each run: not the first, whose tokenizer counts
BEFORE_S = 12.0
OUT_S = 15.0
AFTER_S = 3.0
REJOIN_LIMIT_S = 300.0  # a killed server starts again under load on a small CPU box
HANG_TIMEOUT_S = 5.0
WATCH_S = 0.1
GATEWAY_ARGS = {"killed": ("--queue-timeout", "60"),
                "frozen": ("--queue-timeout", "60", "--hang-timeout", f"{HANG_TIMEOUT_S:g}")}
DECLARED = {"killed": "down", "frozen": "hung"}
FAILOVERS = "vllm_guard_failovers_total"


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it; times are ``time.monotonic()``."""

    started: float
    ended: float
    stream: bool
    engine: str | None  # the answer's x-guard-engine
    result: str  # ok | cut | lost | short
    detail: str = ""


@dataclass(frozen=True)
class Sample:
    """One look at the gateway: each engine's state and admissions, and its /health status."""

    at: float
    states: tuple[str, ...]
    admitted: tuple[int, ...]
    health: int


@dataclass
class FaultRun:
    outcomes: list[Outcome]
    samples: list[Sample]
    loaded: float  # load began
    fault: float  # SIGKILL or SIGSTOP
    healed: float  # restart or SIGCONT
    ended: float
    failovers: float


# -- accounting (pure) -------------------------------------------------------------------------------
def longest_gap(ends: Sequence[float], start: float, stop: float) -> tuple[float, float]:
    """The longest time without a success in [start, stop] and where it began: the gaps between consecutive
    success times, the one before the first and the one after the last included."""
    points = [start, *sorted(t for t in ends if start <= t <= stop), stop]
    return max(((b - a, a) for a, b in itertools.pairwise(points)), key=lambda gap: gap[0])


def first_at(samples: Sequence[Sample], after: float, holds: Callable[[Sample], bool]) -> float | None:
    """When the first sample taken at or after ``after`` for which ``holds`` is true was taken."""
    return next((s.at for s in samples if s.at >= after and holds(s)), None)


def admitted_at(samples: Sequence[Sample], engine: int, at: float) -> int:
    """The engine's admissions in the last sample taken at or before ``at`` (0 before the first)."""
    return max((s.admitted[engine] for s in samples if s.at <= at), default=0)


def tokens_per_s(outcomes: Sequence[Outcome], start: float, stop: float) -> float:
    done = sum(1 for o in outcomes if o.result == "ok" and start <= o.ended < stop)
    return done * MAX_TOKENS / (stop - start) if stop > start else math.nan


def figures(run: FaultRun, workload: str, victim: int = VICTIM) -> dict[str, float]:
    """One run's figures by name (NaN where an event never came); times in seconds from the event."""
    out = Counter(o.result for o in run.outcomes)
    state = DECLARED[workload]
    declared = first_at(run.samples, run.fault, lambda s: s.states[victim] == state)
    ready = first_at(run.samples, run.healed, lambda s: s.states[victim] == "ready")
    healed_with = admitted_at(run.samples, victim, run.healed)
    placed = first_at(run.samples, run.healed, lambda s: s.admitted[victim] > healed_with)
    out_from = declared if declared is not None else run.healed
    answered_while_out = sum(1 for o in run.outcomes if o.engine == str(victim) and out_from <= o.started < run.healed)
    gap, _ = longest_gap([o.ended for o in run.outcomes if o.result == "ok"], run.loaded, run.ended)
    return {
        "sent": len(run.outcomes), "ok": out["ok"], "lost": out["lost"], "cut": out["cut"], "short": out["short"],
        "failovers": run.failovers, "gap": gap,
        "declared": declared - run.fault if declared is not None else math.nan,
        "placed_out": healed_with - admitted_at(run.samples, victim, out_from) if declared is not None else math.nan,
        "answered_out": answered_while_out,
        "health_not_200": sum(1 for s in run.samples if s.health != 200),
        "tps_before": tokens_per_s(run.outcomes, run.loaded, run.fault),
        "tps_out": tokens_per_s(run.outcomes, out_from, run.healed),
        "rejoin_ready": ready - run.healed if ready is not None else math.nan,
        "rejoin_placed": placed - run.healed if placed is not None else math.nan,
    }


# -- load and watch ----------------------------------------------------------------------------------
async def one_request(client: AsyncOpenAI, prompt: str, stream: bool) -> Outcome:
    started = time.monotonic()
    engine: str | None = None
    headed = False
    tokens = 0
    try:
        if stream:
            async with client.completions.with_streaming_response.create(
                model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=IGNORE_EOS, stream=True,
                stream_options={"include_usage": True},
            ) as raw:
                engine, headed = raw.headers.get("x-guard-engine"), True
                async for chunk in await raw.parse():
                    tokens = chunk.usage.completion_tokens if chunk.usage is not None else tokens
        else:
            answer = await client.completions.with_raw_response.create(
                model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=IGNORE_EOS
            )
            engine = answer.headers.get("x-guard-engine")
            usage = answer.parse().usage
            tokens = usage.completion_tokens if usage is not None else 0
    except Exception as exc:  # every failure is counted, by how it showed
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        return Outcome(started, time.monotonic(), stream, engine, "cut" if headed else "lost", detail)
    result = "ok" if tokens == MAX_TOKENS else "short"
    return Outcome(started, time.monotonic(), stream, engine, result, f"{tokens} tokens" if result == "short" else "")


async def client_loop(base: str, k: int, seed: int, stop: asyncio.Event, outcomes: list[Outcome]) -> None:
    rng = random.Random(seed * 100 + k)
    async with AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120) as client:
        i = 0
        while not stop.is_set():
            # A fresh prompt each time: no prefix is shared, so placement goes by headroom over both engines.
            prompt = " ".join(f"w{rng.randrange(400)}" for _ in range(PROMPT_WORDS))
            outcomes.append(await one_request(client, prompt, stream=(i + k) % 2 == 0))
            i += 1


async def watch(base: str, stop: asyncio.Event, samples: list[Sample]) -> None:
    async with httpx.AsyncClient(timeout=5.0) as http:
        while not stop.is_set():
            try:
                rows = (await http.get(f"{base}/guard/status")).json()["engines"]
                health = (await http.get(f"{base}/health")).status_code
            except httpx.HTTPError:
                health, rows = 0, None
            if rows is not None:
                at = time.monotonic()
                samples.append(Sample(at, tuple(r["state"] for r in rows), tuple(r["admitted_total"] for r in rows),
                                      health))
            await asyncio.sleep(WATCH_S)


async def gateway_failovers(base: str) -> float:
    async with httpx.AsyncClient(timeout=10.0) as http:
        return metric_sum((await http.get(f"{base}/metrics")).text, FAILOVERS)


async def placed_again(samples: list[Sample], healed: float, limit_s: float) -> None:
    """Until the gateway places a request on the victim after ``healed``, or ``limit_s`` passed."""
    with_then = admitted_at(samples, VICTIM, healed)
    while time.monotonic() - healed < limit_s:
        if first_at(samples, healed, lambda s: s.admitted[VICTIM] > with_then) is not None:
            return
        await asyncio.sleep(0.2)
