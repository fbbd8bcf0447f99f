"""Managed mode against a real vLLM (CPU build): ``vllm-guard serve --managed`` starts a 32K-context tiny
model on a 4,096-token KV cache by auto-fitting max_model_len to vLLM's own estimate, restarts the engine
when its EngineCore is killed under load without losing a request, and restarts it when it hangs.

One managed gateway (one vLLM at a time) serves the whole file, in order; every process it started is
gone afterwards, also when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.managed.guardian import group_pids
from testing.servers import (
    DEFAULT_KV_CACHE_BYTES,
    VENV_BIN,
    ServerProcess,
    ensure_tiny_model,
    free_port,
    vllm_unavailable_reason,
)
from tests.support.procs import alive as _alive

pytestmark = pytest.mark.e2e

NATIVE_CONTEXT = 32768
BLOCK_SIZE = 128  # vLLM's CPU backend
KEY = "managed-e2e-key"
ADMIN_KEY = "managed-e2e-admin"
ENGINE_CORE_NICE = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)  # raising a niceness needs no privilege
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVED = "tiny-managed"
HANG_TIMEOUT = 10
# Two vLLM start-ups for the auto-fit, one per restart: 45-90 s each on a busy 2-core machine.
START_TIMEOUT = 400.0
RESTART_TIMEOUT = 300.0
COMPLETION = {"model": SERVED, "prompt": "The supervisor keeps the engine alive.", "max_tokens": 16,
              "temperature": 0}


class Managed:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.url = server.url
        self.pgids: set[int] = set()

    def status(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/guard/status", headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        if body["engine"]["pgid"] is not None:
            self.pgids.add(int(body["engine"]["pgid"]))
        return body

    def wait(self, cond: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if cond(status):
                return status
            if time.monotonic() > deadline or not self.server.alive():
                pytest.fail(f"{what}: not within {timeout:g} s; status {status}\n{self.server.log_tail(60)}")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def managed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Managed]:
    if reason := vllm_unavailable_reason():
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("managed-e2e")
    with (logs / "tinymodel.log").open("w", encoding="utf-8") as log:
        model = ensure_tiny_model(NATIVE_CONTEXT, log=log)
    script = VENV_BIN / "vllm-guard"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]
    port = free_port()
    argv = [
        *command, "serve", "--managed", "--model", str(model), "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(port), "--vllm-port", str(free_port()),
        "--vllm-command", sys.executable, "--api-key", KEY, "--admin-api-key", ADMIN_KEY,
        "--startup-timeout", str(START_TIMEOUT), "--hang-timeout", str(HANG_TIMEOUT), "--drain-timeout", "10",
        # Requests queued during a restart must outlast a whole vLLM start-up.
        "--queue-timeout", "400",
        "--engine-core-nice", str(ENGINE_CORE_NICE),
        "--", "--dtype", "float32", "--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES),
    ]  # fmt: skip
    server = ServerProcess("managed gateway", argv, port, logs / "managed-gateway.log")
    gateway = Managed(server)
    try:
        server.start()
        server.wait_ready(("/metrics",), 120.0)
        gateway.wait(lambda s: s["upstream"]["state"] in ("ready", "down"), START_TIMEOUT, "managed start-up")
        yield gateway
    finally:
        server.stop(grace=30.0)
        # The gateway takes its engines along when it stops; should it not have, they go now, and fail the test.
        leftovers = {pgid: group_pids(pgid) for pgid in gateway.pgids}
        for pgid in gateway.pgids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        assert not any(leftovers.values()), f"engine processes outlived the gateway: {leftovers}"


def test_start_up_auto_fits_max_model_len_to_vllms_estimate(managed: Managed) -> None:
    status = managed.status()
    engine = status["engine"]
    assert status["upstream"]["state"] == "ready", f"{engine['last_error']}\n{managed.server.log_tail(60)}"
    fitted = int(engine["overrides"]["--max-model-len"])
    assert fitted < NATIVE_CONTEXT
    assert fitted % BLOCK_SIZE == 0
    assert len(engine["autofit"]) == 1
    assert f"max_model_len {NATIVE_CONTEXT} -> {fitted}" in engine["autofit"][0]
    assert engine["max_model_len"] == fitted
    models = httpx.get(managed.url + "/v1/models", headers=AUTH, timeout=30)
    assert models.status_code == 200
    assert models.json()["data"][0]["max_model_len"] == fitted
    assert status["upstream"]["max_model_len"] == fitted
    # The cache holds 4,096 tokens; vLLM's estimate leaves room below it.
    assert fitted <= DEFAULT_KV_CACHE_BYTES // 1024
    r = httpx.post(managed.url + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text


def test_vllms_engine_core_runs_at_the_niceness_asked_and_its_api_server_keeps_its_own(managed: Managed) -> None:
    engine = managed.status()["engine"]
    assert engine_core_niceness(int(engine["pgid"])) == {ENGINE_CORE_NICE}
    assert os.getpriority(os.PRIO_PROCESS, int(engine["pid"])) == os.getpriority(os.PRIO_PROCESS, 0)


def test_a_killed_engine_core_is_restarted_under_load_without_losing_a_request(managed: Managed) -> None:
    before = managed.status()
    assert before["upstream"]["state"] == "ready"
    core = _engine_core(int(before["engine"]["pgid"]))
    victim = core if core is not None else int(before["engine"]["pid"])
    answers = asyncio.run(_load_while(managed, lambda: os.kill(victim, signal.SIGKILL)))
    after = managed.status()
    assert after["restarts"] == before["restarts"] + 1
    assert after["upstream"]["last_restart_reason"] == "exit"
    assert engine_core_niceness(int(after["engine"]["pgid"])) == {ENGINE_CORE_NICE}  # the new engine's too
    lost = [a for a in answers if a != 200]
    assert not lost, f"{len(lost)} of {len(answers)} requests failed: {lost[:5]}"
    assert (after["committed_blocks"], after["in_flight"], after["queued"]) == (0, 0, 0)


def test_a_stopped_engine_is_detected_as_a_hang_and_restarted(managed: Managed) -> None:
    before = managed.status()
    assert before["upstream"]["state"] == "ready"
    pid = int(before["engine"]["pid"])

    async def hang_with_a_request_waiting() -> int:
        async with httpx.AsyncClient(base_url=managed.url, headers=AUTH, timeout=RESTART_TIMEOUT) as http:
            os.kill(pid, signal.SIGSTOP)
            r = await http.post("/v1/completions", json=COMPLETION)
            return r.status_code

    started = time.monotonic()
    assert asyncio.run(hang_with_a_request_waiting()) == 200
    after = managed.wait(
        lambda s: s["restarts"] == before["restarts"] + 1 and s["upstream"]["state"] == "ready",
        RESTART_TIMEOUT, "restart after the hang",
    )
    assert after["upstream"]["last_restart_reason"] == "hang"
    assert "did not answer" in (after["engine"]["last_restart_detail"] or "")
    assert time.monotonic() - started >= HANG_TIMEOUT
    assert not _alive(pid)
    assert (after["committed_blocks"], after["in_flight"], after["queued"]) == (0, 0, 0)


async def _load_while(managed: Managed, act: Callable[[], None], clients: int = 2) -> list[int | str]:
    """Two clients send completions back to back; ``act`` runs once they are under way, and the load goes
    on until the engine has been restarted and served a few more."""
    answers: list[int | str] = []
    stop = asyncio.Event()
    answered = asyncio.Event()

    async def until_answered(count: int) -> None:
        while len(answers) < count:
            answered.clear()
            await answered.wait()

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            try:
                r = await http.post("/v1/completions", json=COMPLETION)
                answers.append(r.status_code if r.status_code == 200 else f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as exc:
                answers.append(f"{type(exc).__name__}: {exc}")
            answered.set()

    restarts = managed.status()["restarts"]
    async with httpx.AsyncClient(base_url=managed.url, headers=AUTH, timeout=RESTART_TIMEOUT + 60) as http:
        tasks = [asyncio.create_task(client(http)) for _ in range(clients)]
        try:
            await until_answered(4)
            act()
            await asyncio.to_thread(
                managed.wait, lambda s: s["restarts"] > restarts and s["upstream"]["state"] == "ready",
                RESTART_TIMEOUT, "restart after the kill",
            )
            await until_answered(len(answers) + 4)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    return answers


def engine_core_niceness(pgid: int) -> set[int]:
    """The niceness of each thread of the group's engine core process."""
    core = _engine_core(pgid)
    assert core is not None, "no engine core process in the managed group"
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{core}/task")}


def _engine_core(pgid: int) -> int | None:
    """vLLM's engine-core process in the managed group (it names itself VLLM::EngineCore)."""
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            comm = Path(f"/proc/{pid}/comm").read_bytes()
            if b"EngineCore" in title or b"EngineCor" in comm:
                return pid
    return None
