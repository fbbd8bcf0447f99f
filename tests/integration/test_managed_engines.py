"""Managed mode with several engines, over HTTP, in front of vLLM-like children (testing/fake_vllm.py):
each engine on its own port with its own devices and supervisor, restarts that roll one engine at a time while
the other serves (asked for, named, or on a schedule), and an engine killed under load restarted while the other
takes its requests. No request is lost and the gateway stays ready throughout.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from tests.integration.test_managed import AS_ADMIN, AS_CLIENT, COMPLETION, eventually, managed, status
from tests.support.procs import alive, environ


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "fake-state"


def two_engines(base: Settings, state: Path, **kw: Any) -> Settings:
    # A hang bound well above the fake's request time, and a drain long enough for its requests to end.
    values: dict[str, Any] = {"engine_devices": "0;1", "hang_timeout": 10.0, "drain_timeout": 5.0} | kw
    return managed(base, state, "--fake-request-seconds", "0.2", **values)


def engines(gw: GatewayServer) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = status(gw)["managed_engines"]
    return rows


def all_ready(gw: GatewayServer) -> bool:
    return all(row["state"] == "ready" for row in engines(gw))


class Load:
    """Client loops sending completions, and a watcher reading /health, until stopped."""

    def __init__(self, gw: GatewayServer) -> None:
        self.gw = gw
        self.answers: list[tuple[int, str | None]] = []
        self.health: list[int] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        self.http = self._http = httpx.AsyncClient(base_url=self.gw.url, timeout=30)
        self._tasks = [asyncio.create_task(self._client()) for _ in range(4)]
        self._tasks.append(asyncio.create_task(self._watch()))
        await asyncio.to_thread(eventually, lambda: len(self.answers) >= 4)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._http.aclose()

    async def until(self, cond: Callable[[], bool], timeout: float = 30.0) -> None:
        await asyncio.to_thread(eventually, cond, timeout)

    async def more(self, count: int) -> None:
        target = len(self.answers) + count
        await self.until(lambda: len(self.answers) >= target)

    async def restart(self, query: str = "") -> httpx.Response:
        return await self._http.post("/guard/restart" + query, headers=AS_ADMIN)

    async def _client(self) -> None:
        while not self._stop.is_set():
            r = await self._http.post("/v1/completions", json=COMPLETION, headers=AS_CLIENT)
            self.answers.append((r.status_code, r.headers.get("x-guard-engine")))

    async def _watch(self) -> None:
        while not self._stop.is_set():
            r = await self._http.get("/health")
            self.health.append(r.status_code)
            await asyncio.sleep(0.05)


async def gauges_of(load: Load) -> dict[str, dict[tuple[str, ...], float]]:
    """``/metrics`` as {sample name: {label values: value}}."""
    text = (await load.http.get("/metrics")).text
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sample.labels.values())] = sample.value
    return out


def test_each_engine_runs_on_its_own_port_with_its_devices_and_takes_requests(
    base_settings: Settings, state: Path
) -> None:
    with run_gateway(two_engines(base_settings, state)) as gw:
        eventually(lambda: all_ready(gw))
        rows = engines(gw)
        assert len({row["url"] for row in rows}) == 2 and len({row["pid"] for row in rows}) == 2
        assert [environ(row["pid"])["CUDA_VISIBLE_DEVICES"] for row in rows] == ["0", "1"]
        assert [row["state"] for row in status(gw)["engines"]] == ["ready", "ready"]
        seen = {
            httpx.post(gw.url + "/v1/completions", json=COMPLETION, headers=AS_CLIENT, timeout=60)
            .headers["x-guard-engine"] for _ in range(6)
        }
        assert seen <= {"0", "1"} and seen
        assert status(gw)["rolling_restart"]["every_seconds"] is None


async def test_a_rolling_restart_under_load_loses_no_request_and_the_gateway_stays_ready(
    base_settings: Settings, state: Path
) -> None:
    with run_gateway(two_engines(base_settings, state)) as gw:
        await asyncio.to_thread(eventually, lambda: all_ready(gw))
        pids = [row["pid"] for row in engines(gw)]
        async with Load(gw) as load:
            r = await load.restart()
            assert r.status_code == 202
            assert r.json() == {"restarting": True, "engines": ["0", "1"], "rolling": True,
                                "already_under_way": False}
            again = await load.restart()
            assert again.json()["already_under_way"] is True
            await load.until(lambda: status(gw)["rolling_restart"]["rounds"] == 1)
            await load.more(8)
        rolled = status(gw)["rolling_restart"]
        assert rolled["last"]["restarted"] == ["0", "1"] and rolled["last"]["skipped"] == {}
        assert [row["restarts_by_reason"] for row in engines(gw)] == [{"manual": 1}, {"manual": 1}]
        assert not any(alive(pid) for pid in pids)
        assert {code for code, _ in load.answers} == {200}, load.answers
        assert set(load.health) == {200}, "an engine was always ready"
        gw.wait_ledger_empty()


async def test_restarting_one_named_engine_leaves_the_other_serving(base_settings: Settings, state: Path) -> None:
    with run_gateway(two_engines(base_settings, state)) as gw:
        await asyncio.to_thread(eventually, lambda: all_ready(gw))
        async with Load(gw) as load:
            unknown = await load.restart("?engine=7")
            assert unknown.status_code == 400
            assert unknown.json()["error"]["param"] == "engine" and "0, 1" in unknown.json()["error"]["message"]
            r = await load.restart("?engine=1")
            assert r.json()["engines"] == ["1"]
            await load.until(lambda: engines(gw)[1]["state"] != "ready")
            during = len(load.answers)
            gauges = await gauges_of(load)
            assert gauges["vllm_guard_upstream_up"] == {(): 1.0}, "ready while engine 0 serves"
            assert {k for k, v in gauges["vllm_guard_engine_state"].items() if v == 1} <= {
                ("0", "ready"), ("1", "draining"), ("1", "restarting"), ("1", "ready"),
            }
            await load.until(lambda: status(gw)["rolling_restart"]["rounds"] == 1)
            restarted_at = len(load.answers)
            await load.more(8)
        assert [row["restarts"] for row in engines(gw)] == [0, 1]
        assert {code for code, _ in load.answers} == {200}
        # While engine 1 was drained and restarted, engine 0 answered (the answers then came from it alone,
        # but for those engine 1 had already admitted before it was held).
        assert len(load.answers) > restarted_at > during
        assert {engine for _, engine in load.answers[during + 4:restarted_at]} == {"0"}
        gw.wait_ledger_empty()


async def test_an_engine_killed_under_load_is_restarted_while_the_other_takes_its_requests(
    base_settings: Settings, state: Path
) -> None:
    with run_gateway(two_engines(base_settings, state)) as gw:
        await asyncio.to_thread(eventually, lambda: all_ready(gw))
        victim = engines(gw)[0]["pid"]
        async with Load(gw) as load:
            os.kill(victim, signal.SIGKILL)
            await load.until(lambda: engines(gw)[0]["restarts"] == 1 and all_ready(gw))
            await load.more(8)
        rows = engines(gw)
        assert rows[0]["last_restart_reason"] == "exit" and rows[1]["restarts"] == 0
        assert {code for code, _ in load.answers} == {200}, load.answers
        assert set(load.health) == {200}
        gw.wait_ledger_empty()


async def test_restart_every_rolls_the_engines_on_its_schedule(base_settings: Settings, state: Path) -> None:
    with run_gateway(two_engines(base_settings, state, restart_every="2s")) as gw:
        await asyncio.to_thread(eventually, lambda: all_ready(gw))
        assert status(gw)["rolling_restart"]["every_seconds"] == 2.0
        async with Load(gw) as load:
            await load.until(lambda: status(gw)["rolling_restart"]["rounds"] >= 1)
            await load.more(4)
        last = status(gw)["rolling_restart"]["last"]
        assert last["reason"] == "scheduled" and last["restarted"] == ["0", "1"]
        assert {code for code, _ in load.answers} == {200}
        assert set(load.health) == {200}


async def test_when_the_first_engine_never_starts_the_second_serves_alone(base_settings: Settings, state: Path) -> None:
    settings = managed(
        base_settings, state, "--fake-request-seconds", "0.2", "--fake-scenario", "crash-at-start",
        "--fake-devices", "0", engine_devices="0;1", max_restarts=0, autofit_attempts=0,
    )
    with run_gateway(settings) as gw:
        # Generous: a loaded machine once took the second engine past 20 s to come up beside the first's failure.
        await asyncio.to_thread(
            eventually, lambda: [row["state"] for row in engines(gw)] == ["down", "ready"], 90.0
        )
        async with Load(gw) as load:
            await load.more(8)
            models = await load.http.get("/v1/models", headers=AS_CLIENT)
        assert {answer for answer in load.answers} == {(200, "1")}
        assert set(load.health) == {200}
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
        gw.wait_ledger_empty()
