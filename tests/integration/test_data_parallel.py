"""Data parallelism end to end: the gateway in front of a simulated vLLM with two data-parallel engines books
each rank's KV blocks on their own, once the engine's metrics show the ranks. A strict flood larger than one
rank holds runs on both without a preemption, every request on the rank the gateway booked and named; a request
that neither rank holds alone is refused although both together would hold it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import DataParallelSimulator, SimConfig, run_sim_server

BLOCK, RANK_BLOCKS = 16, 32
PROMPT, OUTPUT = 40, 24  # 64 tokens: 4 blocks, so one rank holds 8 such requests at once
FLOOD = 24
RANKS = ("0.0", "0.1")


@contextlib.contextmanager
def rig(tokenizer: Any, tokenizer_dir: Path, settings: Settings) -> Iterator[tuple[DataParallelSimulator,
                                                                                     GatewayServer]]:
    # max_model_len above one rank's 512 tokens: vLLM would refuse it, the simulator lets a prompt reach the
    # size that only both ranks together could hold.
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, block_size=BLOCK,
                       num_blocks=RANK_BLOCKS, token_delay=0.004, max_model_len=1024, data_parallel_size=2)
    with run_sim_server(config) as server, run_gateway(
        settings, upstream=server.url, admission_policy="strict", kv_target=1.0, queue_timeout=30.0,
        prefix_sharing="off",
    ) as gw:
        assert isinstance(server.sim, DataParallelSimulator)
        yield server.sim, gw


def body(i: int, prompt: int = PROMPT) -> dict[str, Any]:
    # A first token of its own: no two requests share a block.
    return {"model": "tiny", "prompt": [300 + i] + [7] * (prompt - 1), "max_tokens": OUTPUT, "ignore_eos": True}


async def rank_rows(http: httpx.AsyncClient, gw: GatewayServer, timeout: float = 10.0) -> list[dict[str, Any]]:
    """/guard/status.engines once it shows the engine's ranks."""
    deadline = time.monotonic() + timeout
    while True:
        rows: list[dict[str, Any]] = (await http.get(gw.url + "/guard/status")).json()["engines"]
        if [row["name"] for row in rows] == list(RANKS) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.02)


async def flood(http: httpx.AsyncClient, gw: GatewayServer) -> tuple[list[httpx.Response], int]:
    """Every request at once; the answers and the most requests in flight at once."""
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, (await asyncio.to_thread(gw.status))["in_flight"])
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    answers = await asyncio.gather(*(http.post(gw.url + "/v1/completions", json=body(i)) for i in range(FLOOD)))
    done.set()
    await watcher
    return list(answers), peak


async def test_a_strict_flood_runs_on_both_ranks_each_request_where_it_was_booked(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings
) -> None:
    with rig(tokenizer, tokenizer_dir, base_settings) as (sim, gw):
        async with httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(max_connections=FLOOD + 2)) as http:
            rows = await rank_rows(http, gw)
            assert [(row["name"], row["engine"], row["rank"], row["capacity_blocks"]) for row in rows] == [
                ("0.0", 0, 0, RANK_BLOCKS), ("0.1", 0, 1, RANK_BLOCKS),
            ]
            answers, peak = await flood(http, gw)
        assert [a.status_code for a in answers] == [200] * FLOOD
        assert sim.preemptions_total == 0 and sim.peak_used_blocks <= RANK_BLOCKS
        booked = [a.headers["x-guard-engine"] for a in answers]
        assert set(booked) == set(RANKS)
        assert peak > RANK_BLOCKS // 4  # more at once than one rank holds
        seen = {b["prompt"][0]: h for b, h in zip(sim.requests_seen, sim.rank_headers_seen, strict=True)}
        assert [seen[300 + i] for i in range(FLOOD)] == [name.split(".")[1] for name in booked]
        # Each rank ran exactly the requests booked on it.
        assert [engine.prompt_tokens_total for engine in sim.ranks] == [PROMPT * booked.count(r) for r in RANKS]
        await asyncio.to_thread(gw.wait_ledger_empty)


async def test_a_request_no_single_rank_holds_is_refused_though_both_together_would(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings
) -> None:
    prompt = 600  # 38 blocks: more than one rank's 32, fewer than both ranks' 64
    with rig(tokenizer, tokenizer_dir, base_settings) as (sim, gw):
        async with httpx.AsyncClient(timeout=30.0) as http:
            assert len(await rank_rows(http, gw)) == 2
            assert (await asyncio.to_thread(gw.status))["budget_blocks"] == 2 * RANK_BLOCKS
            answer = await http.post(gw.url + "/v1/completions", json=body(0, prompt))
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "kv_budget_exceeded")
        assert "retry-after" not in answer.headers
        assert sim.request_count == 0  # refused before it reached the engine
        await asyncio.to_thread(gw.wait_ledger_empty)

