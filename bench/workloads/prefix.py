"""The prefix benchmark's workloads: vLLM's own benchmark client (in-process) on shared-prefix datasets, and OpenAI
SDK workloads that vLLM's client does not have (multi-turn conversations that re-send their history, ``n > 1``
sampling). Each returns a ``Run`` of what its client measured."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from testing.servers import SERVED_MODEL_NAME

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


@dataclass
class Run:
    tokens_per_s: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    failed: int
    preemptions: float = 0.0
    hit_rate: float = float("nan")
    shed: float = 0.0  # refused by the forecast, before the deadline (overload)
    timed_out: float = 0.0  # refused after waiting the whole queue timeout (overload)

    def as_dict(self, prefix: str) -> dict[str, float]:
        # tok/s x TPOT: the sequences running at once, on average, as the run's decode saw them; on this CPU the
        # batch, more than anything the gateway does per request, sets the throughput.
        out = {"tokens_per_s": self.tokens_per_s, "mean_ttft_ms": self.mean_ttft_ms, "p99_ttft_ms": self.p99_ttft_ms,
               "mean_tpot_ms": self.mean_tpot_ms, "at_once": self.tokens_per_s * self.mean_tpot_ms / 1000,
               "preemptions": self.preemptions, "hit_rate": self.hit_rate, "failed": float(self.failed),
               "shed": self.shed, "timed_out": self.timed_out}  # fmt: skip
        return {prefix + k: v for k, v in out.items()}


Workload = Callable[[str, Path, int], Run]


def _bench(dataset: list[str], backend: str = "openai") -> Workload:
    def run(base: str, model: Path, seed: int) -> Run:
        endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
        result = vllm_bench([
            "--backend", backend, "--base-url", base, "--endpoint", endpoint, "--model", SERVED_MODEL_NAME,
            "--tokenizer", str(model), "--seed", str(seed), "--request-rate", "inf", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "99", *dataset,
        ])  # fmt: skip
        return Run(float(result["output_throughput"]), float(result["mean_ttft_ms"]), float(result["p99_ttft_ms"]),
                   float(result["mean_tpot_ms"]), int(result.get("failed", 0)))

    return run


def _sdk(fn: Callable[[str, int], Any]) -> Workload:
    def run(base: str, model: Path, seed: int) -> Run:
        stats = asyncio.run(fn(base, seed))
        return Run(stats.tokens_per_s, stats.mean_ttft_ms, stats.p99_ttft_ms, stats.mean_tpot_ms, stats.failed)

    return run


PREFIX_ARGS = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1200",
               "--prefix-repetition-suffix-len", "60", "--prefix-repetition-output-len", "200"]
# After ``_bench``'s own ``--request-rate inf``: argparse keeps the last.
OVERLOAD = _bench(["--dataset-name", "random", "--random-input-len", "700", "--random-output-len", "500",
                   "--random-range-ratio", "0.9", "--num-prompts", "64", "--ignore-eos", "--request-rate", "6"],
                  backend="openai-chat")
WORKLOADS: dict[str, Workload] = {
    "shared": _bench([*PREFIX_ARGS, "--prefix-repetition-num-prefixes", "1", "--num-prompts", "24"]),
    "groups": _bench([*PREFIX_ARGS, "--prefix-repetition-num-prefixes", "4", "--num-prompts", "32"]),
    "chat": _bench(["--dataset-name", "random", "--random-input-len", "900", "--random-output-len", "600",
                    "--num-prompts", "16", "--ignore-eos"], backend="openai-chat"),
    "multiturn": _sdk(multiturn),
    "n4": _sdk(n_sampling),
    "overload": OVERLOAD,  # the gateways' refusals around it are counted by the benchmark
}
