"""Deadlines through the real gateway in front of the vLLM simulator: a client's own deadline (x-guard-deadline-ms,
or the OpenAI SDKs' x-stainless-read-timeout) shorter than --queue-timeout ends its wait with 503 deadline and a
Retry-After; a bad deadline header is a 400 naming it; a request's own TTFT objective (the llm-d router's
x-llm-d-slo-ttft-ms) judges it as it arrives, as --ttft-objective does; a queued request whose client has gone never
reaches the engine (test_admission_flood's test_a_client_that_disconnects_while_queued_leaves_the_queue)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from testing.gateway_thread import GatewayServer
from testing.vllm_sim import SimServer
from tests.integration import test_admission_flood as flood_rig
from tests.integration import test_overload as overload_rig
from tests.integration.test_admission_flood import (
    HOLDER,
    QUEUE_RIG,
    WAITER,
    completion,
    eventually,
    held_reservation,
)

exits, make_sim, make_gateway = flood_rig.exits, flood_rig.make_sim, flood_rig.make_gateway
rig = overload_rig.rig


@pytest.mark.parametrize(
    ("headers", "deadline"),
    [({"x-guard-deadline-ms": "400"}, 0.4), ({"x-stainless-read-timeout": "0.4"}, 0.4)],
    ids=["x-guard-deadline-ms", "x-stainless-read-timeout"],
)
async def test_a_client_deadline_shorter_than_the_queue_timeout_ends_the_wait_with_503_deadline(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer], headers: dict[str, str],
    deadline: float,
) -> None:
    sim = make_sim(**QUEUE_RIG)
    gw = make_gateway(sim, admission_policy="strict", kv_target=1.0, queue_timeout=30.0)
    async with httpx.AsyncClient(timeout=10.0) as client, held_reservation(client, gw, sim, *HOLDER):
        seen = sim.sim.request_count
        t0 = time.monotonic()
        r = await client.post(gw.url + "/v1/completions", json=completion(*WAITER), headers=headers)
        waited = time.monotonic() - t0
        assert sim.sim.request_count == seen  # it never reached the engine
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "deadline")
    assert int(r.headers["retry-after"]) >= 1
    assert deadline <= waited < 5.0  # its own deadline, not the 30 s queue timeout


async def test_a_bad_deadline_header_is_a_400_naming_it(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    gw = make_gateway(make_sim())
    async with httpx.AsyncClient(timeout=10.0) as client:
        r = await client.post(gw.url + "/v1/completions", json=completion(16, 8),
                              headers={"x-guard-deadline-ms": "soon"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "x-guard-deadline-ms")


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({"x-guard-deadline-ms": "0.0001"}, 400, "deadline_too_short"),
        ({"x-stainless-read-timeout": "0.0001"}, 400, "deadline_too_short"),
        ({"x-guard-deadline-ms": "0.5", "x-stainless-read-timeout": "600"}, 400, "deadline_too_short"),
        ({"x-guard-deadline-ms": "1"}, 200, None),  # at the floor: an idle engine takes it at once
        ({"x-stainless-read-timeout": "0.001"}, 200, None),
    ],
    ids=["0.0001 ms", "0.0001 s read timeout", "0.5 ms beside the SDK's own", "1 ms", "1 ms read timeout"],
)
async def test_a_deadline_no_engine_can_meet_is_a_400_naming_the_header_and_the_floor_even_on_an_idle_engine(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer], headers: dict[str, str],
    status: int, code: str | None,
) -> None:
    """A 503 said "retry later" to a deadline of 0.0001 ms on an idle engine; the OpenAI SDKs retried it in vain."""
    sim = make_sim()
    gw = make_gateway(sim)
    async with httpx.AsyncClient(timeout=10.0) as client:
        r = await client.post(gw.url + "/v1/completions", json=completion(16, 8), headers=headers)
    assert r.status_code == status, r.text
    if code is None:
        return
    error = r.json()["error"]
    header = next(iter(headers))
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, header)
    assert "the least any engine can meet" in error["message"] and "retry-after" not in r.headers
    assert sim.sim.request_count == 0  # it never reached the engine


OBJECTIVE = "x-llm-d-slo-ttft-ms"


async def test_the_llm_d_routers_ttft_objective_refuses_at_arrival_what_the_engine_cannot_serve_within_it(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    """Four streams in flight got their first tokens after an engine step of 0.25 s: a request whose own objective is
    100 ms is refused as it arrives (503 deadline, Retry-After) and never reaches the engine; without the header, or
    with an objective the engine can meet, the same request is served."""
    sim = make_sim(token_delay=0.25)
    gw = make_gateway(sim)
    async with httpx.AsyncClient(timeout=30.0) as client:
        first_tokens: list[asyncio.Event] = [asyncio.Event() for _ in range(4)]

        async def stream(i: int) -> None:
            body = completion(16, 64, stream=True, user=f"stream-{i}")
            async with client.stream("POST", gw.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if '"text"' in line:
                        first_tokens[i].set()

        streams = [asyncio.create_task(stream(i)) for i in range(4)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_tokens)), 20.0)
            await eventually(lambda: gw.status()["deadlines"]["engine_first_token_s"] is not None,
                             "the engine's time to a first token learned")
            assert gw.status()["deadlines"]["engine_first_token_s"] >= 0.2
            seen = sim.sim.request_count
            refused = await client.post(gw.url + "/v1/completions", json=completion(16, 2),
                                        headers={OBJECTIVE: "100"})
            assert sim.sim.request_count == seen  # it never reached the engine
            served = [
                await client.post(gw.url + "/v1/completions", json=completion(16, 2), headers=headers)
                for headers in ({}, {OBJECTIVE: "20000"})
            ]
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "deadline")
    assert "to a first token now" in error["message"] and int(refused.headers["retry-after"]) >= 1
    assert [r.status_code for r in served] == [200, 200], [r.text for r in served]


async def test_a_request_its_own_objective_queued_is_served_past_it_not_refused(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    """An objective is no deadline: once queued, the request waits on (here past its 200 ms) and is served."""
    sim = make_sim(**QUEUE_RIG)
    gw = make_gateway(sim, admission_policy="strict", kv_target=1.0, queue_timeout=30.0)
    async with httpx.AsyncClient(timeout=10.0) as client:
        async with held_reservation(client, gw, sim, *HOLDER):
            waiting = asyncio.create_task(client.post(gw.url + "/v1/completions", json=completion(*WAITER),
                                                      headers={OBJECTIVE: "200"}))
            await eventually(lambda: gw.status()["queued"] == 1, "the request queued")
            await asyncio.sleep(0.6)  # past its objective
            assert not waiting.done() and gw.status()["queued"] == 1
        served = await waiting
    assert served.status_code == 200, served.text
    assert float(served.headers["x-guard-queue-ms"]) >= 500


@pytest.mark.parametrize(
    ("raw", "code"), [("0", None), ("-5", None), ("nan", None), ("1e12", None), ("0.5", "deadline_too_short")]
)
async def test_an_objective_header_out_of_bounds_is_a_400_naming_it(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer], raw: str, code: str | None
) -> None:
    sim = make_sim()
    gw = make_gateway(sim)
    async with httpx.AsyncClient(timeout=10.0) as client:
        r = await client.post(gw.url + "/v1/completions", json=completion(16, 8), headers={OBJECTIVE: raw})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", OBJECTIVE)
    assert code is None or error["code"] == code
    assert sim.sim.request_count == 0


async def test_under_sustained_overload_the_ttft_objective_keeps_admitted_requests_within_it(
    rig: Callable[..., GatewayServer],
) -> None:
    """The overload of test_overload (about three times what the engine serves) with --ttft-objective 1: every
    request is refused with 503 deadline as it arrives or, queued, as soon as its wait and the engine's time to a
    first token pass the objective; the rest are answered within it."""
    objective = 1.0
    gw = rig(ttft_objective=objective)
    await overload_rig.overload(gw.url, 12, float("inf"))  # releases to learn the rate from
    answers = await overload_rig.overload(gw.url)
    counted = overload_rig.codes(answers)
    assert set(counted) <= {"ok", "deadline"} and counted.get("ok", 0) >= 8 and counted.get("deadline", 0) >= 8, (
        counted
    )
    waits = sorted(float(r.headers["x-guard-queue-ms"]) for r, _ in answers if r.status_code == 200)
    # The forecast's margin at arrival: most are served within the objective. Its forecast is of a shared host's
    # engine, so the quartile is allowed a fifth more (a CI run gave 1,044 ms for 1,000 once, the rest within).
    assert waits[len(waits) * 3 // 4] <= 1200 * objective, waits
    assert waits[-1] <= 1200 * objective, waits  # a queued request known to be late is refused, not served late
    refused = sorted(seconds for r, seconds in answers if r.status_code != 200)
    assert all(int(r.headers["retry-after"]) >= 1 for r, _ in answers if r.status_code != 200)
    assert refused[len(refused) // 3] < objective / 2, refused  # a third or more at arrival (about half, seen)
    assert refused[-1] < 1.5 * objective, refused  # the rest once known late: within the objective, and a pass's slack
