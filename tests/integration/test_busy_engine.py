"""A busy engine is not a hung one (proxy mode). Answers that complete through the gateway are progress, even from an
engine whose metrics never move; and an API server whose one event loop is held for longer than --hang-timeout
(as a large /tokenize held vLLM's ~9 s) answers nothing in time, yet its engine is not called hung while it then
moves again. The frozen engine itself is test_hung_engine.py's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import Settings
from gateway.engine.probe import PROBE_BODY
from testing.bad_upstream import BadUpstream, full, run_bad_upstream
from testing.gateway_thread import run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

COMPLETION = orjson.dumps({
    "id": "cmpl-1", "object": "text_completion", "model": "tiny",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
})


@pytest.fixture
def instant() -> Iterator[BadUpstream]:
    """A stand-in engine that answers each request after 20 ms, its metrics never moving (nothing ever runs). It
    leaves the detector's probes unanswered, so that only the answers themselves can show its progress."""
    with run_bad_upstream() as upstream:
        answer = full(200, COMPLETION)

        async def after_a_moment(writer: asyncio.StreamWriter) -> None:
            if orjson.loads(upstream.seen[-1].body).get("prompt") == PROBE_BODY["prompt"]:  # this request's
                await asyncio.Event().wait()
            await asyncio.sleep(0.02)  # a request is always in flight while the clients loop
            await answer(writer)

        upstream.answer = after_a_moment
        yield upstream


async def test_answers_completing_through_the_gateway_keep_an_engine_with_frozen_metrics_unhung(
    instant: BadUpstream, base_settings: Settings
) -> None:
    hang_timeout = 1.0
    with run_gateway(base_settings, upstream=instant.url, hang_timeout=hang_timeout) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            statuses: list[int] = []

            async def client(until: float) -> None:
                while time.monotonic() < until:
                    statuses.append((await http.post("/v1/completions", json=body)).status_code)

            until = time.monotonic() + 4 * hang_timeout
            await asyncio.gather(*(client(until) for _ in range(16)))
            progress = (await http.get("/guard/status")).json()["upstream"]["progress"]
    assert len(statuses) > 16 and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    assert progress["hangs"] == 0 and not progress["hung"], progress


@pytest.fixture
def sim(tokenizer: Any, tokenizer_dir: Any) -> Iterator[SimServer]:
    config = SimConfig(
        model="tiny", root=str(tokenizer_dir), max_model_len=512, num_blocks=256, block_size=16,
        tokenizer=tokenizer, token_delay=0.05,
    )
    with run_sim_server(config) as server:
        yield server


async def test_an_api_server_held_past_the_bound_is_not_hung_when_it_moves_again(
    sim: SimServer, base_settings: Settings
) -> None:
    hang_timeout, held = 2.0, 4.5  # held past the bound, within the bound of a busy API server (x3)
    with run_gateway(base_settings, upstream=sim.url, hang_timeout=hang_timeout, read_timeout=30.0) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 150, "stream": True}
            events: list[dict[str, Any]] = []
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(orjson.loads(line[6:]))
                    if len(events) == 3:
                        # The simulator's one event loop (its API server and its engine) held, as by a large
                        # /tokenize: no scrape, no stream chunk, no answer for longer than the bound.
                        loop = sim.sim._loop  # type: ignore[union-attr]
                        assert loop is not None
                        loop.call_soon_threadsafe(time.sleep, held)
            progress = (await http.get("/guard/status")).json()["upstream"]["progress"]
    assert len(events) == 150 and all("error" not in e for e in events), events[-1]
    assert progress["hangs"] == 0, progress
