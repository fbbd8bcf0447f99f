"""Fair queueing end to end: two tenants share the real gateway in front of the vLLM simulator.

One tenant floods long requests, the other sends a few short ones after the flood has filled the queue. The
gateway admits one request at a time (``--max-concurrency 1``), so the order the engine finishes them is the
order the queue chose. The requests enter through the guard's request path with the tenant already resolved
(the ``RequestContext`` the HTTP layer builds from the caller's key).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from gateway.guard.context import RequestContext
from gateway.guard.parts import Parts
from gateway.guard.pipeline import handle
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

FLOOD, QUIET = 6, 3
FLOOD_OUTPUT, QUIET_OUTPUT = 96, 4


@pytest.fixture
def sim(tokenizer: Any, tokenizer_dir: Path) -> Iterator[SimServer]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_model_len=512,
                       token_delay=0.002)
    with run_sim_server(config) as server:
        yield server


@contextlib.contextmanager
def gateway(base_settings: Settings, sim: SimServer, fair: str) -> Iterator[GatewayServer]:
    # strict: arrival order within a tenant's lane (the default policy also puts shorter work first).
    with run_gateway(
        base_settings, upstream=sim.url, max_concurrency=1, fair_queueing=fair, admission_policy="strict"
    ) as gw:
        yield gw


async def complete(parts: Parts, tenant: str, name: str, max_tokens: int, weight: float = 1.0) -> str:
    """One completion through the guard's request path, as ``tenant``; returns ``name`` once answered."""
    prompt = [10 + len(name) + i for i in range(12)] + [ord(c) for c in name]  # no prefix shared across requests
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    ctx = RequestContext(name, "completions", "/v1/completions", body, tenant=tenant, tenant_weight=weight)
    async for reply in handle(parts, ctx):
        assert reply.body is not None and b'"completion_tokens"' in reply.body
    return name


async def until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:g} s: {what}")
        await asyncio.sleep(0.005)


async def flood_then_trickle(gw: GatewayServer) -> list[str]:
    """The flood fills the queue, then the quiet tenant's requests arrive; the names in the order answered."""
    finished: list[str] = []

    def send(tenant: str, name: str, max_tokens: int) -> asyncio.Future[str]:
        future = asyncio.run_coroutine_threadsafe(complete(gw.parts, tenant, name, max_tokens), gw.loop)
        future.add_done_callback(lambda f: finished.append(f.result()))
        return asyncio.wrap_future(future)

    sent = [send("flood", f"f{i}", FLOOD_OUTPUT) for i in range(FLOOD)]
    await until(lambda: gw.status()["queued"] == FLOOD - 1, "the flood waits in the queue")
    sent += [send("quiet", f"q{i}", QUIET_OUTPUT) for i in range(QUIET)]
    await until(lambda: gw.status()["queued"] == FLOOD - 1 + QUIET, "the quiet requests wait too")
    await asyncio.gather(*sent)
    return finished


@pytest.mark.parametrize(
    ("fair", "expected"),
    [
        # The quiet tenant is lifted to the flood's counter, and the flood's long outputs cost it more: the
        # quiet requests go as soon as the request in flight ends.
        ("on", ["f0", "q0", "q1", "q2", "f1", "f2", "f3", "f4", "f5"]),
        ("off", ["f0", "f1", "f2", "f3", "f4", "f5", "q0", "q1", "q2"]),  # one line, first come first served
    ],
)
async def test_a_quiet_tenant_is_not_stuck_behind_a_flood(
    base_settings: Settings, sim: SimServer, fair: str, expected: list[str]
) -> None:
    with gateway(base_settings, sim, fair) as gw:
        assert await flood_then_trickle(gw) == expected
        assert gw.status()["fair_queueing"] is (fair == "on")


async def test_guard_status_shows_each_tenants_counter_and_queue(base_settings: Settings, sim: SimServer) -> None:
    with gateway(base_settings, sim, "on") as gw:
        seen: dict[str, Any] = {}

        async def watch() -> None:
            async with httpx.AsyncClient(timeout=5.0) as client:
                while True:
                    tenants = (await client.get(gw.url + "/guard/status")).json()["tenants"]
                    if tenants.get("quiet", {}).get("queued") == QUIET:
                        seen.update(tenants)
                        return
                    await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        await flood_then_trickle(gw)
        await asyncio.wait_for(watcher, 5.0)
        assert set(seen) == {"flood", "quiet"}
        assert seen["flood"]["queued"] == FLOOD - 1 and seen["flood"]["weight"] == 1.0
        assert seen["quiet"]["counter"] == seen["flood"]["counter"] > 0  # lifted: no credit for its idle time
        final = gw.status()["tenants"]
        assert final["flood"]["queued"] == final["quiet"]["queued"] == 0
        # Served tokens per tenant (prompt x 1 + output x 2): the flood received far more, all of it counted.
        assert final["flood"]["counter"] > FLOOD * FLOOD_OUTPUT * 2 > final["quiet"]["counter"]


async def test_tenants_named_by_the_keys_file_take_turns_over_http(
    base_settings: Settings, sim: SimServer, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "tenants:\n"
        "  flood: {weight: 1, keys: [k-flood]}\n"
        "  quiet: {weight: 2, keys: [k-quiet]}\n",
        encoding="utf-8",
    )
    with run_gateway(base_settings, upstream=sim.url, max_concurrency=1, keys_file=str(keys)) as gw:
        finished: list[str] = []
        limits = httpx.Limits(max_connections=FLOOD + QUIET)
        async with httpx.AsyncClient(timeout=10.0, limits=limits) as client:

            async def send(key: str, name: str, max_tokens: int) -> None:
                body = {"model": "tiny", "prompt": [ord(c) for c in name] * 6, "max_tokens": max_tokens,
                        "ignore_eos": True}
                answer = await client.post(gw.url + "/v1/completions", json=body,
                                           headers={"authorization": f"Bearer {key}"})
                assert answer.status_code == 200, answer.text
                finished.append(name)

            sent = [asyncio.create_task(send("k-flood", f"f{i}", FLOOD_OUTPUT)) for i in range(FLOOD)]
            await until(lambda: gw.status()["queued"] == FLOOD - 1, "the flood waits in the queue")
            sent += [asyncio.create_task(send("k-quiet", f"q{i}", QUIET_OUTPUT)) for i in range(QUIET)]
            await until(lambda: gw.status()["queued"] == FLOOD - 1 + QUIET, "the quiet requests wait too")
            assert gw.status()["tenants"]["quiet"]["weight"] == 2.0
            await asyncio.gather(*sent)
    # Which flood request reaches the gateway first is the network's choice: compare tenants, not requests.
    assert [name[0] for name in finished] == ["f", "q", "q", "q", "f", "f", "f", "f", "f"]


# -- the headroom for active tenants -----------------------------------------------------------------------
BLOCK = 16  # the simulator's block size; its 32 blocks hold four flood requests of 8 blocks
FLOOD_BLOCKS = 8
AT_ONCE = 0.05  # seconds: the gateway's own time, where a wait for a flood request to end takes ~1 s


@pytest.fixture
def slow_sim(tokenizer: Any, tokenizer_dir: Path) -> Iterator[SimServer]:
    """32 blocks of 16 tokens, no prefix caching, and tokens slow enough that a flood request lasts ~1 s."""
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_model_len=512,
                       token_delay=0.01, prefix_caching=False)
    with run_sim_server(config) as server:
        yield server


async def sized(parts: Parts, tenant: str, name: str, blocks: int) -> float:
    """A completion booking exactly ``blocks`` blocks, as ``tenant``; returns the seconds it queued."""
    prompt = [10 + len(name) + i for i in range(BLOCK // 2 - len(name))] + [ord(c) for c in name]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": blocks * BLOCK - len(prompt), "ignore_eos": True}
    ctx = RequestContext(name, "completions", "/v1/completions", body, tenant=tenant)
    queue_ms = None
    async for reply in handle(parts, ctx):
        queue_ms = float(reply.headers["x-guard-queue-ms"])
    assert queue_ms is not None
    return queue_ms / 1000


@pytest.mark.parametrize(("headroom", "flood_in_flight"), [("on", 3), ("off", 4)])
async def test_a_quiet_tenant_is_admitted_at_once_while_a_flood_keeps_the_engine_busy(
    base_settings: Settings, slow_sim: SimServer, headroom: str, flood_in_flight: int
) -> None:
    with run_gateway(base_settings, upstream=slow_sim.url, admission_policy="strict", tenant_headroom=headroom) as gw:

        def send(tenant: str, name: str, blocks: int) -> asyncio.Future[float]:
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(sized(gw.parts, tenant, name, blocks), gw.loop))

        assert await send("quiet", "q0", 1) < AT_ONCE  # the quiet tenant is active from now on
        flood = [send("flood", f"f{i}", FLOOD_BLOCKS) for i in range(6)]
        await until(lambda: gw.status()["queued"] == 6 - flood_in_flight, "the flood fills the engine")
        status = gw.status()
        assert (status["in_flight"], status["committed_blocks"]) == (flood_in_flight, flood_in_flight * FLOOD_BLOCKS)
        assert status["tenants"]["quiet"]["headroom_blocks"] == (1 if headroom == "on" else 0)
        waited = await send("quiet", "q1", 1)
        if headroom == "on":
            assert waited < AT_ONCE and gw.status()["queued"] > 0  # while the flood still waits
        else:
            assert waited > 5 * AT_ONCE  # until a flood request ended (each lasts ~1 s)
        await asyncio.gather(*flood)


async def test_a_lone_tenant_still_uses_the_whole_budget(base_settings: Settings, slow_sim: SimServer) -> None:
    with run_gateway(base_settings, upstream=slow_sim.url, admission_policy="strict") as gw:
        flood = [
            asyncio.wrap_future(asyncio.run_coroutine_threadsafe(sized(gw.parts, "flood", f"f{i}", FLOOD_BLOCKS),
                                                                 gw.loop))
            for i in range(6)
        ]
        await until(lambda: gw.status()["queued"] == 2, "the flood fills the engine")
        status = gw.status()
        assert status["committed_blocks"] == status["budget_blocks"] == 4 * FLOOD_BLOCKS
        assert status["tenant_headroom"] is True and status["tenants"]["flood"]["headroom_blocks"] == 0
        await asyncio.gather(*flood)
