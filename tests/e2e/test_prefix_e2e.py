"""Prefix sharing on real vLLM (CPU build, prefix caching on as by default, 31 blocks of 128 tokens for requests):
a flood of requests sharing one 1,200-token prefix through a strict gateway runs many at once, books the prefix
once, and vLLM reports zero preemptions; the ids the gateway booked are the ids vLLM cached (its prefix-cache hits
cover the shared blocks of every request but the first)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testing.servers import (
    GATEWAY_READY_PATHS,
    SERVED_MODEL_NAME,
    ServerProcess,
    gateway_server,
    held_at_once,
    scrape_counter,
)

from .conftest import GATEWAY_START_TIMEOUT, _log_dir, _start

pytestmark = pytest.mark.e2e

PREFIX = [(13 * i) % 480 + 10 for i in range(1200)]
FLOOD = 12
BLOCK = 128
SHAREABLE = (1200 + 60 - 1) // BLOCK  # 9 blocks of the prefix are full and shareable


@pytest.fixture(scope="module")
def strict_gateway(
    request: pytest.FixtureRequest, vllm: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = gateway_server(
        vllm.url, _log_dir(tmp_path_factory) / "strict_gateway.log",
        ["--admission-policy", "strict", "--queue-timeout", "300"], name="strict_gateway",
    )
    request.addfinalizer(server.stop)
    _start(request.config, server, GATEWAY_READY_PATHS, GATEWAY_START_TIMEOUT)
    yield server


def body(i: int) -> dict[str, Any]:
    tail = [(97 * i + 7 * j) % 480 + 10 for j in range(60)]
    return {"model": SERVED_MODEL_NAME, "prompt": PREFIX + tail, "max_tokens": 100, "ignore_eos": True}


async def test_a_shared_prefix_flood_through_strict_shares_and_never_preempts(
    vllm: ServerProcess, strict_gateway: ServerProcess
) -> None:
    metrics = f"{vllm.url}/metrics"
    before = {n: scrape_counter(metrics, n) for n in ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total")}
    samples: list[tuple[int, float | None]] = []  # (admitted at once, sharing ratio) as /guard/status showed them
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=300.0, limits=httpx.Limits(max_connections=FLOOD + 2)) as client:

        async def watch() -> None:
            while not done.is_set():
                status = (await client.get(f"{strict_gateway.url}/guard/status")).json()
                samples.append((status["in_flight"], status["prefix_sharing"]["sharing_ratio"]))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        answers = await asyncio.gather(
            *(client.post(f"{strict_gateway.url}/v1/completions", json=body(i), headers={"x-request-id": f"shared-{i}"})
              for i in range(FLOOD))
        )
        done.set()
        await watcher
        final = (await client.get(f"{strict_gateway.url}/guard/status")).json()
    assert [a.status_code for a in answers] == [200] * FLOOD, [a.text for a in answers if a.status_code != 200]
    assert scrape_counter(metrics, "vllm:num_preemptions_total") == before["vllm:num_preemptions_total"]
    hits = scrape_counter(metrics, "vllm:prefix_cache_hits_total") - before["vllm:prefix_cache_hits_total"]
    assert hits >= (FLOOD - 1) * SHAREABLE * BLOCK  # vLLM shared what the gateway booked once
    # The most held at once comes from the gateway's own clock: on a busy machine the whole flood can finish between
    # two samples of /guard/status (it did in CI, every sample before or after it). Unshared, 11-block requests
    # would run two at a time in 31 blocks; booked once, the 9 prefix blocks leave 2 of each request's own.
    peak = max([n for n, _ in samples] + [held_at_once(strict_gateway, [f"shared-{i}" for i in range(FLOOD)])[""]])
    assert peak >= 5
    # Whatever sample did catch five or more admitted shows the prefix booked once: 11k logical blocks over 9 + 2k
    # physical (3.9 at the 11 a quiet machine admits) is above 2 from k = 3 on; checked from 5.
    caught = [(n, ratio) for n, ratio in samples if n >= 5]
    assert all(ratio is not None and ratio > 2.0 for _, ratio in caught), caught
    assert final["committed_blocks"] == 0 and final["prefix_sharing"]["shared_blocks_held"] == 0
