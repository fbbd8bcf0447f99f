"""KV-aware admission end to end: floods through the real gateway in front of the vLLM simulator.

The simulator allocates KV blocks as vLLM's V1 scheduler does and preempts when a running sequence needs a
block that is not free, so "zero preemptions" here is the engine's own account, not the gateway's. Each
flood is sized at about four times the engine's blocks; the same flood sent straight to the engine
preempts, which proves the assertion can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission import Admission
from gateway.config import Settings
from gateway.engine.live import EngineView
from gateway.metrics import Metrics
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import Fault, SimConfig, SimServer, run_sim_server

BLOCK = 16
TOKEN = 7  # any id: the engine and the gateway count a token-id prompt by its length
FLOOD = 40
# 40 requests of 16 prompt + 32 output tokens = 3 blocks each: 120 blocks against an engine of 32.
FLOOD_PROMPT, FLOOD_MAX_TOKENS, FLOOD_NEED = 16, 32, 3
ENGINE_BLOCKS = 32
STRICT_BUDGET = int(0.9 * ENGINE_BLOCKS)  # --kv-target 0.9, make_gateway's default


def completion(prompt_tokens: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": [TOKEN] * prompt_tokens, "max_tokens": max_tokens, **extra}


def flood_body(**extra: Any) -> dict[str, Any]:
    return completion(FLOOD_PROMPT, FLOOD_MAX_TOKENS, **extra)


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Poll a condition that another thread (the gateway's or the engine's loop) makes true."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:g} s: {what}")
        await asyncio.sleep(0.005)


async def flood(url: str, n: int, body: dict[str, Any]) -> list[httpx.Response]:
    """n identical completions at once, each on its own connection."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        return list(await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(n))))


def assert_completed_or_shed(responses: list[httpx.Response]) -> None:
    """Every answer is a completion, or a 429/503 that tells the client when to come back."""
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] >= 1
            continue
        assert r.status_code in (429, 503), r.text
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == ("rate_limit_error" if r.status_code == 429 else "server_error")


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus text page; None when the series is absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


class PeakInFlight:
    """Samples the admission's in-flight count on the gateway's own loop, every millisecond."""

    def __init__(self, gw: GatewayServer) -> None:
        self.peak = 0
        self._admission = gw.parts.admission
        self._stopping = False
        self._future = asyncio.run_coroutine_threadsafe(self._sample(), gw.loop)

    async def _sample(self) -> None:
        while not self._stopping:
            self.peak = max(self.peak, self._admission.in_flight)
            await asyncio.sleep(0.001)

    def stop(self) -> int:
        self._stopping = True
        self._future.result(5)
        return self.peak


# -- rigs -------------------------------------------------------------------------------------------
@pytest.fixture
def exits() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def make_sim(tokenizer: Any, tokenizer_dir: Path, exits: contextlib.ExitStack) -> Callable[..., SimServer]:
    def make(**config: Any) -> SimServer:
        config.setdefault("num_blocks", ENGINE_BLOCKS)
        config.setdefault("token_delay", 0.002)
        config.setdefault("max_model_len", 512)
        sim_config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, block_size=BLOCK,
                               **config)
        return exits.enter_context(run_sim_server(sim_config))

    return make


@pytest.fixture
def make_gateway(base_settings: Settings, exits: contextlib.ExitStack) -> Iterator[Callable[..., GatewayServer]]:
    """Gateways in front of a simulator; after the test, each one's ledger must be back to zero."""
    started: list[GatewayServer] = []

    def make(sim: SimServer, **overrides: Any) -> GatewayServer:
        # A budget below the engine's capacity, so that "within budget" and "within the engine" differ.
        overrides.setdefault("kv_target", 0.9)
        gw = exits.enter_context(run_gateway(base_settings, upstream=sim.url, **overrides))
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.wait_ledger_empty()


@contextlib.asynccontextmanager
async def held_reservation(
    client: httpx.AsyncClient, gw: GatewayServer, sim: SimServer, prompt_tokens: int, max_tokens: int
) -> AsyncIterator[None]:
    """A request admitted upstream that holds its blocks until the block ends; then its client goes away.

    The engine hangs on it (Fault.HANG), so nothing else the gateway admits can finish it early."""
    seen = sim.sim.request_count
    sim.sim.config.fault = Fault.HANG
    task = asyncio.create_task(client.post(
        gw.url + "/v1/completions", json=completion(prompt_tokens, max_tokens, user="holder")
    ))
    try:
        await eventually(lambda: sim.sim.request_count > seen, "the engine received the holding request")
        sim.sim.config.fault = None
        assert gw.status()["in_flight"] == 1
        yield
    finally:
        sim.sim.config.fault = None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# -- the flood --------------------------------------------------------------------------------------
async def test_a_flood_sent_straight_to_the_engine_preempts(make_sim: Callable[..., SimServer]) -> None:
    sim = make_sim()
    responses = await flood(sim.url, FLOOD, flood_body())
    assert all(r.status_code == 200 for r in responses)
    assert sim.sim.preemptions_total > 0


async def test_the_same_flood_through_strict_makes_zero_preemptions(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(stop_early=lambda index, max_tokens: 4)
    gw = make_gateway(sim, admission_policy="strict", max_queue=24)
    responses = await flood(gw.url, FLOOD, flood_body())
    assert_completed_or_shed(responses)
    assert len([r for r in responses if r.status_code == 200]) >= STRICT_BUDGET // FLOOD_NEED
    assert sim.sim.preemptions_total == 0
    assert sim.sim.peak_used_blocks <= STRICT_BUDGET
    gw.wait_ledger_empty()


async def test_a_flood_at_start_meets_the_engine_budget_though_the_first_scrape_answers_late(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    """The gateway serves once it has read the engine's capacity: a flood in its first moments is booked against
    it, not let through because no scrape has ended yet."""
    sim = make_sim(stop_early=lambda index, max_tokens: max_tokens, metrics_delay=0.5)
    gw = make_gateway(sim, admission_policy="strict", max_queue=FLOOD)
    responses = await flood(gw.url, FLOOD, flood_body())
    assert all(r.status_code == 200 for r in responses)
    assert sim.sim.preemptions_total == 0
    assert sim.sim.peak_used_blocks <= STRICT_BUDGET
    gw.wait_ledger_empty()


async def test_a_cold_flood_running_to_max_tokens_preempts_far_less_through_the_default_policy(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    """Nothing learned yet, every answer runs to its max_tokens (the model never draws EOS, which the gateway
    cannot know): the default policy books a quarter of max_tokens at first, lets the engine preempt, and backs off
    to the worst case as it does."""
    direct = make_sim()
    straight = await flood(direct.url, FLOOD, flood_body())
    assert all(r.status_code == 200 for r in straight)
    sim = make_sim()
    gw = make_gateway(sim, admission_policy="adaptive", max_queue=24)
    responses = await flood(gw.url, FLOOD, flood_body())
    assert_completed_or_shed(responses)
    completed = [r for r in responses if r.status_code == 200]
    assert all(r.json()["usage"]["completion_tokens"] == FLOOD_MAX_TOKENS for r in completed)
    assert sim.sim.preemptions_total <= direct.sim.preemptions_total / 2, (
        sim.sim.preemptions_total, direct.sim.preemptions_total
    )
    if sim.sim.preemptions_total:  # backed off: no reach past the projection, or a lower level than full
        assert gw.status()["preemption_budget"]["level"] <= 1.0
    gw.wait_ledger_empty()


# 16 prompt + 112 max_tokens = 8 blocks each: the ledger alone can never run more than 28 // 8 = 3 at
# once, whatever the timing. The outputs stop after 4 tokens, which adaptive learns and uses while the
# engine's metrics are live; without them (--disable-log-stats) it must not admit past the ledger.
EARLY_STOP_RIGS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("strict", {}, {"admission_policy": "strict"}),
    ("adaptive", {}, {"admission_policy": "adaptive"}),
    ("adaptive-blind", {"disable_log_stats": True},
     {"admission_policy": "adaptive", "kv_blocks": ENGINE_BLOCKS, "block_size": BLOCK}),
]


async def test_adaptive_admits_more_than_strict_when_requests_stop_early_and_only_with_live_metrics(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    ledger_bound = STRICT_BUDGET // 8
    peaks: dict[str, int] = {}
    for name, sim_config, gateway_flags in EARLY_STOP_RIGS:
        sim = make_sim(stop_early=lambda index, max_tokens: 4, **sim_config)
        # A generous queue timeout: on a loaded machine the ledger's 20 waves may take seconds.
        gw = make_gateway(sim, queue_timeout=30.0, **gateway_flags)
        sampler = PeakInFlight(gw)
        responses = await flood(gw.url, 60, completion(16, 112))
        peaks[name] = sampler.stop()
        assert [r.status_code for r in responses] == [200] * 60, name
        assert sim.sim.preemptions_total == 0, name
    assert peaks["strict"] <= ledger_bound, peaks
    assert peaks["adaptive-blind"] <= ledger_bound, peaks
    assert peaks["adaptive"] > ledger_bound, peaks


def backed_off(status: dict[str, Any]) -> bool:
    """The preemptions are counted and the level reaches no further than the projection (the reach is the level
    past 1)."""
    budget = status["preemption_budget"]
    return bool(budget["preemptions_per_100"] > 0 and budget["reach"] == 0)


async def test_adaptive_backs_off_when_outputs_grow_longer_than_it_learned(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(stop_early=lambda index, max_tokens: 4)
    # A budget of 0: any preemption is past it. With the default, a burst of one or two preemptions over 52
    # completions is within the budget and the gateway rightly keeps its level.
    gw = make_gateway(sim, admission_policy="adaptive", queue_timeout=30.0, preemption_budget=0.0)
    learned = await flood(gw.url, 12, completion(16, FLOOD_MAX_TOKENS))
    assert [r.status_code for r in learned] == [200] * 12
    assert sum(gw.status()["output_lengths"].values()) == 12
    # Now every request runs to max_tokens (the model stops drawing EOS: nothing in the requests says so). Non-
    # streaming requests show no progress, so the first burst is sized on the short outputs learned so far and may
    # preempt; the gateway must learn from it.
    sim.sim.config.stop_early = None
    first = await flood(gw.url, FLOOD, flood_body())
    assert [r.status_code for r in first] == [200] * FLOOD
    assert sum(gw.status()["output_lengths"].values()) == 12 + FLOOD
    preempted = sim.sim.preemptions_total
    if preempted:
        # Backing off: a level that had reached past the projection falls back to it, one at or under it halves.
        await eventually(lambda: backed_off(gw.status()), "the level lowered after preemptions")
    second = await flood(gw.url, FLOOD, flood_body())
    assert [r.status_code for r in second] == [200] * FLOOD
    # Learned: the second burst preempts less than the first (none if the first did not). Not always none: the
    # window's preemptions age while the second burst runs, and on a loaded machine one was seen (1 against 8).
    again = sim.sim.preemptions_total - preempted
    assert again < preempted or again == preempted == 0, f"{again} preemptions after the first burst's {preempted}"


# -- the queue --------------------------------------------------------------------------------------
# An engine of 16 blocks, all of them committable: the holding request takes 14 (16 + 200 tokens), each
# other request 9 (16 + 128 tokens), so they wait while it holds and then run one at a time.
QUEUE_RIG: dict[str, Any] = {"num_blocks": 16, "stop_early": lambda index, max_tokens: 2}
HOLDER = (16, 200)
WAITER = (16, 128)


async def test_a_full_queue_sheds_with_429_and_retry_after(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(**QUEUE_RIG)
    gw = make_gateway(sim, admission_policy="strict", kv_target=1.0, max_queue=1)
    async with httpx.AsyncClient(timeout=10.0) as client:
        async with held_reservation(client, gw, sim, *HOLDER):
            waiting = asyncio.create_task(client.post(gw.url + "/v1/completions", json=completion(*WAITER)))
            await eventually(lambda: gw.status()["queued"] == 1, "one request queued")
            shed = await client.post(gw.url + "/v1/completions", json=completion(*WAITER))
            assert shed.status_code == 429, shed.text
            assert int(shed.headers["retry-after"]) >= 1
            error = shed.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
            assert "1 requests waiting" in error["message"]
        served = await waiting
    assert served.status_code == 200
    assert float(served.headers["x-guard-queue-ms"]) > 0


async def test_a_request_that_waits_past_the_queue_timeout_gets_503_with_retry_after(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(**QUEUE_RIG)
    gw = make_gateway(sim, admission_policy="strict", kv_target=1.0, queue_timeout=0.3)
    async with httpx.AsyncClient(timeout=10.0) as client, held_reservation(client, gw, sim, *HOLDER):
        t0 = time.monotonic()
        r = await client.post(gw.url + "/v1/completions", json=completion(*WAITER))
        waited = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "queue_timeout")
    assert "queue timeout is 0.3 s" in error["message"]
    assert waited >= 0.3
    assert sim.sim.request_count == 1  # only the holder reached the engine


async def test_higher_priority_is_served_first_and_reports_its_queue_time(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(**QUEUE_RIG)
    gw = make_gateway(sim, admission_policy="strict", kv_target=1.0)
    arrivals = [("a", 0), ("b", 5), ("c", 1), ("d", 9), ("e", 5)]
    async with httpx.AsyncClient(timeout=10.0) as client:
        async with held_reservation(client, gw, sim, *HOLDER):
            tasks = []
            for name, prio in arrivals:
                tasks.append(asyncio.create_task(client.post(
                    gw.url + "/v1/completions", json=completion(*WAITER, user=name),
                    headers={"x-guard-priority": str(prio)},
                )))
                # One at a time, so that arrival order is known.
                await eventually(lambda: gw.status()["queued"] == len(tasks), f"{name} queued")
            assert gw.status()["queued_by_priority"] == {"9": 1, "5": 2, "1": 1, "0": 1}
        responses = await asyncio.gather(*tasks)
    assert [r.status_code for r in responses] == [200] * len(arrivals)
    # One fits at a time, so the order the engine received them is the order they were admitted.
    served = [body.get("user") for body in sim.sim.requests_seen][1:]
    assert served == ["d", "b", "e", "c", "a"]
    assert all(float(r.headers["x-guard-queue-ms"]) > 0 for r in responses)


# -- a request larger than the whole budget ---------------------------------------------------------
def test_a_request_larger_than_the_budget_is_clamped_to_fit(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    # An engine of 8 blocks (128 tokens); the budget is 0.9 x 8 = 7 blocks = 112 tokens.
    sim = make_sim(num_blocks=8)
    gw = make_gateway(sim, on_max_tokens_overflow="clamp")
    r = httpx.post(gw.url + "/v1/completions", json=completion(10, 300), timeout=10.0)
    assert r.status_code == 200, r.text
    assert r.headers["x-guard-max-tokens"] == str(7 * BLOCK - 10)
    assert sim.sim.requests_seen[-1]["max_tokens"] == 7 * BLOCK - 10
    assert r.json()["usage"]["completion_tokens"] == 7 * BLOCK - 10
    assert sim.sim.preemptions_total == 0
    page = httpx.get(gw.url + "/metrics").text
    assert metric(page, "vllm_guard_max_tokens_clamped_total", route="completions") == 1


def test_a_request_larger_than_the_budget_is_rejected_with_both_numbers(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(num_blocks=8)
    gw = make_gateway(sim, on_max_tokens_overflow="reject")
    r = httpx.post(gw.url + "/v1/completions", json=completion(10, 300), timeout=10.0)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "kv_budget_exceeded")
    # 10 + 300 tokens need ceil(310 / 16) = 20 blocks; the budget is 7.
    assert "needs 20 KV blocks" in error["message"] and "budget of 7 blocks" in error["message"]
    assert "retry-after" not in r.headers  # retrying the same request cannot help
    assert sim.sim.request_count == 0
    page = httpx.get(gw.url + "/metrics").text
    assert metric(page, "vllm_guard_rejections_total", reason="kv_budget") == 1


# -- the ledger on every exit path ------------------------------------------------------------------
async def test_a_client_that_disconnects_while_queued_leaves_the_queue(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(**QUEUE_RIG)
    gw = make_gateway(sim, admission_policy="strict", kv_target=1.0)
    async with httpx.AsyncClient(timeout=10.0) as client:
        async with held_reservation(client, gw, sim, *HOLDER):
            waiting = asyncio.create_task(client.post(gw.url + "/v1/completions", json=completion(*WAITER)))
            await eventually(lambda: gw.status()["queued"] == 1, "one request queued")
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await eventually(lambda: gw.status()["queued"] == 0, "the queued request withdrawn")
            assert gw.status()["in_flight"] == 1
        await eventually(lambda: gw.ledger_is_empty(), "the ledger back to zero")
    assert sim.sim.request_count == 1  # the withdrawn request never reached the engine


async def test_a_client_that_goes_away_while_sending_its_body_is_counted_as_cancelled(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer], caplog: pytest.LogCaptureFixture
) -> None:
    sim = make_sim()
    gw = make_gateway(sim)
    port = int(gw.url.rsplit(":", 1)[1])
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b'content-length: 1000\r\n\r\n{"model": "tiny", "prompt": '
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()

    def cancelled() -> float:
        page = httpx.get(gw.url + "/metrics").text
        return metric(page, "vllm_guard_requests_total", route="completions", outcome="cancelled") or 0

    await eventually(lambda: cancelled() == 1, "the request counted as cancelled")
    assert not [r for r in caplog.records if r.name.startswith("gateway") and r.levelname == "ERROR"]
    assert sim.sim.request_count == 0


async def test_a_client_that_disconnects_mid_stream_releases_its_blocks(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(token_delay=0.01)
    gw = make_gateway(sim)
    async with (
        httpx.AsyncClient(timeout=10.0) as client,
        client.stream("POST", gw.url + "/v1/completions", json=completion(16, 400, stream=True)) as r,
    ):
        assert r.status_code == 200
        async for _ in r.aiter_raw():
            assert gw.status()["committed_blocks"] == 26  # ceil((16 + 400) / 16)
            break
    await eventually(lambda: sim.sim.cancelled == 1 and gw.ledger_is_empty(), "stream cut and released")


async def test_a_stream_through_time_aware_strict_shows_in_the_status_once_its_progress_is_known(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(token_delay=0.01)  # 400 tokens: four seconds, far longer than the gateway needs to see 17
    gw = make_gateway(sim, admission_policy="strict", time_aware="on")
    async with (
        httpx.AsyncClient(timeout=10.0) as client,
        client.stream("POST", gw.url + "/v1/completions", json=completion(16, 400, stream=True)) as r,
    ):
        assert r.status_code == 200
        shown: dict[str, Any] = {}
        async for _ in r.aiter_raw():
            shown = (await client.get(gw.url + "/guard/status")).json()["time_aware"]
            if shown["tracked_in_flight"]:
                break
        # 16 events may carry no token: past them, the stream's end is known, and where it is.
        assert shown["on"] and shown["tracked_in_flight"] == 1
        assert 0 < shown["next_end_step"] < 400
    await eventually(lambda: gw.ledger_is_empty(), "stream cut and released")


async def test_a_cancelled_request_is_aborted_upstream_and_released(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(token_delay=0.01)
    gw = make_gateway(sim)
    async with httpx.AsyncClient(timeout=10.0) as client:
        task = asyncio.create_task(client.post(gw.url + "/v1/completions", json=completion(16, 400)))
        await eventually(lambda: sim.sim.running == 1, "the engine runs the request")
        assert gw.status()["in_flight"] == 1
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await eventually(lambda: sim.sim.cancelled == 1 and gw.ledger_is_empty(), "request aborted and released")
    assert sim.sim.running == 0


@pytest.mark.parametrize(
    ("fault", "stream", "status"),
    [
        (Fault.RESET, False, 503),
        (Fault.HANG, False, 504),
        (Fault.ERROR_500, False, 500),
        (Fault.DIE_MID_STREAM, True, 200),
        (Fault.HANG, True, 504),
    ],
    ids=["reset", "hang", "error-500", "die-mid-stream", "hang-stream"],
)
async def test_an_upstream_fault_releases_the_reservation(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer], fault: Fault, stream: bool,
    status: int,
) -> None:
    sim = make_sim()
    gw = make_gateway(sim, read_timeout=0.5)
    sim.sim.config.fault = fault
    async with httpx.AsyncClient(timeout=10.0) as client:
        r = await client.post(gw.url + "/v1/completions", json=completion(16, 40, stream=stream))
        sim.sim.config.fault = None
        assert r.status_code == status, r.text
        if stream and status == 200:
            assert b'"error"' in r.content  # the cut is reported in the stream itself
        await eventually(lambda: gw.ledger_is_empty(), "the ledger back to zero")
        # Nothing stays reserved: the next request is admitted and served.
        ok = await client.post(gw.url + "/v1/completions", json=completion(16, 8))
        assert ok.status_code == 200


# -- clients that back off ---------------------------------------------------------------------------
async def test_the_openai_sdk_retries_a_shed_request_after_retry_after(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    # Outputs stop after 60 tokens: the busy request reserves 14 of the 16 blocks (16 + 200 tokens) and
    # runs ~60 engine steps (0.3 s); the SDK's request needs 9 (16 + 128 tokens), so it is shed meanwhile.
    sim = make_sim(num_blocks=16, token_delay=0.005, stop_early=lambda index, max_tokens: 60)
    gw = make_gateway(sim, admission_policy="strict", kv_target=1.0, max_queue=0)
    seen: list[tuple[str, float, int | None, str | None]] = []

    async def on_request(request: httpx2.Request) -> None:
        seen.append(("request", time.monotonic(), None, None))

    async def on_response(response: httpx2.Response) -> None:
        seen.append(("response", time.monotonic(), response.status_code, response.headers.get("retry-after")))

    http_client = openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
    async with (
        httpx.AsyncClient(timeout=10.0) as plain,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=2, http_client=http_client) as sdk,
    ):
        # A few finished requests give the gateway a drain rate to compute Retry-After from.
        for _ in range(3):
            assert (await plain.post(gw.url + "/v1/completions", json=completion(16, 1))).status_code == 200
        busy = asyncio.create_task(plain.post(gw.url + "/v1/completions", json=completion(16, 200)))
        await eventually(lambda: gw.status()["committed_blocks"] > 0, "the busy request admitted")
        t0 = time.monotonic()
        answer = await sdk.completions.create(model="tiny", prompt=[TOKEN] * 16, max_tokens=128)
        elapsed = time.monotonic() - t0
        assert (await busy).status_code == 200
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    responses = [(status, retry) for kind, _, status, retry in seen if kind == "response"]
    assert [status for status, _ in responses] == [429, 200]
    retry_after = int(responses[0][1] or 0)
    assert 1 <= retry_after <= 5
    first_answer = next(t for kind, t, status, _ in seen if kind == "response")
    second_request = [t for kind, t, _, _ in seen if kind == "request"][1]
    assert second_request - first_answer >= retry_after - 0.05
    assert elapsed < retry_after + 3.0


# -- what operators see ------------------------------------------------------------------------------
async def test_status_and_metrics_show_the_flood_the_engine_and_staleness(
    tokenizer: Any, tokenizer_dir: Path, make_gateway: Callable[..., GatewayServer]
) -> None:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, block_size=BLOCK,
                       num_blocks=ENGINE_BLOCKS, max_model_len=512, token_delay=0.002)
    async with httpx.AsyncClient(timeout=10.0) as client:
        with run_sim_server(config) as sim:
            gw = make_gateway(sim, admission_policy="strict", max_queue=8, metrics_stale_after=0.3)
            samples: list[dict[str, Any]] = []
            pages: list[str] = []

            async def watch() -> None:
                while True:
                    samples.append((await client.get(gw.url + "/guard/status")).json())
                    pages.append((await client.get(gw.url + "/metrics")).text)
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            responses = await flood(gw.url, FLOOD, flood_body())
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            assert_completed_or_shed(responses)
            ok = sum(r.status_code == 200 for r in responses)
            shed = sum(r.status_code == 429 for r in responses)
            assert ok + shed == FLOOD
            assert ok >= STRICT_BUDGET // FLOOD_NEED and shed > 0  # 40 arrive long before the first 9 finish

            # During the flood: the ledger, live usage and queue depth moved, within the budget.
            assert {s["capacity_blocks"] for s in samples} == {ENGINE_BLOCKS}
            assert {s["budget_blocks"] for s in samples} == {STRICT_BUDGET}
            assert 0 < max(s["committed_blocks"] for s in samples) <= STRICT_BUDGET
            assert max(s["live_used_blocks"] or 0 for s in samples) > 0
            assert max(s["queued"] for s in samples) > 0
            assert max(metric(p, "vllm_guard_kv_committed_blocks") or 0 for p in pages) > 0
            assert max(metric(p, "vllm_guard_queue_depth", priority="0") or 0 for p in pages) > 0

            page = (await client.get(gw.url + "/metrics")).text
            assert metric(page, "vllm_guard_kv_capacity_blocks") == ENGINE_BLOCKS
            assert metric(page, "vllm_guard_kv_budget_blocks") == STRICT_BUDGET
            assert metric(page, "vllm_guard_kv_committed_blocks") == 0
            assert metric(page, "vllm_guard_kv_live_used_blocks") is not None
            admitted = sum(metric(page, "vllm_guard_admissions_total", how=h) or 0 for h in ("immediate", "queued"))
            assert admitted == ok
            assert (metric(page, "vllm_guard_admissions_total", how="queued") or 0) > 0
            assert metric(page, "vllm_guard_rejections_total", reason="queue_full") == shed
            assert metric(page, "vllm_guard_engine_preemptions_total") == 0
            assert metric(page, "vllm_guard_engine_metrics_stale") == 0
            assert (metric(page, "vllm_guard_engine_metrics_age_seconds") or 0) < 0.3

            # Preemptions caused behind the gateway's back are reported as the engine counts them.
            await flood(sim.url, FLOOD, flood_body())
            assert sim.sim.preemptions_total > 0

            def preemptions_seen() -> bool:
                engine = gw.status()["engine"]
                return bool(engine["preemptions_total"] == sim.sim.preemptions_total)

            await eventually(preemptions_seen, "the gateway sees the engine's preemptions")
            page = (await client.get(gw.url + "/metrics")).text
            assert metric(page, "vllm_guard_engine_preemptions_total") == sim.sim.preemptions_total

        # The engine is gone: its metrics go stale and the status says so.
        await eventually(lambda: bool(gw.status()["engine"]["stale"]), "the engine metrics marked stale")
        status = (await client.get(gw.url + "/guard/status")).json()
        assert status["engine"]["stale"] is True
        assert status["upstream"]["state"] == "down"
        page = (await client.get(gw.url + "/metrics")).text
        assert metric(page, "vllm_guard_engine_metrics_stale") == 1
        assert (metric(page, "vllm_guard_engine_scrape_errors_total") or 0) > 0


async def test_a_hanging_scrape_does_not_freeze_the_exported_staleness() -> None:
    """An engine that accepts the scrape and never answers: /metrics must turn stale as the status does.

    Driven without HTTP (an injected fetch and clock), because only a hang makes the two disagree."""
    now = 100.0
    never = asyncio.Event()
    scrapes = 0

    async def fetch(path: str) -> tuple[int, bytes]:
        nonlocal scrapes
        if path == "/v1/models":
            return 200, b'{"data": [{"id": "tiny", "max_model_len": 512}]}'
        scrapes += 1
        if scrapes > 1:
            await never.wait()
        return 200, b'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'

    metrics = Metrics()
    view = EngineView(fetch, interval=0.05, stale_after=0.3, metrics=metrics, clock=lambda: now)
    settings = Settings.model_validate({"kv_blocks": ENGINE_BLOCKS, "block_size": BLOCK})
    admission = Admission(settings, view, metrics, clock=lambda: now)
    await view.refresh()
    hung = asyncio.create_task(view.refresh())
    await eventually(lambda: scrapes == 2, "the second scrape sent")
    now += 1.0
    status = admission.status()
    admission.publish()  # what /metrics does before rendering
    page = metrics.render()[0].decode()
    assert status["engine"]["stale"] is True
    assert metric(page, "vllm_guard_engine_metrics_stale") == 1
    assert metric(page, "vllm_guard_engine_metrics_age_seconds") == 1.0
    hung.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await hung
