"""Several engines on real vLLM (CPU build): the session's vLLM and a data-parallel one (two ranks, 32 blocks each)
behind one strict gateway. The gateway books each rank on its own once vLLM's metrics show the ranks, places a
flood larger than any one engine over all three, sends each request to the rank it booked (vLLM's own per-rank
counters agree with the gateway's ``x-guard-engine`` headers), vLLM never preempts, and the books empty."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testing.servers import (
    DEFAULT_KV_CACHE_BYTES,
    GATEWAY_READY_PATHS,
    SERVED_MODEL_NAME,
    VLLM_READY_PATHS,
    ServerProcess,
    ServerStartError,
    gateway_server,
    get_json,
    held_at_once,
    scrape_by_engine,
    vllm_server,
)

from .conftest import GATEWAY_START_TIMEOUT, VLLM_START_TIMEOUT, _import_failed, _log_dir, _start

pytestmark = pytest.mark.e2e

# 1,000 prompt + 300 output tokens need 11 of a site's 32 blocks: two run on each of the three sites, and a
# flood of eight is more than any one site (or one whole engine) holds at once.
PROMPT_TOKENS = 1000
MAX_TOKENS = 300
FLOOD = 8
SITES = ["0", "1.0", "1.1"]
RANKS_TIMEOUT = 60.0  # the gateway splits the data-parallel engine after a scrape shows its ranks, idle


@pytest.fixture(scope="module")
def dp_vllm(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The tests' tiny model on two data-parallel ranks, each with the session vLLM's 32-block KV cache."""
    server = vllm_server(
        tiny_model, _log_dir(tmp_path_factory) / "dp_vllm.log", kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES,
        extra_args=["--data-parallel-size", "2"],
    )
    server.name = "data-parallel vLLM"
    request.addfinalizer(server.stop)
    try:
        _start(request.config, server, VLLM_READY_PATHS, VLLM_START_TIMEOUT)
    except ServerStartError as exc:
        if _import_failed(server):
            pytest.skip(f"vLLM cannot run here, its import fails:\n{server.log_tail(15)}")
        raise exc
    yield server


@pytest.fixture(scope="module")
def engines_gateway(
    request: pytest.FixtureRequest, vllm: ServerProcess, dp_vllm: ServerProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    """A strict gateway over the session vLLM (engine 0) and the data-parallel one (engine 1): same model, same
    context length."""
    server = gateway_server(
        vllm.url, _log_dir(tmp_path_factory) / "engines_gateway.log",
        ["--upstream", dp_vllm.url, "--admission-policy", "strict", "--queue-timeout", "300"],
        name="engines_gateway",
    )
    request.addfinalizer(server.stop)
    _start(request.config, server, GATEWAY_READY_PATHS, GATEWAY_START_TIMEOUT)
    yield server


def site_names(gateway: ServerProcess) -> list[str]:
    return [row["name"] for row in get_json(f"{gateway.url}/guard/status")["engines"]]


async def wait_for_sites(gateway: ServerProcess, want: list[str]) -> None:
    deadline = time.monotonic() + RANKS_TIMEOUT
    while (names := site_names(gateway)) != want:
        assert time.monotonic() < deadline, f"the gateway's sites are {names} after {RANKS_TIMEOUT:.0f} s, not {want}"
        await asyncio.sleep(0.5)


def body(i: int) -> dict[str, Any]:
    # Prompts share no first block, so prefix caching shares nothing and affinity plays no part.
    rng = random.Random(i)
    prompt = [10 + i, *(rng.randrange(10, 490) for _ in range(PROMPT_TOKENS - 1))]
    return {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}


async def flood(gateway: ServerProcess, tag: str = "flood") -> tuple[list[httpx.Response], dict[str, int]]:
    """The flood at once (request ids ``tag-i``); also the most requests each site held at a time, sampled from
    ``/guard/status`` (a busy machine's samples can miss a site's requests: never more than it held)."""
    peak: dict[str, int] = {}
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=300.0, limits=httpx.Limits(max_connections=FLOOD + 2)) as client:

        async def watch() -> None:
            while not done.is_set():
                for row in (await client.get(f"{gateway.url}/guard/status")).json()["engines"]:
                    peak[row["name"]] = max(peak.get(row["name"], 0), row["in_flight"])
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        answers = await asyncio.gather(
            *(client.post(f"{gateway.url}/v1/completions", json=body(i), headers={"x-request-id": f"{tag}-{i}"})
              for i in range(FLOOD))
        )
        done.set()
        await watcher
    return answers, peak


async def test_a_flood_spreads_over_data_parallel_ranks_without_preemptions(
    vllm: ServerProcess, dp_vllm: ServerProcess, engines_gateway: ServerProcess
) -> None:
    await wait_for_sites(engines_gateway, SITES)
    preempted = "vllm:num_preemptions_total"
    finished = "vllm:request_success_total"
    before = {url: scrape_by_engine(f"{url}/metrics", preempted) for url in (vllm.url, dp_vllm.url)}
    ran_before = scrape_by_engine(f"{dp_vllm.url}/metrics", finished)

    answers, peak = await flood(engines_gateway)

    assert [a.status_code for a in answers] == [200] * FLOOD, [a.text for a in answers if a.status_code != 200]
    placed = Counter(a.headers["x-guard-engine"] for a in answers)
    assert set(placed) == set(SITES), placed  # every site took part
    # Two 11-block requests fit a 32-block site, three do not: at most two sampled at once, and at least one held
    # (the gateway's own log says, where the samples missed a site's short turn).
    logged = held_at_once(engines_gateway, [f"flood-{i}" for i in range(FLOOD)])
    assert all(max(peak.get(s, 0), logged.get(s, 0)) >= 1 and peak.get(s, 0) <= 2 for s in SITES), (peak, logged)
    for url in (vllm.url, dp_vllm.url):
        assert scrape_by_engine(f"{url}/metrics", preempted) == before[url], f"{url} preempted"
    # vLLM ran each request on the rank the gateway booked it on (the x-data-parallel-rank header).
    ran = scrape_by_engine(f"{dp_vllm.url}/metrics", finished)
    assert {r: ran[r] - ran_before.get(r, 0.0) for r in ("0", "1")} == {"0": placed["1.0"], "1": placed["1.1"]}

    status = get_json(f"{engines_gateway.url}/guard/status")
    assert (status["committed_blocks"], status["in_flight"], status["queued"]) == (0, 0, 0)
    assert [(row["committed_blocks"], row["in_flight"]) for row in status["engines"]] == [(0, 0)] * len(SITES)
    assert {row["name"]: row["admitted_total"] for row in status["engines"]} == dict(placed)
