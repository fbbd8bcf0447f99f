"""The clients of bench/prefix.py: vLLM's own benchmark client (in-process), and OpenAI SDK workloads that
vLLM's client does not have (multi-turn conversations that re-send their history, ``n > 1`` sampling)."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.servers import SERVED_MODEL_NAME

WORDS = [f"w{i}" for i in range(400)]


def vllm_bench(argv: list[str]) -> dict[str, Any]:
    """Run ``vllm bench serve`` with ``argv`` (the CPU build has no ``vllm`` script) and return its result."""
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser()
    add_cli_args(parser)  # type: ignore[arg-type]
    return dict(main(parser.parse_args(argv)))


@dataclass
class Stats:
    started: float = field(default_factory=time.perf_counter)
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: int = 0
    wall: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    @property
    def mean_ttft_ms(self) -> float:
        return statistics.fmean(self.ttft_ms) if self.ttft_ms else float("nan")

    @property
    def p99_ttft_ms(self) -> float:
        ordered = sorted(self.ttft_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")

    @property
    def mean_tpot_ms(self) -> float:
        return statistics.fmean(self.tpot_ms) if self.tpot_ms else float("nan")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def chat(
    client: AsyncOpenAI, stats: Stats, messages: list[dict[str, str]], max_tokens: int, n: int = 1
) -> str:
    """One streamed chat request run to ``max_tokens``; returns the first choice's text."""
    t0 = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    tokens = 0
    try:
        stream = await client.chat.completions.create(
            model=SERVED_MODEL_NAME, messages=messages, max_tokens=max_tokens, n=n, stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    if choice.index == 0:
                        pieces.append(choice.delta.content)
    except Exception as exc:  # a failed request is counted, the workload goes on
        stats.failed += 1
        if stats.failed == 1:
            print(f"prefix: first failure: {exc}", file=sys.stderr)
        return ""
    end = time.perf_counter()
    stats.tokens += tokens
    if first is not None:
        stats.ttft_ms.append((first - t0) * 1000)
        per_sequence = tokens / n
        if per_sequence > 1:
            stats.tpot_ms.append((end - first) * 1000 / (per_sequence - 1))
    return "".join(pieces)


async def multiturn(base: str, seed: int, conversations: int = 8, turns: int = 4) -> Stats:
    """Conversations that each re-send their history: system prompt, earlier turns, a new question; the
    conversations go at once, each turn after the answer to the one before."""
    rng = random.Random(seed)
    stats = Stats()
    async with AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600) as client:

        async def conversation() -> None:
            # ~550-token system prompt, ~90-token questions, 48-token answers: the fourth turn stays well within
            # the tiny model's 2,048-token context.
            messages = [{"role": "system", "content": text(rng, 150)}]
            for _ in range(turns):
                messages.append({"role": "user", "content": text(rng, 25)})
                answer = await chat(client, stats, messages, 48)
                messages.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(conversation() for _ in range(conversations)))
    stats.wall = time.perf_counter() - stats.started
    return stats


async def n_sampling(base: str, seed: int, requests: int = 6, n: int = 4) -> Stats:
    """Requests that each sample ``n`` answers to one prompt."""
    rng = random.Random(seed)
    stats = Stats()
    async with AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600) as client:
        await asyncio.gather(*(
            chat(client, stats, [{"role": "user", "content": text(rng, 500)}], 120, n=n) for _ in range(requests)
        ))
    stats.wall = time.perf_counter() - stats.started
    return stats


def gateway_refusals(base: str) -> dict[str, float]:
    """The gateway's refusals so far by reason (``vllm_guard_rejections_total``); empty for vLLM itself."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10.0) as resp:
        page = resp.read().decode()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "vllm_guard_rejections_total"
    }
