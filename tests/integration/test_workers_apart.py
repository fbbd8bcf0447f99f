"""``--workers 2 --authority apart``: the admission authority serves no requests of its own; its two worker
processes hold the port and serve every request, and the one admission, the tenants' limits and what
``/metrics`` reports stay one, as with a serving authority.

The authority runs in this process (its parts are inspected directly); the engine is the vLLM simulator, which
allocates KV blocks as vLLM does and counts its own preemptions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimServer
from tests.integration.test_workers import (
    BLOCKS,
    FLOOD,
    _holds,
    _is_worker,
    accepted,
    completion,
    cpu_seconds,
    flood,
    sim_server,  # noqa: F401  (the ``sim`` fixture)
    strict,
    watched_flood,
)


@pytest.fixture(scope="module")
def gateway(sim: SimServer, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    with run_gateway(strict(tokenizer_dir), upstream=sim.url, workers="2", authority="apart") as gw:
        yield gw


def worker_pids() -> list[int]:
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_worker(int(p)))


def served_by_authority(gw: GatewayServer) -> float:
    """The requests the authority's own request path answered (its metrics before the workers' are added)."""
    return float(gw.parts.metrics.requests.labels("completions", "ok")._value.get())


def test_the_authority_apart_accepts_no_connection_on_the_port(gateway: GatewayServer) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    workers = worker_pids()
    assert len(workers) == 2 and gateway.parts.authority is not None and gateway.parts.authority.serving() == 2

    async def holders() -> list[int]:
        found = []
        for _ in range(16):
            _, writer, inode = await accepted(port)
            found += [pid for pid in (os.getpid(), *workers) if _holds(pid, inode)]
            writer.close()
        return found

    held = asyncio.run(holders())
    assert len(held) == 16 and os.getpid() not in held
    assert set(held) <= set(workers)


def test_its_workers_serve_every_request_within_one_budget(gateway: GatewayServer, sim: SimServer) -> None:
    workers = worker_pids()
    before = [cpu_seconds(pid) for pid in workers]
    own, preempted = served_by_authority(gateway), sim.sim.preemptions_total
    answers, peak = watched_flood(gateway)
    assert [r.status_code for r in answers] == [200] * FLOOD
    assert all(cpu_seconds(pid) > was for pid, was in zip(workers, before, strict=True))
    assert served_by_authority(gateway) == own, "the authority apart answered a request itself"
    assert peak <= int(0.9 * BLOCKS) and sim.sim.preemptions_total == preempted  # strict: one ledger for all
    gateway.wait_ledger_empty()


def test_its_own_routes_answer_through_the_workers(gateway: GatewayServer) -> None:
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    assert "vllm_guard_requests_total" in text
    assert httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"


def test_while_a_worker_restarts_the_other_serves(gateway: GatewayServer) -> None:
    authority = gateway.parts.authority
    assert authority is not None
    victim, survivor = worker_pids()
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while authority.serving() > 1 or victim in worker_pids():  # its channel closed and the process reaped
        assert time.monotonic() < deadline, "the killed worker's end was not noticed"
        time.sleep(0.02)
    answers = asyncio.run(flood(gateway.url, 8, completion()))
    assert [r.status_code for r in answers] == [200] * 8
    gateway.wait_ledger_empty(timeout=10.0)
    gateway.wait_workers(2, timeout=60.0)
    assert survivor in worker_pids() and len(worker_pids()) == 2
