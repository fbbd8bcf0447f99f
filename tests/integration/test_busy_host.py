"""Nothing lost to a busy host: an overload of chat streams beside processes that keep every core busy, sent as
the OpenAI SDK sends them (a pool of kept-alive connections, reused after idle gaps as long as its own
expiry), is answered whole: every request gets 200, or a 429/503 that says when to come back; none ends in a
connection error with no answer at all. A client that connected and then did not run (its host starved it of a
CPU) is not closed as one that sends nothing on an idle host is."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from gateway.config import Settings
from gateway.observe import cpu_pressure
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

RATE = 16  # requests a second
BURST_SECONDS = 2.0
BURSTS = 3
# httpx (the OpenAI SDK's client) keeps an idle pooled connection 5 s: reuse it just before it expires, when a
# server that closes idle connections at 5 s (the old default) races the request sent on it.
IDLE_GAP = 4.8
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True}


@pytest.fixture
def hogs() -> Iterator[None]:
    """One spinning process per core for the test's length, at the gateway's own niceness."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with run_sim_server(SimConfig(model="tiny", num_blocks=256, block_size=16, token_delay=0.01)) as server:
        yield server


@pytest.fixture
def gateway(sim: SimServer, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    with run_gateway(Settings(tokenizer=str(tokenizer_dir), scrape_interval=0.1), upstream=sim.url) as gw:
        yield gw


def answered(response: httpx.Response) -> bool:
    """A whole answer, or a refusal that says when to come back."""
    if response.status_code == 200:
        return response.text.rstrip().endswith("data: [DONE]")
    return response.status_code in (429, 503) and "retry-after" in response.headers


def test_an_overload_beside_busy_cores_loses_no_request(gateway: GatewayServer, hogs: None) -> None:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=5.0)
    outcomes: list[str] = []
    with httpx.Client(base_url=gateway.url, timeout=60.0, limits=limits) as client, ThreadPoolExecutor(64) as pool:
        def one() -> str:
            try:
                response = client.post("/v1/chat/completions", json=CHAT)
            except httpx.HTTPError as exc:
                return f"connection error: {type(exc).__name__}"
            return "ok" if answered(response) else f"{response.status_code} without an answer"

        for burst in range(BURSTS):
            futures = []
            start = time.monotonic()
            for i in range(int(RATE * BURST_SECONDS)):
                with contextlib.suppress(ValueError):
                    time.sleep(max(0.0, start + i / RATE - time.monotonic()))
                futures.append(pool.submit(one))
            outcomes += [f.result() for f in futures]
            if burst < BURSTS - 1:
                time.sleep(IDLE_GAP)
    lost = [o for o in outcomes if o != "ok"]
    assert not lost, f"{len(lost)} of {len(outcomes)} requests were not answered: {sorted(set(lost))}"
    gateway.wait_ledger_empty(timeout=10.0)


# A fresh connection waits this long for its first request here (--header-timeout); a starved host stretches it
# to four times as much at most. The client sends after twice as long: past the timeout, within the stretch.
FIRST_WAIT = 1.0
SENDS_AFTER = 2.0


@pytest.mark.parametrize(("share", "answered"), [
    pytest.param(0.9, True, id="on-a-starved-host-it-is-answered"),
    pytest.param(0.0, False, id="on-an-idle-host-it-is-closed"),
])
def test_a_client_that_connects_then_sends_late(
    sim: SimServer, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, share: float, answered: bool
) -> None:
    """Measured beside a CPU hog: every request the gateway lost was a connection it closed because its client,
    having connected, did not send within the 10 s a fresh connection gets; vLLM alone waits for it. The host's
    CPU pressure is injected: the gateway reads the share of the wait its host starved work of a CPU."""
    monkeypatch.setattr(cpu_pressure, "starved_share", lambda window: share)
    settings = Settings(tokenizer=str(tokenizer_dir), header_timeout=FIRST_WAIT)
    # One process: the injected pressure is this process's (with --workers each worker reads its own host's).
    with run_gateway(settings, upstream=sim.url, workers="1") as gw, socket.create_connection(
        (urlsplit(gw.url).hostname, urlsplit(gw.url).port), timeout=10
    ) as s:
        time.sleep(SENDS_AFTER)  # the client does not run
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n")
            head = s.recv(64)
        except ConnectionError:
            head = b""
    assert head.startswith(b"HTTP/1.1 200") == answered, head
