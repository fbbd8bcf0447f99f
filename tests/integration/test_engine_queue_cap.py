"""vLLM's own queue cap (``--max-num-queued-reqs``) behind the gateway: its 503 becomes the gateway's 503
``engine_queue_full`` with a ``Retry-After``, counted under its own reason; the engine is then full to admission,
so the next request waits in the gateway's queue instead of earning another 503, and goes once a request on the
engine has ended; ``/guard/status`` shows the refusals, the gateway's and vLLM's own count."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server
from tests.integration.test_admission_flood import TOKEN, metric
from tests.integration.test_engines import pair

CAP = 2
BODY = {"model": "tiny", "prompt": [TOKEN] * 8, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture
def rig(tokenizer: Any, tokenizer_dir: Path, base_settings: Settings) -> Iterator[tuple[SimServer, GatewayServer]]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_num_queued_reqs=CAP,
                       max_model_len=512)
    with run_sim_server(config) as sim, run_gateway(base_settings, upstream=sim.url) as gw:
        yield sim, gw
        sim.sim.thaw()
        gw.wait_ledger_empty()


async def until(condition: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


def engine_row(gw: GatewayServer) -> dict[str, Any]:
    row: dict[str, Any] = httpx.get(gw.url + "/guard/status").json()["engines"][0]
    return row


def test_the_engines_queue_cap_is_a_503_with_retry_after_and_the_next_request_waits_for_room(
    rig: tuple[SimServer, GatewayServer],
) -> None:
    sim, gw = rig
    asyncio.run(refused_then_waiting(sim, gw))
    page = httpx.get(gw.url + "/metrics").text
    assert metric(page, "vllm_guard_rejections_total", reason="engine_queue_full") == 1.0
    deadline = time.monotonic() + 5.0
    while engine_row(gw)["queue_cap"]["engine_rejections_total"].get("max_num_queued_reqs") != 1.0:
        assert time.monotonic() < deadline, "vLLM's own count of its refusals shows in /guard/status"
        time.sleep(0.01)
    row = engine_row(gw)["queue_cap"]
    assert (row["full"], row["refusals_total"]) == (False, 1)


async def refused_then_waiting(sim: SimServer, gw: GatewayServer) -> None:
    sim.sim.paused = True  # what reaches the engine stays unfinished until the test lets it run
    async with httpx.AsyncClient(timeout=20.0) as client:
        url = gw.url + "/v1/completions"
        held = [asyncio.ensure_future(client.post(url, json=BODY)) for _ in range(CAP)]
        await until(lambda: sim.sim.waiting == CAP, "the engine holds the first requests")

        refused = await client.post(url, json=BODY)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "engine_queue_full"
        assert refused.json()["error"]["type"] == "server_error"
        assert refused.headers["retry-after"] == "1"
        assert (await client.get(gw.url + "/guard/status")).json()["engines"][0]["queue_cap"]["full"] is True

        sent = sim.sim.request_count
        waiting = asyncio.ensure_future(client.post(url, json=BODY))
        await until(lambda: gw.status()["queued"] == 1, "the next request waits in the gateway's queue")
        assert sim.sim.request_count == sent  # nothing more was sent to the full engine
        sim.sim.thaw()
        answers = await asyncio.gather(*held, waiting)
    assert [a.status_code for a in answers] == [200] * (CAP + 1)


def test_with_two_engines_a_refusal_fails_over_and_the_refusing_engine_takes_nothing_new(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings,
) -> None:
    # The first engine has the more room (placement tries it first) and a cap that refuses everything.
    with pair(tokenizer, tokenizer_dir, base_settings, blocks=(64, 32)) as engines:
        first, second = engines.sims
        first.sim.config.max_num_queued_reqs = 0
        answers = [httpx.post(engines.gw.url + "/v1/completions", json=BODY, timeout=20.0) for _ in range(2)]
        assert [(a.status_code, a.headers.get("x-guard-engine")) for a in answers] == [(200, "1"), (200, "1")]
        assert (first.sim.request_count, second.sim.request_count) == (1, 2)  # the second went straight to "1"
        page = httpx.get(engines.gw.url + "/metrics").text
        assert metric(page, "vllm_guard_failovers_total") == 1.0
        assert metric(page, "vllm_guard_rejections_total", reason="engine_queue_full") is None
        engines.gw.wait_ledger_empty()
