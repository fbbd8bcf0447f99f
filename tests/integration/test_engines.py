"""Two engines behind one gateway, end to end: two simulators serving one model, a strict gateway over both. Requests
spread over the two (``x-guard-engine``), ``/guard/status`` and ``/metrics`` show each engine; a request its engine
fails before answering is sent to the other; with one engine stopped the gateway serves on the other and stays
healthy; engines serving different models stop the gateway from starting."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from gateway.errors import ConfigInvalid
from gateway.http.assembly import build_parts
from testing.gateway_thread import GatewayServer, free_port, run_gateway
from testing.vllm_sim import Fault, SimConfig, SimServer, run_sim_server
from testing.vllm_sim.dp import DataParallelSimulator

BLOCK, ENGINE_BLOCKS = 16, 32
FLOOD = 8
# A 160-token prompt + 24 output tokens = 12 blocks: two run at once on a 32-block engine, four on the pair.


def body(i: int) -> dict[str, Any]:
    """A prompt of its own from the first block on: prefix affinity plays no part."""
    return {"model": "tiny", "prompt": [10 + i] + [(7 * i + j) % 400 + 3 for j in range(159)], "max_tokens": 24,
            "ignore_eos": True}


def sim_config(tokenizer: Any, tokenizer_dir: Path, **overrides: Any) -> SimConfig:
    fields: dict[str, Any] = {
        "model": "tiny", "root": str(tokenizer_dir), "tokenizer": tokenizer, "block_size": BLOCK,
        "num_blocks": ENGINE_BLOCKS, "token_delay": 0.004, "max_model_len": 512, **overrides,
    }
    return SimConfig(**fields)


class Pair:
    """The two simulators and the gateway over them; ``stop(i)`` takes simulator ``i`` away for good."""

    def __init__(self, servers: list[run_sim_server], sims: list[SimServer], gw: GatewayServer) -> None:
        self.servers, self.sims, self.gw = servers, sims, gw

    def stop(self, i: int) -> None:
        self.servers[i].__exit__(None, None, None)


@contextlib.contextmanager
def pair(
    tokenizer: Any, tokenizer_dir: Path, settings: Settings, blocks: tuple[int, int] = (ENGINE_BLOCKS, ENGINE_BLOCKS),
    **overrides: Any,
) -> Iterator[Pair]:
    servers = [run_sim_server(sim_config(tokenizer, tokenizer_dir, num_blocks=count)) for count in blocks]
    with contextlib.ExitStack() as stack:
        sims = [stack.enter_context(server) for server in servers]
        gw = stack.enter_context(run_gateway(
            settings, upstream=[s.url for s in sims], admission_policy="strict", kv_target=1.0, queue_timeout=30.0,
            **overrides,
        ))
        yield Pair(servers, sims, gw)


async def send(gw: GatewayServer, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        return list(await asyncio.gather(*(client.post(gw.url + "/v1/completions", json=b) for b in bodies)))


async def get(gw: GatewayServer, path: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10.0) as client:
        return await client.get(gw.url + path)


def scrape(text: str) -> dict[str, dict[str, float]]:
    """``/metrics`` as {sample name: {engine label: value}} for the samples labelled by engine."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "engine" in sample.labels:
                out.setdefault(sample.name, {})[sample.labels["engine"]] = sample.value
    return out


def counter(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def wait_until(check: Callable[[], Awaitable[bool]], limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not await check():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.05)


def engines_of(answers: list[httpx.Response]) -> Counter[str]:
    return Counter(a.headers["x-guard-engine"] for a in answers)


# -- spreading and reporting ------------------------------------------------------------------------
async def test_a_flood_spreads_over_both_engines_and_each_is_reported(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings
) -> None:
    with pair(tokenizer, tokenizer_dir, base_settings) as p:
        answers = await send(p.gw, [body(i) for i in range(FLOOD)])
        assert [a.status_code for a in answers] == [200] * FLOOD, [a.text for a in answers]
        placed = engines_of(answers)
        assert set(placed) == {"0", "1"}, placed
        assert [s.sim.request_count for s in p.sims] == [placed["0"], placed["1"]]  # each went where it was booked
        assert all(s.sim.preemptions_total == 0 for s in p.sims)

        status = (await get(p.gw, "/guard/status")).json()
        rows = status["engines"]
        assert [(r["name"], r["engine"], r["rank"], r["url"], r["state"]) for r in rows] == [
            ("0", 0, None, p.sims[0].url, "ready"), ("1", 1, None, p.sims[1].url, "ready"),
        ]
        assert [r["budget_blocks"] for r in rows] == [ENGINE_BLOCKS, ENGINE_BLOCKS]
        assert status["budget_blocks"] == 2 * ENGINE_BLOCKS
        assert {r["name"]: r["admitted_total"] for r in rows} == dict(placed)

        gauges = scrape((await get(p.gw, "/metrics")).text)
        assert gauges["vllm_guard_engine_budget_blocks"] == {"0": ENGINE_BLOCKS, "1": ENGINE_BLOCKS}
        assert gauges["vllm_guard_engine_admitted_requests"] == {k: float(v) for k, v in placed.items()}
        assert gauges["vllm_guard_engine_committed_blocks"] == {"0": 0.0, "1": 0.0}
        assert gauges["vllm_guard_engine_in_flight_requests"] == {"0": 0.0, "1": 0.0}
        p.gw.wait_ledger_empty()


async def test_a_data_parallel_engine_is_booked_and_addressed_rank_by_rank(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings
) -> None:
    config = sim_config(tokenizer, tokenizer_dir)
    with run_sim_server(config) as plain, run_sim_server(replace(config, data_parallel_size=2)) as dp, run_gateway(
        base_settings, upstream=[plain.url, dp.url], admission_policy="strict", kv_target=1.0, queue_timeout=30.0,
    ) as gw:

        async def split() -> bool:
            rows = (await get(gw, "/guard/status")).json()["engines"]
            return [r["name"] for r in rows] == ["0", "1.0", "1.1"]

        await wait_until(split)
        answers = await send(gw, [body(i) for i in range(12)])
        assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers]
        placed = engines_of(answers)
        assert set(placed) == {"0", "1.0", "1.1"}, placed
        assert Counter(dp.sim.rank_headers_seen) == {"0": placed["1.0"], "1": placed["1.1"]}
        assert isinstance(dp.sim, DataParallelSimulator)
        ranks = dp.sim.ranks
        # Each ran on the rank it was booked on: 24 tokens generated per request there.
        assert [rank.generation_tokens_total for rank in ranks] == [24 * placed["1.0"], 24 * placed["1.1"]]
        assert plain.sim.request_count == placed["0"]
        assert plain.sim.preemptions_total == 0 and all(rank.preemptions_total == 0 for rank in ranks)
        rows = (await get(gw, "/guard/status")).json()["engines"]
        assert [(r["engine"], r["rank"], r["url"], r["budget_blocks"]) for r in rows] == [
            (0, None, plain.url, ENGINE_BLOCKS), (1, 0, dp.url, ENGINE_BLOCKS), (1, 1, dp.url, ENGINE_BLOCKS),
        ]
        gw.wait_ledger_empty()


# -- an engine failing ------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", [Fault.RESET, Fault.ERROR_500, Fault.ENGINE_DEAD], ids=lambda f: f.value)
async def test_a_request_its_engine_fails_before_answering_is_served_by_the_other(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings, fault: Fault
) -> None:
    # The failing engine is the larger: with the most room, it is tried first.
    with pair(tokenizer, tokenizer_dir, base_settings, blocks=(ENGINE_BLOCKS, 2 * ENGINE_BLOCKS)) as p:
        p.sims[1].sim.config.fault = fault  # its metrics still say all is well: admission keeps placing there
        answers = await send(p.gw, [body(i) for i in range(4)])
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert engines_of(answers) == {"0": 4}
        text = (await get(p.gw, "/metrics")).text
        if fault is not Fault.ENGINE_DEAD:  # a dead engine's /health says so: a probe may see it before any request
            assert counter(text, "vllm_guard_failovers_total") >= 1
            assert scrape(text)["vllm_guard_engine_admitted_requests"]["1"] >= 1  # placed there, then moved
        elif counter(text, "vllm_guard_failovers_total") == 0:  # the probe saw it first: nothing was placed there
            assert scrape(text)["vllm_guard_engine_admitted_requests"].get("1", 0) == 0
        p.gw.wait_ledger_empty()


@pytest.mark.parametrize("stopped", [0, 1], ids=["the first engine stops", "the second engine stops"])
async def test_with_one_engine_stopped_the_gateway_serves_on_the_other_and_stays_healthy(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings, stopped: int
) -> None:
    with pair(tokenizer, tokenizer_dir, base_settings) as p:
        p.stop(stopped)
        answers = await send(p.gw, [body(i) for i in range(FLOOD)])  # some may be placed before the stop is seen
        assert [a.status_code for a in answers] == [200] * FLOOD, [a.text for a in answers]
        alive = str(1 - stopped)
        assert engines_of(answers) == {alive: FLOOD}

        async def row_down() -> bool:
            rows = (await get(p.gw, "/guard/status")).json()["engines"]
            return [r["state"] for r in rows] == ["down" if r["engine"] == stopped else "ready" for r in rows]

        await wait_until(row_down)
        metrics = text_string_to_metric_families((await get(p.gw, "/metrics")).text)
        states = {s.labels["engine"]: s.labels["state"] for f in metrics for s in f.samples
                  if s.name == "vllm_guard_engine_state" and s.value == 1}
        assert states == {str(stopped): "down", alive: "ready"}
        health = await get(p.gw, "/health")
        assert health.status_code == 200, health.text
        assert health.json()["upstream"]["state"] == "ready"
        later = await send(p.gw, [body(i) for i in range(4)])
        assert [a.status_code for a in later] == [200] * 4 and engines_of(later) == {alive: 4}
        p.gw.wait_ledger_empty()


async def test_a_gateway_started_before_its_first_engine_serves_on_the_second(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # the first engine, not listening yet
    with run_sim_server(sim_config(tokenizer, tokenizer_dir)) as second, run_gateway(
        base_settings, upstream=[nowhere, second.url], admission_policy="strict", kv_target=1.0, queue_timeout=30.0,
    ) as gw:
        answers = await send(gw, [body(i) for i in range(FLOOD)])
        assert [a.status_code for a in answers] == [200] * FLOOD, [a.text for a in answers]
        assert engines_of(answers) == {"1": FLOOD}
        assert second.sim.preemptions_total == 0
        health = await get(gw, "/health")
        assert health.status_code == 200, health.text
        rows = (await get(gw, "/guard/status")).json()["engines"]
        assert [(r["url"], r["state"]) for r in rows] == [(nowhere, "down"), (second.url, "ready")]
        gw.wait_ledger_empty()


# -- engines that disagree ----------------------------------------------------------------------------
async def test_an_engine_that_comes_up_later_with_another_context_length_takes_nothing(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings
) -> None:
    later = run_sim_server(sim_config(tokenizer, tokenizer_dir, max_model_len=1024))
    with run_sim_server(sim_config(tokenizer, tokenizer_dir)) as first, run_gateway(
        base_settings, upstream=[first.url, later.url], admission_policy="strict", kv_target=1.0, queue_timeout=30.0,
    ) as gw, later as second:

        async def mismatched() -> bool:
            rows = (await get(gw, "/guard/status")).json()["engines"]
            return [r["state"] for r in rows] == ["ready", "mismatched"]

        await wait_until(mismatched)
        answers = await send(gw, [body(i) for i in range(FLOOD)])
        assert [a.status_code for a in answers] == [200] * FLOOD, [a.text for a in answers]
        assert engines_of(answers) == {"0": FLOOD}
        assert len(second.sim.requests_seen) == 0
        gw.wait_ledger_empty()



@pytest.mark.parametrize(
    ("other", "said"),
    [({"model": "other"}, r"\('other',\)"), ({"max_model_len": 1024}, "max_model_len 1024")],
    ids=["another model", "another context length"],
)
async def test_engines_serving_different_models_stop_the_gateway_from_starting(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings, other: dict[str, Any], said: str
) -> None:
    with run_sim_server(sim_config(tokenizer, tokenizer_dir)) as first, \
            run_sim_server(sim_config(tokenizer, tokenizer_dir, **other)) as second:
        settings = base_settings.model_copy(update={"upstream": [first.url, second.url]})
        async with contextlib.AsyncExitStack() as stack:
            with pytest.raises(ConfigInvalid, match=said) as caught:
                await build_parts(settings, stack)
        message = str(caught.value)
        assert second.url in message and first.url in message
        assert "every engine must serve the same model" in message


def test_the_command_line_gateway_over_engines_that_disagree_exits_with_the_reason(
    tokenizer: Any, tokenizer_dir: Path
) -> None:
    with run_sim_server(sim_config(tokenizer, tokenizer_dir)) as first, \
            run_sim_server(sim_config(tokenizer, tokenizer_dir, model="other")) as second:
        command = [
            sys.executable, "-m", "gateway.cli", "serve", "--upstream", first.url, "--upstream", second.url,
            "--tokenizer", str(tokenizer_dir), "--port", str(free_port()), "--host", "127.0.0.1",
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3, done.stderr[-2000:]  # the server never started
    assert f"--upstream {second.url} serves ('other',)" in done.stderr
    assert "every engine must serve the same model with the same limits" in done.stderr
