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
from tests.support.harness import GatewayServer, run_gateway
from tests.support.vllm_sim import SimConfig, SimServer, run_sim_server

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
    with run_gateway(base_settings, upstream=sim.url, max_concurrency=1, fair_queueing=fair) as gw:
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
