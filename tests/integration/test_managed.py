"""The gateway in managed mode, over HTTP, in front of a vLLM-like child (testing/fake_vllm.py) that
it starts, watches and restarts itself: 503 with Retry-After while the engine starts, /guard/status and
POST /guard/restart, a killed engine restarted under load without failing a request, no process left
behind when the gateway stops.

The gateway runs in a thread (testing/gateway_thread.py). The guardian's PR_SET_PDEATHSIG follows the thread that
forked it, which is the gateway's event-loop thread here: it lives until the gateway has stopped its
engine, so the thread changes nothing (the last test checks that stopping leaves no process).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from gateway.managed.guardian import group_pids
from testing.gateway_thread import GatewayServer, run_gateway
from tests.support.paths import FAKE_VLLM
from tests.support.procs import alive

FAKE = FAKE_VLLM
MODEL = "fake-model"
CLIENT_KEY = "client-key"
ADMIN_KEY = "admin-key"
AS_CLIENT = {"Authorization": f"Bearer {CLIENT_KEY}"}
AS_ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
COMPLETION = {"model": MODEL, "prompt": "Tell me about supervisors.", "max_tokens": 8}


def managed(base: Settings, state: Path, *fake: str, **kw: Any) -> Settings:
    command = [sys.executable, str(FAKE), "--fake-state-dir", str(state), *fake]
    values = base.model_dump() | {
        "managed": True, "model": MODEL, "vllm_command": shlex.join(command), "startup_timeout": 20.0,
        "hang_timeout": 2.0, "drain_timeout": 2.0, "queue_timeout": 20.0,
        "api_key": [CLIENT_KEY], "admin_api_key": [ADMIN_KEY],
    } | kw
    return Settings.model_validate(values)


def eventually(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def status(gw: GatewayServer) -> dict[str, Any]:
    r = httpx.get(gw.url + "/guard/status", headers=AS_CLIENT, timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def ready(gw: GatewayServer) -> bool:
    return bool(status(gw)["upstream"]["state"] == "ready")


def launches(state: Path) -> int:
    return int((state / "launches").read_text())


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "fake-state"


def test_requests_get_503_with_retry_after_while_the_engine_starts_then_succeed(
    base_settings: Settings, state: Path, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    with run_gateway(managed(base_settings, state, "--fake-hold", str(hold))) as gw:
        r = httpx.post(gw.url + "/v1/completions", json=COMPLETION, headers=AS_CLIENT, timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "upstream_starting"
        assert r.json()["error"]["type"] == "server_error"
        assert float(r.headers["retry-after"]) >= 1
        health = httpx.get(gw.url + "/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["upstream"]["state"] == "starting"

        hold.unlink()
        eventually(lambda: ready(gw))
        r = httpx.post(gw.url + "/v1/completions", json=COMPLETION, headers=AS_CLIENT, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith("ok")
        assert int(r.headers["x-guard-prompt-tokens"]) > 0
        assert httpx.get(gw.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, 401),
        (AS_CLIENT, 401),
        ({"Authorization": "Bearer wrong"}, 401),
    ],
)
def test_restart_without_the_admin_key_is_refused(
    base_settings: Settings, state: Path, headers: dict[str, str], expected: int
) -> None:
    with run_gateway(managed(base_settings, state)) as gw:
        eventually(lambda: ready(gw))
        r = httpx.post(gw.url + "/guard/restart", headers=headers, timeout=10)
        assert r.status_code == expected
        assert r.json()["error"]["type"] == "authentication_error"
        assert status(gw)["restarts"] == 0
        assert launches(state) == 1


def test_restart_with_the_admin_key_restarts_the_engine_and_status_says_so(
    base_settings: Settings, state: Path
) -> None:
    with run_gateway(managed(base_settings, state)) as gw:
        eventually(lambda: ready(gw))
        before = status(gw)
        up = before["upstream"]
        assert (up["state"], up["restarts"], up["last_restart_reason"], up["max_model_len"]) == (
            "ready", 0, None, 32768,
        )
        # The engine reports 32 blocks; one is vLLM's null block, which no request can hold.
        assert before["capacity_blocks"] == 31 and before["block_size"] == 128
        first_pid = before["engine"]["pid"]

        r = httpx.post(gw.url + "/guard/restart", headers=AS_ADMIN, timeout=10)
        assert r.status_code == 202
        eventually(lambda: status(gw)["restarts"] == 1 and ready(gw))
        after = status(gw)
        assert after["upstream"]["last_restart_reason"] == "manual"
        assert after["engine"]["restarts_by_reason"] == {"manual": 1}
        assert after["engine"]["pid"] != first_pid
        assert not alive(first_pid)
        assert launches(state) == 2
        r = httpx.post(gw.url + "/v1/completions", json=COMPLETION, headers=AS_CLIENT, timeout=10)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("death", ["killed", "engine-dead"])
async def test_an_engine_dying_under_load_is_restarted_without_failing_a_request(
    base_settings: Settings, state: Path, tmp_path: Path, death: str
) -> None:
    # killed: SIGKILL of the API server (connections reset); engine-dead: the API server stays up and answers
    # 500 "EngineCore encountered an issue" (vLLM 0.32) until the gateway restarts it.
    trigger = tmp_path / "die"
    fake = ["--fake-request-seconds", "0.3"]
    if death == "engine-dead":
        fake += ["--fake-scenario", "engine-dead", "--fake-on", "1", "--fake-trigger", str(trigger)]
    # A hang bound well above the fake's request time: on a loaded machine a 2 s bound can fire before the
    # death is read from the log, and this test is about the death.
    with run_gateway(managed(base_settings, state, *fake, hang_timeout=10.0)) as gw:
        await asyncio.to_thread(eventually, lambda: ready(gw))
        answers: list[int] = []
        stop = asyncio.Event()

        async def client(http: httpx.AsyncClient) -> None:
            while not stop.is_set():
                r = await http.post("/v1/completions", json=COMPLETION, headers=AS_CLIENT)
                answers.append(r.status_code)

        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            clients = [asyncio.create_task(client(http)) for _ in range(4)]
            await asyncio.to_thread(eventually, lambda: len(answers) >= 4 and status(gw)["in_flight"] > 0)
            victim = status(gw)["engine"]["pid"]
            if death == "killed":
                os.kill(victim, signal.SIGKILL)
            else:
                trigger.touch()
            await asyncio.to_thread(eventually, lambda: status(gw)["restarts"] == 1 and ready(gw))
            done_at_restart = len(answers)
            await asyncio.to_thread(eventually, lambda: len(answers) >= done_at_restart + 8)
            stop.set()
            await asyncio.gather(*clients)

        assert set(answers) == {200}, answers
        after = status(gw)
        assert after["upstream"]["last_restart_reason"] == "exit"
        assert launches(state) == 2
        assert not alive(victim)
        # Every reservation, the retried ones included, was given back.
        assert (after["committed_blocks"], after["in_flight"], after["queued"]) == (0, 0, 0)


def test_stopping_the_gateway_leaves_no_engine_process(base_settings: Settings, state: Path) -> None:
    with run_gateway(managed(base_settings, state, "--fake-scenario", "grandchild")) as gw:
        eventually(lambda: ready(gw))
        engine = status(gw)["engine"]
        pid, pgid = engine["pid"], engine["pgid"]
        grandchild = int((state / "grandchild-1").read_text())
        assert alive(pid) and alive(pgid) and alive(grandchild)
    # SIGKILL is delivered asynchronously: give the kernel a moment to finish the exits.
    eventually(lambda: not alive(pid) and not alive(grandchild), timeout=5.0)
    assert group_pids(pgid) == []
