"""Time-aware booking on real vLLM (CPU build, 31 blocks of 128 tokens for requests): a flood of streamed requests
through strict with ``--time-aware on`` holds more of them at once than the books allow (a request admitted while
the others near their end overlaps their ends with its growth), and vLLM reports zero preemptions. What
/guard/status shows of the streams it books by time is checked against the simulator, whose pace the test sets
(``tests/integration/test_admission_flood.py``): sampled here, on two shared cores, it depends on the scheduler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from testing.servers import GATEWAY_READY_PATHS, SERVED_MODEL_NAME, ServerProcess, gateway_server, scrape_counter

from .conftest import GATEWAY_START_TIMEOUT, _log_dir, _start

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


async def stream_tokens(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, float, float]:
    """Read one streamed completion as it comes; returns the completion tokens its usage chunk reports, and when
    its head (sent once the gateway admitted it) and its end arrived."""
    tail = b""
    async with client.stream("POST", f"{url}/v1/completions", json=body(i)) as answer:
        head = time.monotonic()
        assert answer.status_code == 200, await answer.aread()
        # Read the bytes as they come and parse only the last events: a client that parses every event holds the
        # gateway's relay back on two busy cores, and the gateway then sees the streams' progress too late to
        # book by time (as it should: it cannot know how far the engine is).
        async for chunk in answer.aiter_raw():
            tail = (tail + chunk)[-8192:]
    end = time.monotonic()
    events = [line[6:] for line in tail.split(b"\n") if line.startswith(b"data: {")]
    usages = [orjson.loads(e).get("usage") for e in events if b'"usage"' in e]
    tokens = next((u["completion_tokens"] for u in reversed(usages) if u), 0)
    return tokens, head, end


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most streams open at one time, from each one's (head, end)."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


ATTEMPTS = 5  # floods at most, until one shows the overlap (3 once showed none in a full suite run)


async def test_a_staggered_flood_through_time_aware_strict_runs_more_at_once_and_never_preempts(
    vllm: ServerProcess, time_aware_gateway: ServerProcess
) -> None:
    url, metrics = time_aware_gateway.url, f"{vllm.url}/metrics"
    preemptions = scrape_counter(metrics, "vllm:num_preemptions_total")
    budget, most = 0, []
    async with httpx.AsyncClient(timeout=300.0, limits=httpx.Limits(max_connections=FLOOD + 2)) as client:

        async def watch(done: asyncio.Event) -> None:
            nonlocal budget
            while not done.is_set():
                budget = (await client.get(f"{url}/guard/status")).json()["budget_blocks"]
                await asyncio.sleep(0.05)

        # The gateway books by time only as far as it has seen the streams' progress; when the two shared cores
        # hold its relay back, one flood can end before it has seen enough. Every flood must run every request to
        # its end without a preemption; one of them must hold more at once than the books alone allow.
        for _ in range(ATTEMPTS):
            done = asyncio.Event()
            watcher = asyncio.create_task(watch(done))
            answers = await asyncio.gather(*(stream_tokens(client, url, i) for i in range(FLOOD)))
            done.set()
            await watcher
            assert [tokens for tokens, _, _ in answers] == [MAX_TOKENS] * FLOOD
            assert scrape_counter(metrics, "vllm:num_preemptions_total") == preemptions
            most.append(most_at_once([(head, end) for _, head, end in answers]))
            if most[-1] > budget // BLOCKS_EACH:
                break
        # A stream left early is released once the gateway sees its client gone.
        for _ in range(600):
            final = (await client.get(f"{url}/guard/status")).json()
            if not final["in_flight"]:
                break
            await asyncio.sleep(0.05)
    # The books alone hold at most budget // 4 of these at once; time-aware strict held more. Counted from the
    # streams' own spans: a watcher sampling /guard/status on two busy cores can miss the overlap.
    assert max(most) > budget // BLOCKS_EACH, f"most streams at once in each flood: {most}, budget {budget}"
    assert final["committed_blocks"] == 0 and final["in_flight"] == 0
