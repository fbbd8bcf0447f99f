"""A frozen engine in proxy mode, on the simulator: its API server keeps answering /health and /metrics (the
metrics frozen at their last values) while nothing moves. The gateway calls it hung within the bound, refuses
new requests at once, cuts those in flight, and takes requests again once the engine moves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

HANG_TIMEOUT = 1.0
LONG = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 400}


@pytest.fixture
def sim(tokenizer: Any, tokenizer_dir: Any) -> Iterator[SimServer]:
    config = SimConfig(
        model="tiny", root=str(tokenizer_dir), max_model_len=512, num_blocks=256, block_size=16,
        tokenizer=tokenizer, token_delay=0.05,
    )
    with run_sim_server(config) as server:
        yield server


@pytest.fixture
def gateway(sim: SimServer, base_settings: Settings) -> Iterator[GatewayServer]:
    with run_gateway(base_settings, upstream=sim.url, hang_timeout=HANG_TIMEOUT) as gw:
        yield gw


async def stream_events(
    http: httpx.AsyncClient, started: asyncio.Event, body: dict[str, Any] = LONG
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(orjson.loads(line[6:]))
                started.set()
    return events


async def wait_for(predicate: Any, limit: float) -> float:
    """Seconds until ``predicate()`` (a coroutine function) is true; fails after ``limit``."""
    t0 = time.monotonic()
    while not await predicate():
        assert time.monotonic() - t0 < limit, f"not within {limit} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_a_frozen_engine_is_hung_within_the_bound_refused_at_once_cut_and_rejoins(
    sim: SimServer, gateway: GatewayServer
) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(stream_events(http, s)) for s in started]
        whole = asyncio.create_task(http.post("/v1/completions", json=LONG))
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        await wait_for(lambda: _true(sim.sim.running == 3), 60)

        sim.sim.freeze()

        async def health_is(status: int) -> bool:
            return (await http.get("/health")).status_code == status

        # Within the bound plus a few ticks and scrapes: generous, since a machine busy with other work delays
        # the gateway's timer and the scrapes (the declaration itself is timed with an injected clock in
        # tests/unit/engine/test_progress.py).
        took = await wait_for(lambda: health_is(503), HANG_TIMEOUT + 10)
        assert took < HANG_TIMEOUT + 8
        health = (await http.get("/health")).json()
        assert health["upstream"]["state"] == "hung" and health["upstream"]["progress"]["hung"] is True

        t0 = time.monotonic()
        refused = await http.post("/v1/completions", json={**LONG, "max_tokens": 5})
        # The engine would have held it until --read-timeout (5 s); a refusal at once takes a round trip.
        assert time.monotonic() - t0 < 3.0, "a new request waited on the hung engine"
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "upstream_hung"

        for events in await asyncio.wait_for(asyncio.gather(*streams), 30):
            assert events[-1]["error"]["code"] == "upstream_hung", events[-1]
        cut = await asyncio.wait_for(whole, 30)
        assert cut.status_code == 503 and cut.json()["error"]["code"] == "upstream_hung"
        metrics = (await http.get("/metrics")).text
        assert "vllm_guard_engine_hung 1.0" in metrics and "vllm_guard_engine_hangs_total 1.0" in metrics

        sim.sim.thaw()
        await wait_for(lambda: health_is(200), 30)
        served = await http.post("/v1/completions", json={**LONG, "max_tokens": 5})
        assert served.status_code == 200
        assert "vllm_guard_engine_hung 0.0" in (await http.get("/metrics")).text
    status = gateway.status()
    assert status["committed_blocks"] == 0 and status["in_flight"] == 0 and status["queued"] == 0


async def test_a_slow_engine_that_moves_is_never_hung(sim: SimServer, gateway: GatewayServer) -> None:
    sim.sim.config.token_delay = 0.4  # slower than a tick, well within the bound
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        done = asyncio.create_task(stream_events(http, asyncio.Event(), {**LONG, "max_tokens": 8}))
        while not done.done():
            assert (await http.get("/health")).status_code == 200
            await asyncio.sleep(0.1)
        events = await done
    assert len(events) == 8 and all("error" not in e for e in events)


async def _true(value: bool) -> bool:
    return value
