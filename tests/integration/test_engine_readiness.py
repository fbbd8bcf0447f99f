"""What /health knows, admission knows (proxy mode, in front of the simulator): once the gateway's /health says
the engine is not ready (its own /health answering 503 as vLLM's does once its engine core died, its /metrics
failing; a frozen engine, hung: tests/integration/test_hung_engine.py), a new request is refused at once with
503 and Retry-After and never sent into it; once the engine is well again, both serve again. With several
engines, placement skips the one that is not ready and the others serve (no failover needed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from testing.gateway_thread import run_gateway
from testing.vllm_sim import Fault, SimConfig, run_sim_server
from tests.integration.test_engines import body, engines_of, get, pair, send


@dataclass(frozen=True)
class Condition:
    name: str
    apply: Callable[[SimConfig], None]
    heal: Callable[[SimConfig], None]


def _set(**fields: Any) -> Callable[[SimConfig], None]:
    def apply(config: SimConfig) -> None:
        for name, value in fields.items():
            setattr(config, name, value)

    return apply


CONDITIONS = [
    Condition("its own /health answers 503 (engine core dead)", _set(fault=Fault.ENGINE_DEAD), _set(fault=None)),
    Condition("its /metrics fails", _set(metrics_status=500), _set(metrics_status=None)),
    Condition("its /metrics is not found", _set(metrics_status=404), _set(metrics_status=None)),
]


def wait_for_health(client: httpx.Client, status: int, limit: float) -> float:
    t0 = time.monotonic()
    while (answer := client.get("/health")).status_code != status:
        assert time.monotonic() - t0 < limit, f"/health did not answer {status} within {limit} s: {answer.text}"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("condition", CONDITIONS, ids=[c.name for c in CONDITIONS])
def test_once_health_says_the_engine_is_not_ready_a_new_request_is_refused_at_once_and_never_sent(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings, condition: Condition
) -> None:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_model_len=512)
    with run_sim_server(config) as sim, run_gateway(base_settings, upstream=sim.url) as gw, httpx.Client(
        base_url=gw.url, timeout=30
    ) as client:
        assert client.post("/v1/completions", json=body(0)).status_code == 200
        condition.apply(sim.sim.config)
        took = wait_for_health(client, 503, 10.0)
        assert client.get("/health").json()["upstream"]["state"] == "down", f"after {took:.1f} s"
        seen = sim.sim.request_count
        for _ in range(3):
            t0 = time.monotonic()
            refused = client.post("/v1/completions", json=body(1))
            assert time.monotonic() - t0 < 1.0, "a new request waited on an engine /health says is not ready"
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["type"] == "server_error"
        assert sim.sim.request_count == seen, "a request was sent into the engine"
        condition.heal(sim.sim.config)
        wait_for_health(client, 200, 10.0)
        assert client.post("/v1/completions", json=body(2)).status_code == 200
        gw.wait_ledger_empty()


@pytest.mark.parametrize("condition", CONDITIONS[:2], ids=[c.name for c in CONDITIONS[:2]])
async def test_with_several_engines_the_one_not_ready_takes_nothing_and_the_others_serve(
    tokenizer: Any, tokenizer_dir: Path, base_settings: Settings, condition: Condition
) -> None:
    with pair(tokenizer, tokenizer_dir, base_settings) as p:
        failing = p.sims[1]
        condition.apply(failing.sim.config)

        async def row_down() -> bool:
            rows = (await get(p.gw, "/guard/status")).json()["engines"]
            return [r["state"] for r in rows] == ["ready", "down"]

        t0 = time.monotonic()
        while not await row_down():
            assert time.monotonic() - t0 < 10.0, "the failing engine's row never said down"
            await asyncio.sleep(0.02)
        seen = failing.sim.request_count
        answers = await send(p.gw, [body(i) for i in range(8)])
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
        assert engines_of(answers) == {"0": 8}
        assert failing.sim.request_count == seen  # placed elsewhere at once: not even tried and failed over
        assert (await get(p.gw, "/health")).status_code == 200
        p.gw.wait_ledger_empty()
