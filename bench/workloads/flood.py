"""The flood's workloads and client: builds the workloads, sends one at a target with all requests at once, and
what one run of it saw (``Column``). The flood benchmark's description (``python -m bench run flood --help``)
says how ``early`` requests stop early."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.harness.plots import Timeline
from bench.workloads.realistic import length_body
from testing.payloads import token_ids
from testing.servers import SERVED_MODEL_NAME


@dataclass(frozen=True)
class Planned:
    prompt: list[int]
    max_tokens: int
    # The mean length EOS is biased to end it at (a logit bias on EOS); None: run to max_tokens (ignore_eos).
    true_length: int | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: tuple[Planned, ...]


@dataclass
class Outcome:
    ok: bool
    latency_s: float
    tokens: int
    error: str = ""
    # Whether it ended as planned: at max_tokens, or (early) by EOS before it.
    as_planned: bool = False
    ttft_s: float | None = None  # streamed requests only: until the first chunk with a choice


def build_workloads(names: Sequence[str], n: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[Workload]:
    prompts = [token_ids(prompt_tokens, seed=seed * 1000 + i) for i in range(n)]
    rng = random.Random(seed)
    lengths = [rng.randint(max(1, max_tokens // 40), max(2, max_tokens // 6)) for _ in range(n)]
    table = {
        "full": Workload(
            "full",
            f"{n} concurrent /v1/completions, {prompt_tokens} prompt tokens, max_tokens {max_tokens}, "
            "ignore_eos: every request runs to max_tokens",
            tuple(Planned(p, max_tokens) for p in prompts),
        ),
        "early": Workload(
            "early",
            f"{n} concurrent /v1/completions, {prompt_tokens} prompt tokens, max_tokens {max_tokens}; each "
            f"really ends at EOS, drawn around {min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / n:.0f}), "
            "which nobody can know in advance",
            tuple(Planned(p, max_tokens, t) for p, t in zip(prompts, lengths, strict=True)),
        ),
    }
    return [table[name] for name in names]


async def _one(session: aiohttp.ClientSession, base: str, plan: Planned, eos_id: int, stream: bool) -> Outcome:
    body: dict[str, object] = {"model": SERVED_MODEL_NAME, "prompt": plan.prompt, "max_tokens": plan.max_tokens}
    if stream:
        body.update({"stream": True, "stream_options": {"include_usage": True}})
    if plan.true_length is None:
        body.update({"ignore_eos": True, "temperature": 0.0})
    else:
        # Sampled, EOS biased so that each token ends it with the chance 1 / true_length (a geometric length
        # around it that nobody can know in advance; bench/workloads/realistic.py's length_body).
        body.update(length_body(plan.true_length, eos_id))
    started = time.monotonic()
    try:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Outcome(False, time.monotonic() - started, 0, f"HTTP {resp.status}: {(await resp.text())[:200]}")
            ttft, usage = await _read_stream(resp, started) if stream else (None, (await resp.json())["usage"])
            tokens = int(usage["completion_tokens"])
            # As planned: ran to max_tokens, or (early) ended by EOS before it.
            planned = tokens == plan.max_tokens if plan.true_length is None else tokens < plan.max_tokens
            return Outcome(True, time.monotonic() - started, tokens, as_planned=planned, ttft_s=ttft)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        return Outcome(False, time.monotonic() - started, 0, f"{type(exc).__name__}: {exc}"[:200])


async def _read_stream(resp: aiohttp.ClientResponse, started: float) -> tuple[float | None, dict[str, object]]:
    """Time to the first chunk that carries a choice, and the usage of the last chunk (ValueError if none)."""
    ttft: float | None = None
    usage: dict[str, object] | None = None
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
            raise ValueError(f"error event: {json.dumps(chunk)[:160]}")
        if ttft is None and chunk.get("choices"):
            ttft = time.monotonic() - started
        usage = chunk.get("usage") or usage
    if usage is None:
        raise ValueError("the stream ended without a usage chunk")
    return ttft, usage


async def flood(
    base: str, workload: Workload, eos_id: int, timeout_s: float, stream: bool
) -> tuple[list[Outcome], float]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # No pool limit: the point is that every request arrives at once.
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.monotonic()
        outcomes = await asyncio.gather(*(_one(session, base, p, eos_id, stream) for p in workload.requests))
        return list(outcomes), time.monotonic() - started


PREEMPTIONS = "vllm:num_preemptions_total"
KV_USAGE = "vllm:kv_cache_usage_perc"


def _nearest_rank(ordered: Sequence[float], q: float) -> float | None:
    # Nearest rank: with 12 requests p99 is the slowest one, not an interpolation past it.
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else None


@dataclass
class Column:
    """One run of a workload against one target: what the client saw, what vLLM counted, vLLM's /metrics."""

    target: str
    outcomes: list[Outcome] = field(default_factory=list)
    preemptions: float = 0.0
    # What vLLM really decoded: a client that went away must not leave its request running upstream.
    generated: float = 0.0
    wall_s: float = 0.0
    # vLLM's /metrics during the flood (empty when not sampled), times relative to the flood's start.
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    preemptions_before: float = 0.0

    @property
    def failed(self) -> int:
        return sum(not o.ok for o in self.outcomes)

    def tokens_per_s(self) -> float:
        done = sum(o.tokens for o in self.outcomes if o.ok)
        return done / self.wall_s if self.wall_s > 0 else 0.0

    def latency(self, q: float) -> float | None:
        return _nearest_rank(sorted(o.latency_s for o in self.outcomes if o.ok), q)

    def ttft(self, q: float) -> float | None:
        return _nearest_rank(sorted(o.ttft_s for o in self.outcomes if o.ok and o.ttft_s is not None), q)

    def timeline(self) -> Timeline:
        return Timeline(self.target, [t for t, _ in self.samples], [m[KV_USAGE] for _, m in self.samples],
                        [m[PREEMPTIONS] - self.preemptions_before for _, m in self.samples])

    def as_dict(self, prefix: str) -> dict[str, float]:
        def known(v: float | None) -> float:
            return math.nan if v is None else v

        out = {"preemptions": self.preemptions, "failed": float(self.failed), "tokens_per_s": self.tokens_per_s(),
               "generated": self.generated, "as_planned": float(sum(o.as_planned for o in self.outcomes)),
               "p50_latency_s": known(self.latency(0.5)), "p99_latency_s": known(self.latency(0.99)),
               "p50_ttft_s": known(self.ttft(0.5)), "p99_ttft_s": known(self.ttft(0.99)), "wall_s": self.wall_s}
        return {prefix + k: v for k, v in out.items()}
