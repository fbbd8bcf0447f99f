"""--ttft-objective auto, the default, through the real gateway in front of the vLLM simulator: a burst that arrives
at once is answered whole, however long the engine takes, on one engine and on two data-parallel ranks; under the
sustained overload of test_overload (about three times what the engine serves) the requests admitted once the
overload is sustained wait about a second, and the rest are refused with 503 deadline, most of them at once."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, run_sim_server
from tests.integration import test_overload as overload_rig

DEFAULTS = Settings()
BURST = 24  # 4 to 8 blocks each, 3 to 7 at once: about 8 s of the engine's work, arriving at once


@pytest.fixture
def rig(tokenizer: Any, tokenizer_dir: Path, base_settings: Settings) -> Iterator[Callable[..., GatewayServer]]:
    """test_overload's engine (32 blocks, 20-ms steps) with a gateway at the defaults of admission (the tests'
    base settings shorten the queue timeout); the gateway's ledger must be back to zero after the test."""
    with contextlib.ExitStack() as stack:
        started: list[GatewayServer] = []

        def make(data_parallel: int = 1) -> GatewayServer:
            config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer,
                               block_size=overload_rig.BLOCK, num_blocks=overload_rig.ENGINE_BLOCKS,
                               token_delay=overload_rig.STEP, max_model_len=512, data_parallel_size=data_parallel)
            sim = stack.enter_context(run_sim_server(config))
            gw = stack.enter_context(run_gateway(
                base_settings, upstream=sim.url, queue_timeout=DEFAULTS.queue_timeout,
                ttft_objective=DEFAULTS.ttft_objective, max_queue=DEFAULTS.max_queue, read_timeout=120.0,
                request_timeout=300.0,
            ))
            started.append(gw)
            return gw

        yield make
        for gw in started:
            gw.wait_ledger_empty()


@pytest.mark.parametrize("ranks", [1, 2], ids=["one engine", "two data-parallel ranks"])
async def test_a_burst_that_arrives_at_once_is_answered_whole(rig: Callable[..., GatewayServer], ranks: int) -> None:
    gw = rig(ranks)
    answers = await overload_rig.overload(gw.url, BURST * ranks, float("inf"))
    assert overload_rig.codes(answers) == {"ok": BURST * ranks}
    async with httpx.AsyncClient() as client:
        status = (await client.get(gw.url + "/guard/status")).json()["deadlines"]
    assert status["ttft_objective"] == "auto" and status["ttft_objective_s"] >= 1.0


async def test_under_sustained_overload_the_admitted_wait_about_a_second_and_the_rest_are_refused_at_once(
    rig: Callable[..., GatewayServer],
) -> None:
    gw = rig()
    warm = overload_rig.codes(await overload_rig.overload(gw.url, 12, float("inf")))
    assert warm == {"ok": 12}, warm  # a burst: queued whole
    await asyncio.sleep(1.5)  # the queue stayed empty: whatever came before is over
    answers = await overload_rig.overload(gw.url)
    counted = overload_rig.codes(answers)
    assert set(counted) <= {"ok", "deadline"} and counted["ok"] >= 12 and counted["deadline"] >= 10, counted
    waits = sorted(float(r.headers["x-guard-queue-ms"]) / 1000 for r, _ in answers if r.status_code == 200)
    # The first requests of the overload are queued before it is seen to be sustained (until one that arrived into
    # a backlog of a second has waited a second itself: about two seconds of arrivals); the rest wait a second at
    # most (the engine's own first tokens come in tens of milliseconds), with the deadline timer's slack.
    assert statistics.median(waits) <= 1.5, waits
    refused = [(r, seconds) for r, seconds in answers if r.status_code != 200]
    assert all(int(r.headers["retry-after"]) >= 1 for r, _ in refused)
    assert any("--ttft-objective auto" in r.json()["error"]["message"] for r, _ in refused)
    assert statistics.median(seconds for _, seconds in refused) < 0.5, refused  # most at once
