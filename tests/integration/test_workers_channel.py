"""``--workers 2``: the channel between a worker and the admission authority under the faults a user meets.

Requests are named on the channel by the gateway, never by the client's ``x-request-id``: two requests that carry
the same id (a retry reusing it) on one worker are two reservations, each released, and each charged to its
tenant. A worker killed with streams open takes them out of the engine's view at once (no phantom work, no
probes of an idle engine). An authority that freezes turns into prompt 503s with ``Retry-After`` on the worker,
and the worker's ``/health`` says so; once it thaws, what the worker gave up on is freed there. An engine the
authority calls hung is hung in the worker too: its stream there cut, a new request refused at once.

The authority runs in this process (its parts inspected directly); its loop is frozen the way SIGSTOP would
freeze it, by holding its thread. Connections are placed on the process wanted (``connection_on``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server
from tests.integration.test_workers import connection_on, exchange, worker_pid

SOLO, OPEN = "sk-solo-1f2e3d", "sk-open-4c5b6a"
KEYS = f"""\
tenants:
  solo:
    limits: {{concurrent_requests: 1}}
    keys: [{SOLO}]
  open:
    keys: [{OPEN}]
"""
QUEUE_TIMEOUT = 3.0
HANG_TIMEOUT = 2.0


def completion(*, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": "tiny", "prompt": [7] * 16, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


def headers(key: str, rid: str | None = None) -> dict[str, str]:
    out = {"authorization": f"Bearer {key}"}
    if rid is not None:
        out["x-request-id"] = rid
    return out


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    config = SimConfig(model="tiny", max_model_len=2048, num_blocks=1024, block_size=16, token_delay=0.005)
    with run_sim_server(config) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(sim: SimServer, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(KEYS, encoding="utf-8")
    settings = Settings(
        tokenizer=str(tokenizer_dir), scrape_interval=0.05, queue_timeout=QUEUE_TIMEOUT, keys_file=str(keys),
        hang_timeout=HANG_TIMEOUT,
    )
    with run_gateway(settings, upstream=sim.url, workers="2") as gw:
        yield gw


def in_flight(gw: GatewayServer) -> int:
    return int(gw.parts.engine.progress.in_flight)


def wait_for(what: str, ok: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def streamed_whole(answer: tuple[int, dict[str, str], bytes]) -> bool:
    return answer[0] == 200 and b"data: [DONE]" in answer[2]


def test_two_requests_on_a_worker_with_one_id_each_give_their_reservation_back(gateway: GatewayServer) -> None:
    async def both() -> list[tuple[int, dict[str, str], bytes]]:
        conns = [await connection_on(gateway, worker=True) for _ in range(2)]
        body = completion(stream=True, max_tokens=60)
        return await asyncio.gather(*(
            exchange(conn, "POST", "/v1/completions", body, headers(OPEN, "retry-1")) for conn in conns
        ))

    answers = asyncio.run(both())
    assert all(streamed_whole(a) for a in answers), [a[0] for a in answers]
    assert [a[1]["x-request-id"] for a in answers] == ["retry-1", "retry-1"]  # the client's id, as a label
    gateway.wait_ledger_empty(timeout=5.0)


def test_a_tenant_at_its_concurrency_limit_is_refused_whatever_id_the_second_request_reuses(
    gateway: GatewayServer,
) -> None:
    async def both() -> tuple[tuple[int, dict[str, str], bytes], tuple[int, dict[str, str], bytes]]:
        first_conn, second_conn = [await connection_on(gateway, worker=True) for _ in range(2)]
        first = asyncio.create_task(exchange(
            first_conn, "POST", "/v1/completions", completion(stream=True, max_tokens=200),
            headers(SOLO, "same"),
        ))
        await asyncio.to_thread(wait_for, "the first request never ran", lambda: gateway.status()["in_flight"] == 1)
        second = await exchange(second_conn, "POST", "/v1/completions", completion(), headers(SOLO, "same"))
        return await first, second

    first, second = asyncio.run(both())
    assert streamed_whole(first)
    assert second[0] == 429 and b"concurrent requests: limit 1" in second[2], second
    gateway.wait_ledger_empty(timeout=5.0)


def test_a_worker_killed_mid_stream_takes_its_streams_out_of_the_engines_view(gateway: GatewayServer) -> None:
    probes: list[float] = []
    progress = gateway.parts.engine.progress
    real_probe = progress.probe
    assert real_probe is not None

    async def counted(timeout: float) -> bool:
        probes.append(time.monotonic())
        return await real_probe(timeout)

    progress.probe = counted

    async def run() -> None:
        body = completion(stream=True, max_tokens=1500)
        own = await connection_on(gateway, worker=False)
        workers = [await connection_on(gateway, worker=True) for _ in range(3)]
        streams = [asyncio.create_task(exchange(c, "POST", "/v1/completions", body, headers(OPEN))) for c in workers]
        authority_stream = asyncio.create_task(exchange(own, "POST", "/v1/completions", body, headers(OPEN)))
        await asyncio.to_thread(wait_for, "the engine view never saw the four streams", lambda: in_flight(gateway) == 4)
        os.kill(worker_pid(gateway), signal.SIGKILL)
        await asyncio.gather(*streams, return_exceptions=True)
        # The authority's own stream still runs: the engine view counts it, and it alone.
        await asyncio.to_thread(wait_for, "the dead worker's streams stayed in the engine view",
                                lambda: in_flight(gateway) == 1, 3.0)
        assert not authority_stream.done()
        authority_stream.cancel()
        own[1].close()

    try:
        asyncio.run(run())
        wait_for("the engine view kept a stream", lambda: in_flight(gateway) == 0)
        gateway.wait_ledger_empty(timeout=5.0)
        settled = time.monotonic()
        time.sleep(HANG_TIMEOUT * 1.5)  # long past the first probe's time, were there work
        assert [t for t in probes if t > settled] == [], "an idle engine was probed"
        assert in_flight(gateway) == 0
    finally:
        progress.probe = real_probe
    gateway.wait_workers(1, timeout=60.0)


def test_a_frozen_authority_turns_into_prompt_503s_and_the_workers_health_says_so(gateway: GatewayServer) -> None:
    freeze = 10.0

    async def run() -> dict[str, Any]:
        conns = [await connection_on(gateway, worker=True) for _ in range(4)]
        started = time.monotonic()
        gateway.loop.call_soon_threadsafe(time.sleep, freeze)  # the authority's loop stops, as under SIGSTOP

        async def timed(conn: Any, method: str, path: str, body: Any = None, after: float = 0.0) -> Any:
            await asyncio.sleep(after)
            sent = time.monotonic()
            answer = await asyncio.wait_for(exchange(conn, method, path, body, headers(OPEN)), freeze - 1)
            return answer, time.monotonic() - sent, time.monotonic() - started

        waiting, later, health, models = await asyncio.gather(
            timed(conns[0], "POST", "/v1/completions", completion()),
            timed(conns[1], "POST", "/v1/completions", completion(), after=3.0),
            timed(conns[2], "GET", "/health", after=3.0),
            timed(conns[3], "GET", "/v1/models", after=3.0),  # a route the authority answers
        )
        return {"waiting": waiting, "later": later, "health": health, "models": models}

    got = asyncio.run(run())
    (status, head, _), _, at = got["waiting"]
    assert status == 503 and "retry-after" in head and at < QUEUE_TIMEOUT + 3.0, (status, at)
    (status, head, body), took, _ = got["later"]
    assert status == 503 and "retry-after" in head and took < 1.0, (status, took)
    assert b"authority_unresponsive" in body
    (status, head, body), took, _ = got["health"]
    assert status == 503 and took < 1.0 and b'"gateway":"authority_unresponsive"' in body, (status, took, body)
    (status, head, body), took, _ = got["models"]
    assert status == 503 and "retry-after" in head and took < 1.0, (status, took)
    # Thawed: what the worker gave up on is freed there, and the worker admits again.
    gateway.wait_ledger_empty(timeout=freeze + 5.0)

    async def after() -> tuple[int, int]:
        deadline = time.monotonic() + 3.0  # the authority's next heartbeat, at most
        while (healthy := await exchange(await connection_on(gateway, worker=True), "GET", "/health"))[0] != 200:
            assert time.monotonic() < deadline, healthy
            await asyncio.sleep(0.05)
        conn = await connection_on(gateway, worker=True)
        return healthy[0], (await exchange(conn, "POST", "/v1/completions", completion(), headers(OPEN)))[0]

    assert asyncio.run(after()) == (200, 200)


def test_a_hung_engine_cuts_a_workers_stream_and_the_worker_refuses_at_once(gateway: GatewayServer,
                                                                              sim: SimServer) -> None:
    """The authority judges the engine hung; the worker is told (``workers/mirror.py``), cuts the stream it relays
    with the hang's error and refuses a new request at once, as one process does; the engine moving again ends it."""
    async def run() -> tuple[tuple[int, dict[str, str], bytes], tuple[int, dict[str, str], bytes], float]:
        conn = await connection_on(gateway, worker=True)
        body = completion(stream=True, max_tokens=1500)
        stream = asyncio.create_task(exchange(conn, "POST", "/v1/completions", body, headers(OPEN), timeout=60.0))
        await asyncio.to_thread(wait_for, "the stream never reached the engine", lambda: in_flight(gateway) == 1)
        sim.sim.freeze()
        try:
            cut = await stream
            other = await connection_on(gateway, worker=True)
            sent = time.monotonic()
            refused = await exchange(other, "POST", "/v1/completions", completion(), headers(OPEN))
            return cut, refused, time.monotonic() - sent
        finally:
            sim.sim.thaw()

    (status, _, streamed), (refused, head, body), took = asyncio.run(run())
    assert status == 200 and b'"code":"upstream_hung"' in streamed.rsplit(b"data: ", 2)[-2], streamed[-300:]
    assert refused == 503 and "retry-after" in head and b"upstream_hung" in body and took < 3.0, (refused, took)
    gateway.wait_ledger_empty(timeout=10.0)

    async def healthy() -> bool:
        return (await exchange(await connection_on(gateway, worker=True), "GET", "/health"))[0] == 200

    deadline = time.monotonic() + 20.0  # a probe answered: the engine moves again
    while not asyncio.run(healthy()):
        assert time.monotonic() < deadline, "the worker still called the engine hung once it moved"
        time.sleep(0.2)
