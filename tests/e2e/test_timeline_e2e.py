"""Time-aware booking on real vLLM (CPU build, 31 blocks of 128 tokens for requests): a flood of streamed requests
through strict with ``--time-aware on`` holds more of them at once than the books allow (a request admitted while
the others near their end overlaps their ends with its growth), and vLLM reports zero preemptions."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from .conftest import GATEWAY_START_TIMEOUT, _log_dir, _start
from .servers import GATEWAY_READY_PATHS, SERVED_MODEL_NAME, ServerProcess, gateway_server, scrape_counter

pytestmark = pytest.mark.e2e

FLOOD = 16
PROMPT = 20
MAX_TOKENS = 480
BLOCKS_EACH = -(-(PROMPT + MAX_TOKENS) // 128)  # 4: what the books hold for each


@pytest.fixture(scope="module")
def time_aware_gateway(
    request: pytest.FixtureRequest, vllm: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = gateway_server(
        vllm.url, _log_dir(tmp_path_factory) / "time_aware_gateway.log",
        ["--admission-policy", "strict", "--time-aware", "on", "--queue-timeout", "300"], name="time_aware_gateway",
    )
    request.addfinalizer(server.stop)
    _start(request.config, server, GATEWAY_READY_PATHS, GATEWAY_START_TIMEOUT)
    yield server


def body(i: int) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL_NAME, "prompt": [(31 * i + 7 * j) % 480 + 10 for j in range(PROMPT)],
        "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }


async def stream_tokens(client: httpx.AsyncClient, url: str, i: int) -> int:
    """Read one streamed completion as it comes; returns the completion tokens its usage chunk reports."""
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body(i)) as answer:
        assert answer.status_code == 200, await answer.aread()
        async for line in answer.aiter_lines():
            if line.startswith("data: {"):
                usage = orjson.loads(line[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
    return tokens


async def test_a_staggered_flood_through_time_aware_strict_runs_more_at_once_and_never_preempts(
    vllm: ServerProcess, time_aware_gateway: ServerProcess
) -> None:
    url, metrics = time_aware_gateway.url, f"{vllm.url}/metrics"
    preemptions = scrape_counter(metrics, "vllm:num_preemptions_total")
    peak_in_flight, peak_committed, budget, shown = 0, 0, 0, False
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=300.0, limits=httpx.Limits(max_connections=FLOOD + 2)) as client:

        async def watch() -> None:
            nonlocal peak_in_flight, peak_committed, budget, shown
            while not done.is_set():
                status = (await client.get(f"{url}/guard/status")).json()
                budget = status["budget_blocks"]
                peak_in_flight = max(peak_in_flight, status["in_flight"])
                peak_committed = max(peak_committed, status["committed_blocks"])
                shown |= status["time_aware"]["on"] and status["time_aware"]["tracked_in_flight"] > 0
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        tokens = await asyncio.gather(*(stream_tokens(client, url, i) for i in range(FLOOD)))
        done.set()
        await watcher
        final = (await client.get(f"{url}/guard/status")).json()
    assert tokens == [MAX_TOKENS] * FLOOD
    assert scrape_counter(metrics, "vllm:num_preemptions_total") == preemptions
    assert shown  # /guard/status showed the streams whose end it knew
    # The books alone hold at most budget // 4 of these at once; time-aware strict held more.
    assert peak_in_flight > budget // BLOCKS_EACH and peak_committed > budget
    assert final["committed_blocks"] == 0 and final["in_flight"] == 0
