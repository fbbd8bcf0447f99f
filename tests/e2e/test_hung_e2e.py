"""A real vLLM (CPU build) whose engine core is frozen with SIGSTOP under open streams, behind the gateway in
proxy mode: vLLM's API server keeps answering /health and /metrics with 200, the gateway calls the engine hung
within --hang-timeout, refuses new requests at once, ends the streams with an error event, and takes requests
again after SIGCONT. The engine is this module's own: freezing the session's would disturb the other tests."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from testing.servers import ServerProcess, gateway_server, vllm_server

pytestmark = pytest.mark.e2e

HANG_TIMEOUT = 5.0
# Long enough that the streams still run when the engine core is frozen after their first token.
STREAM = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 1900, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("hung")
    server = vllm_server(tiny_model, logs / "vllm.log")
    try:
        server.start()
        server.wait_ready(("/health", "/v1/models"), 300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gateway(engine: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("hung-gateway")
    server = gateway_server(engine.url, logs / "gateway.log", ["--hang-timeout", str(HANG_TIMEOUT)])
    try:
        server.start()
        server.wait_ready(("/health",), 120)
        yield server
    finally:
        server.stop()


def engine_core_pid(api_server_pid: int) -> int:
    """The descendant of vLLM's API server whose name is ``VLLM::EngineCor`` (vLLM names its processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    todo = list(children.get(api_server_pid, []))
    while todo:
        pid = todo.pop()
        try:
            if (Path("/proc") / str(pid) / "comm").read_text().strip().startswith("VLLM::EngineCor"):
                return pid
        except OSError:
            continue
        todo += children.get(pid, [])
    raise AssertionError(f"no VLLM::EngineCor process under {api_server_pid}")


class Stream(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.headed = threading.Event()
        self.status: int | None = None
        self.events: list[dict[str, Any]] = []
        self.ended_at: float | None = None

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=STREAM, timeout=120) as response:
            self.status = response.status_code
            self.headed.set()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.events.append(orjson.loads(line[6:]))
        self.ended_at = time.monotonic()


def wait_for_status(url: str, status: int, limit: float) -> float:
    t0 = time.monotonic()
    while httpx.get(url + "/health", timeout=5).status_code != status:
        assert time.monotonic() - t0 < limit, f"/health did not answer {status} within {limit} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_a_frozen_engine_core_is_hung_refused_cut_and_rejoins_after_sigcont(
    engine: ServerProcess, gateway: ServerProcess
) -> None:
    assert engine.proc is not None
    core = engine_core_pid(engine.proc.pid)
    # A fresh engine's first request can take longer than the bound on a busy machine (nothing moves while it
    # runs its first step): one request answered straight by the engine first, so that what follows judges the
    # frozen engine only.
    warm = httpx.post(engine.url + "/v1/completions", json={**STREAM, "stream": False, "max_tokens": 4}, timeout=120)
    assert warm.status_code == 200, warm.text
    wait_for_status(gateway.url, 200, 30)
    before = httpx.get(gateway.url + "/guard/status").json()["upstream"]["progress"]
    assert not before["hung"], before
    # Frozen first, then the streams opened: vLLM's API server still answers their head (200, text/event-stream)
    # and then sends nothing. (Freezing under streams already running races the engine core, which on this tiny
    # model can generate every token before the freeze lands while a busy API server is still relaying them.)
    os.kill(core, signal.SIGSTOP)
    frozen_at = time.monotonic()
    streams = [Stream(gateway.url) for _ in range(2)]
    try:
        for s in streams:
            s.start()
        for s in streams:
            assert s.headed.wait(HANG_TIMEOUT), "no response head from the frozen engine's API server"
            assert s.status == 200
        assert httpx.get(engine.url + "/health", timeout=5).status_code == 200, "vLLM itself still says healthy"
        wait_for_status(gateway.url, 503, HANG_TIMEOUT + 10)
        took = time.monotonic() - frozen_at
        print(f"hung declared {took:.1f} s after SIGSTOP (--hang-timeout {HANG_TIMEOUT:g})")
        assert took <= HANG_TIMEOUT + 3
        assert httpx.get(gateway.url + "/health").json()["upstream"]["state"] == "hung"

        t0 = time.monotonic()
        refused = httpx.post(gateway.url + "/v1/completions", json={**STREAM, "stream": False, "max_tokens": 4})
        assert time.monotonic() - t0 < 1.0, "a new request waited on the frozen engine"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "upstream_hung"
        assert int(refused.headers["retry-after"]) >= 1

        for s in streams:
            s.join(10)
            assert not s.is_alive(), "a stream was held open on the frozen engine"
            assert s.events[-1]["error"]["code"] == "upstream_hung", s.events[-1]
            assert s.ended_at is not None and s.ended_at - frozen_at <= HANG_TIMEOUT + 3
    finally:
        os.kill(core, signal.SIGCONT)
    took = wait_for_status(gateway.url, 200, 60)
    print(f"rejoined {took:.1f} s after SIGCONT")
    served = httpx.post(gateway.url + "/v1/completions", json={**STREAM, "stream": False, "max_tokens": 4}, timeout=60)
    assert served.status_code == 200
    status = httpx.get(gateway.url + "/guard/status").json()
    assert status["committed_blocks"] == 0 and status["in_flight"] == 0
    assert status["upstream"]["progress"]["hangs"] == before["hangs"] + 1
