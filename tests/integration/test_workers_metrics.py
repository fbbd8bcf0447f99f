"""``/metrics`` with ``--workers 2`` when a worker dies: no counter reads lower than it was scraped (Prometheus
would take it for a reset), the restarted worker's counts add on top, and the exposition stays valid (prometheus_
client's parser, and ``promtool check metrics`` where it is installed)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server
from tests.integration.test_workers import completion, flood, worker_pid

Sample = tuple[str, tuple[tuple[str, str], ...]]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with run_sim_server(SimConfig(model="tiny", max_model_len=2048, num_blocks=256, block_size=16)) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(sim: SimServer, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    settings = Settings(tokenizer=str(tokenizer_dir), scrape_interval=0.05)
    with run_gateway(settings, upstream=sim.url, workers="2") as gw:
        yield gw


def scrape(gw: GatewayServer) -> tuple[str, dict[Sample, float]]:
    """The exposition, and every counter's and histogram's sample (``_created``, when a series began, aside)."""
    for attempt in range(20):
        try:
            text = httpx.get(gw.url + "/metrics", timeout=10.0).text
            break
        except httpx.TransportError:  # a connection the dead worker's socket took as it died: reset
            if attempt == 19:
                raise
            time.sleep(0.05)
    counted: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):  # raises on an exposition it cannot read
        if family.type in ("counter", "histogram"):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    counted[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, counted


def served(counted: dict[Sample, float]) -> float:
    return counted.get(("vllm_guard_requests_total", (("outcome", "ok"), ("route", "completions"))), 0.0)


def assert_nothing_went_backwards(before: dict[Sample, float], after: dict[Sample, float]) -> None:
    lower = {key: (value, after.get(key)) for key, value in before.items() if after.get(key, 0.0) < value}
    assert not lower, f"{len(lower)} samples read lower than scraped before, e.g. {dict(list(lower.items())[:3])}"


def check_with_promtool(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # prometheus_client's parser has read it
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60,
                            check=False)
    # promtool lints names too (it warns, exit 3, on what is only advice); a broken exposition is an error (1).
    assert result.returncode in (0, 3), result.stdout + result.stderr
    assert "error" not in (result.stdout + result.stderr).lower(), result.stdout + result.stderr


def wait_lost(gw: GatewayServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while gw.parts.authority is not None and gw.parts.authority.links:
        assert time.monotonic() < deadline, "the authority did not notice its worker die"
        time.sleep(0.01)


def wait_snapshot(gw: GatewayServer, total: float, timeout: float = 10.0) -> None:
    """Until the authority's own count and the worker's newest snapshot add up to ``total``."""
    async def known() -> float:
        authority = gw.parts.authority
        assert authority is not None
        count = gw.parts.metrics.requests.labels("completions", "ok")._value.get()
        for families in authority.counts.families():
            for name, _kind, _doc, _unit, samples in families:
                if name == "vllm_guard_requests":
                    count += sum(v for s, labels, v in samples
                                 if s.endswith("_total") and labels == {"route": "completions", "outcome": "ok"})
        return float(count)

    deadline = time.monotonic() + timeout
    while gw.call(known) < total:
        assert time.monotonic() < deadline, "the worker's counts reached the authority in no snapshot"
        time.sleep(0.05)


def test_no_counter_goes_backwards_when_a_worker_dies_and_the_restarted_one_adds_on_top(
    gateway: GatewayServer,
) -> None:
    answers = asyncio.run(flood(gateway.url, 16, completion()))
    assert [r.status_code for r in answers] == [200] * 16
    text, before = scrape(gateway)
    check_with_promtool(text)
    own = gateway.parts.metrics.requests.labels("completions", "ok")._value.get()
    assert own < served(before), "the worker served none of the requests: nothing to lose when it dies"

    os.kill(worker_pid(gateway), signal.SIGKILL)
    _, right_after = scrape(gateway)  # whether or not the authority has noticed yet
    assert_nothing_went_backwards(before, right_after)
    wait_lost(gateway)
    text, after = scrape(gateway)
    check_with_promtool(text)
    assert_nothing_went_backwards(before, after)
    assert served(after) == served(before)

    gateway.wait_workers(1, timeout=60.0)
    answers = asyncio.run(flood(gateway.url, 12, completion()))
    assert [r.status_code for r in answers] == [200] * 12
    text, again = scrape(gateway)
    check_with_promtool(text)
    assert_nothing_went_backwards(after, again)
    assert served(again) == served(before) + 12


def test_a_worker_killed_between_scrapes_keeps_what_its_last_snapshot_counted(gateway: GatewayServer) -> None:
    gateway.wait_workers(1, timeout=60.0)
    _, before = scrape(gateway)
    answers = asyncio.run(flood(gateway.url, 16, completion()))
    assert [r.status_code for r in answers] == [200] * 16
    own_before = gateway.parts.metrics.requests.labels("completions", "ok")._value.get()
    wait_snapshot(gateway, served(before) + 16)  # the snapshots the authority asks for, no scrape between
    os.kill(worker_pid(gateway), signal.SIGKILL)
    wait_lost(gateway)
    _, after = scrape(gateway)
    assert_nothing_went_backwards(before, after)
    own = gateway.parts.metrics.requests.labels("completions", "ok")._value.get()
    assert own - own_before < 16, "the worker served none of the requests"
    assert served(after) == served(before) + 16
