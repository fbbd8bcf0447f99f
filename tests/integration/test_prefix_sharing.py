"""Prefix sharing end to end: floods of requests with one long prefix through the gateway in front of the
simulator, which caches prefixes as vLLM does. With sharing, strict admission runs several times as many requests
at once as without, and the engine still never preempts; the engine's own peak usage stays within its blocks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

BLOCK, ENGINE_BLOCKS = 16, 32
PREFIX = [(7 * i) % 400 + 3 for i in range(160)]  # 10 full blocks
FLOOD = 12
# 160 + 8 prompt + 24 output tokens = 12 blocks, 10 of them shareable: 2 at once unshared, 11 shared.


def body(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PREFIX + [450 + i] * 8, "max_tokens": 24, "ignore_eos": True, **extra}


@contextlib.contextmanager
def rig(tokenizer: Any, tokenizer_dir: Path, settings: Settings, **overrides: Any) -> Iterator[
    tuple[SimServer, GatewayServer]
]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, block_size=BLOCK,
                       num_blocks=ENGINE_BLOCKS, token_delay=0.004, max_model_len=512)
    with run_sim_server(config) as sim, run_gateway(
        settings, upstream=sim.url, admission_policy="strict", kv_target=1.0, queue_timeout=30.0, **overrides
    ) as gw:
        yield sim, gw


async def flood(gw: GatewayServer, bodies: list[dict[str, Any]]) -> tuple[list[httpx.Response], int, float]:
    """Send every body at once; returns the answers, the most requests in flight at once and the best sharing
    ratio /guard/status showed meanwhile."""
    peak, ratio = 0, 0.0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak, ratio
        while not done.is_set():
            status = await asyncio.to_thread(gw.status)
            peak = max(peak, status["in_flight"])
            ratio = max(ratio, status["prefix_sharing"]["sharing_ratio"] or 0.0)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        answers = await asyncio.gather(*(client.post(gw.url + "/v1/completions", json=b) for b in bodies))
    done.set()
    await watcher
    return list(answers), peak, ratio


@pytest.mark.parametrize(
    ("sharing", "least_peak", "most_peak"),
    [("on", 8, FLOOD), ("off", 1, 2)],
    ids=["shared prefix booked once", "every prompt booked whole"],
)
async def test_a_shared_prefix_flood_through_strict_runs_more_at_once_and_never_preempts(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings, sharing: str, least_peak: int, most_peak: int
) -> None:
    with rig(tokenizer, tokenizer_dir, base_settings, prefix_sharing=sharing) as (sim, gw):
        answers, peak, ratio = await flood(gw, [body(i) for i in range(FLOOD)])
        assert [a.status_code for a in answers] == [200] * FLOOD
        assert sim.sim.preemptions_total == 0 and sim.sim.peak_used_blocks <= ENGINE_BLOCKS
        assert least_peak <= peak <= most_peak
        assert (ratio > 3.0) if sharing == "on" else ratio == pytest.approx(1.0)
        status = await asyncio.to_thread(gw.status)
        assert status["committed_blocks"] == 0 and status["prefix_sharing"]["shared_blocks_held"] == 0
        if sharing == "on":
            assert sim.sim.prefix_cache_hits_total >= (FLOOD - 1) * 10 * BLOCK  # the engine shared them too


async def test_prompt_logprobs_and_other_salts_are_booked_whole(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings
) -> None:
    """vLLM does not read the cache for a request that asks for prompt logprobs, and a cache_salt keys its blocks
    apart: neither may count on the prefix the others hold."""
    with rig(tokenizer, tokenizer_dir, base_settings, prefix_sharing="on") as (sim, gw):
        bodies = [body(0), body(1, prompt_logprobs=1), body(2, echo=True, logprobs=1), body(3, cache_salt="tenant-b")]
        answers, _, _ = await flood(gw, bodies)
        assert [a.status_code for a in answers] == [200] * 4
        assert sim.sim.preemptions_total == 0
