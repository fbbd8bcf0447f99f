"""A real vLLM (CPU build) started with ``--max-num-queued-reqs 2`` behind the gateway (``--access-log json``): with
its engine core frozen (SIGSTOP), two requests sent to vLLM directly fill its queue; a request through the gateway
gets the gateway's 503 ``engine_queue_full`` with a ``Retry-After``, counted under its own reason, shown per engine
in ``/guard/status`` (vLLM's own ``vllm:admission_rejections_total`` too) and written in the access log; once the
engine core runs again, requests pass again. The engine is this module's own: the session's has no queue cap."""

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

from testing.servers import ServerProcess, gateway_server, metric_sum, vllm_server

from .test_hung_e2e import engine_core_pid

pytestmark = pytest.mark.e2e

CAP = 2
SHORT = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("queue-cap")
    server = vllm_server(tiny_model, logs / "vllm.log", extra_args=["--max-num-queued-reqs", str(CAP)])
    try:
        server.start()
        server.wait_ready(("/health", "/v1/models"), 300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gateway(engine: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("queue-cap-gateway")
    server = gateway_server(engine.url, logs / "gateway.log", [
        "--access-log", "json", "--scrape-interval", "0.2", "--hang-timeout", "120",
    ])
    try:
        server.start()
        server.wait_ready(("/health",), 120)
        yield server
    finally:
        server.stop()


class Pending(threading.Thread):
    """A request sent to vLLM directly: its answer, once it comes."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.status, self.done = url, 0, threading.Event()

    def run(self) -> None:
        try:
            self.status = httpx.post(self.url, json=SHORT, timeout=300).status_code
        finally:
            self.done.set()


def fill_the_queue(url: str) -> list[Pending]:
    """Requests sent one by one to the frozen engine until vLLM refuses one: those it took stay unfinished."""
    taken: list[Pending] = []
    for _ in range(CAP + 1):
        request = Pending(url)
        request.start()
        if request.done.wait(3.0):  # answered at once: refused by the cap (nothing else answers while frozen)
            assert request.status == 503, request.status
            return taken
        taken.append(request)
    raise AssertionError(f"vLLM took {len(taken)} requests past --max-num-queued-reqs {CAP}")


def access_lines(gateway: ServerProcess) -> list[dict[str, Any]]:
    lines = Path(gateway.log_path).read_text(encoding="utf-8", errors="replace").splitlines()
    return [orjson.loads(line) for line in lines if line.startswith('{"time":')]


def test_vllms_queue_cap_is_the_gateways_503_with_retry_after_counted_shown_and_logged(
    engine: ServerProcess, gateway: ServerProcess,
) -> None:
    assert engine.proc is not None
    core = engine_core_pid(engine.proc.pid)
    os.kill(core, signal.SIGSTOP)  # what vLLM takes stays unfinished: its queue stays full
    try:
        taken = fill_the_queue(engine.url + "/v1/completions")
        assert len(taken) == CAP
        refused = httpx.post(gateway.url + "/v1/completions", json=SHORT, timeout=60)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "engine_queue_full"
        assert int(refused.headers["retry-after"]) >= 1
        row = httpx.get(gateway.url + "/guard/status").json()["engines"][0]["queue_cap"]
        assert row["refusals_total"] == 1
    finally:
        os.kill(core, signal.SIGCONT)
    for request in taken:
        assert request.done.wait(120) and request.status == 200

    metrics = httpx.get(gateway.url + "/metrics").text
    assert metric_sum(metrics, 'vllm_guard_rejections_total{reason="engine_queue_full"}') == 1.0
    deadline = time.monotonic() + 30
    while True:  # vLLM's own count (the direct refusal and the gateway's), read at the gateway's next scrape
        row = httpx.get(gateway.url + "/guard/status").json()["engines"][0]["queue_cap"]
        if row["engine_rejections_total"].get("max_num_queued_reqs", 0) >= 2:
            break
        assert time.monotonic() < deadline, row
        time.sleep(0.2)

    answered = httpx.post(gateway.url + "/v1/completions", json=SHORT, timeout=60)
    assert answered.status_code == 200, answered.text

    deadline = time.monotonic() + 10
    while len(lines := access_lines(gateway)) < 2:
        assert time.monotonic() < deadline, "both requests are in the access log"
        time.sleep(0.1)
    assert [(line["status"], line["outcome"], line["reason"]) for line in lines[-2:]] == [
        (503, "refused", "engine_queue_full"), (200, "ok", None),
    ]
