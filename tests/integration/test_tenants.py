"""Tenants end to end: the OpenAI SDK -> the gateway (keys file, limits, usage) -> the vLLM simulator; two
replicas sharing limits through a real redis-server, and a Redis that dies under them.

Outputs stop after 5 tokens (the simulator's ``stop_early``), so a request booked with a larger ``max_tokens``
is settled to less than it booked, and the next answer's headers show it. The windows are the clock's minutes:
each test starts a few seconds clear of a minute's end, so that its requests fall in one window.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.config import Settings
from gateway.tenants.redis import RETRY_SECONDS
from testing.gateway_thread import TEST_WORKERS, GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server
from tests.support.redis_server import RedisServer, running_redis

SEARCH, BATCH, ADMIN = "sk-search-5d1f0b", "sk-batch-c7a3e9", "admin-key-91b2"
TOKEN, PROMPT, OUTPUT = 7, 16, 5  # a token-id prompt counts as its length; the engine stops after 5 tokens

KEYS = f"""\
tenants:
  search:
    priority: 3
    limits: {{tokens_per_minute: 200, requests_per_minute: 50}}
    keys: [{SEARCH}]
  batch:
    limits: {{requests_per_minute: 3, kv_share: 0.25}}
    keys: [{BATCH}]
"""


def prompt() -> list[int]:
    return [TOKEN] * PROMPT


def clear_of_the_minutes_end(margin: float = 8.0) -> None:
    left = 60.0 - time.time() % 60.0
    if left < margin:
        time.sleep(left + 0.05)


@pytest.fixture(scope="module")
def sim(tokenizer: Any, tokenizer_dir: Path) -> Iterator[SimServer]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_model_len=512,
                       num_blocks=64, token_delay=0.001, stop_early=lambda index, max_tokens: OUTPUT)
    with run_sim_server(config) as server:
        yield server


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS, encoding="utf-8")
    return path


@pytest.fixture
def exits() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def make_gateway(
    base_settings: Settings, sim: SimServer, keys_file: Path, exits: contextlib.ExitStack
) -> Callable[..., GatewayServer]:
    def make(**overrides: Any) -> GatewayServer:
        overrides.setdefault("keys_file", str(keys_file))
        overrides.setdefault("admin_api_key", [ADMIN])
        clear_of_the_minutes_end()
        return exits.enter_context(run_gateway(base_settings, upstream=sim.url, **overrides))

    return make


def sdk(gw: GatewayServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def usage(gw: GatewayServer) -> dict[str, Any]:
    r = httpx.get(gw.url + "/guard/usage", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def metric(gw: GatewayServer, line_start: str) -> float | None:
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def eventually(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {timeout:g} s: {what}"
        time.sleep(0.05)


# -- limits and headers ------------------------------------------------------------------------------
def test_every_answer_says_where_the_tenant_stands_and_over_the_limit_it_is_429_with_retry_after(
    make_gateway: Callable[..., GatewayServer]
) -> None:
    gw = make_gateway()
    with sdk(gw, SEARCH) as client:
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt(), max_tokens=50)
        assert raw.parse().usage.completion_tokens == OUTPUT  # type: ignore[union-attr]
        h = raw.headers
        assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("200", str(200 - PROMPT - 50))
        assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("50", "49")
        assert h["x-ratelimit-reset-tokens"].endswith("s") and h["x-ratelimit-reset-requests"].endswith("s")
        # Settled to what it used: 16 + 5 of the 66 booked. 21 + 16 + 163 = 200: exactly the budget.
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt(), max_tokens=163)
        assert raw.headers["x-ratelimit-remaining-tokens"] == "0"
        # Both settled: 42 used, 158 left; 16 + 143 = 159 is one token too many.
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model="tiny", prompt=prompt(), max_tokens=143)
        client.completions.create(model="tiny", prompt=prompt(), max_tokens=142)
    response = caught.value.response
    assert response.status_code == 429
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert response.headers["x-ratelimit-remaining-tokens"] == str(200 - 2 * (PROMPT + OUTPUT))
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "tenant 'search' on tokens per minute: limit 200, 42 tokens used this minute; this request books 159" \
        in error["message"]


def test_a_stream_is_settled_to_what_it_generated_when_it_ends(make_gateway: Callable[..., GatewayServer]) -> None:
    gw = make_gateway()
    with sdk(gw, SEARCH) as client:
        chunks = list(client.completions.create(model="tiny", prompt=prompt(), max_tokens=100, stream=True))
        assert sum(len(c.choices) for c in chunks) >= OUTPUT
        # The client has the last event a moment before the gateway settles the request behind it.
        eventually(lambda: usage(gw)["tenants"]["search"]["requests"] == 1, "the stream settled")
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt(), max_tokens=10)
    booked_now = PROMPT + 10
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(200 - (PROMPT + OUTPUT) - booked_now)
    assert usage(gw)["tenants"]["search"]["completion_tokens"] == 2 * OUTPUT


def test_requests_per_minute_and_the_keys_own_priority(make_gateway: Callable[..., GatewayServer]) -> None:
    gw = make_gateway()
    with sdk(gw, BATCH) as client:
        for left in ("2", "1", "0"):
            raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt(), max_tokens=1)
            assert raw.headers["x-ratelimit-remaining-requests"] == left
            assert "x-ratelimit-limit-tokens" not in raw.headers  # no token limit: no token headers
        with pytest.raises(openai.RateLimitError, match="on requests per minute: limit 3, 3 requests made"):
            client.completions.create(model="tiny", prompt=prompt(), max_tokens=1)


def test_a_request_larger_than_its_tenants_kv_share_is_refused_with_the_numbers(
    make_gateway: Callable[..., GatewayServer]
) -> None:
    gw = make_gateway()  # 64 blocks of 16 tokens at kv_target 1: batch may hold 16 blocks (256 tokens)
    with sdk(gw, BATCH) as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=prompt(), max_tokens=300)
    error = caught.value.response.json()["error"]
    assert error["code"] == "kv_budget_exceeded"
    assert "Tenant 'batch' may hold at most 16 KV blocks (kv_share 0.25 of a 64-block budget)" in error["message"]


def test_with_a_keys_file_the_client_routes_need_one_of_its_keys(make_gateway: Callable[..., GatewayServer]) -> None:
    gw = make_gateway()
    body = {"model": "tiny", "prompt": prompt(), "max_tokens": 1}
    assert httpx.post(gw.url + "/v1/completions", json=body).status_code == 401
    wrong = httpx.post(gw.url + "/v1/completions", json=body, headers={"authorization": "Bearer sk-nobody"})
    assert wrong.status_code == 401
    assert httpx.get(gw.url + "/guard/status", headers={"authorization": f"Bearer {BATCH}"}).status_code == 200


# -- usage -------------------------------------------------------------------------------------------
def test_usage_is_counted_per_tenant_for_the_admin_and_shows_no_key(
    make_gateway: Callable[..., GatewayServer]
) -> None:
    gw = make_gateway()
    with sdk(gw, SEARCH) as search, sdk(gw, BATCH) as batch:
        search.completions.create(model="tiny", prompt=prompt(), max_tokens=20)
        for _ in range(4):
            with contextlib.suppress(openai.RateLimitError):
                batch.completions.create(model="tiny", prompt=prompt(), max_tokens=2)
    assert httpx.get(gw.url + "/guard/usage", headers={"authorization": f"Bearer {SEARCH}"}).status_code == 401
    report = usage(gw)
    search_usage, batch_usage = report["tenants"]["search"], report["tenants"]["batch"]
    assert (search_usage["requests"], search_usage["prompt_tokens"], search_usage["completion_tokens"]) == (
        1, PROMPT, OUTPUT)
    assert batch_usage["requests"] == 3 and batch_usage["rejections"] == {"tenant_requests_per_minute": 1}
    assert batch_usage["limits"] == {"requests_per_minute": 3, "kv_share": 0.25}
    assert report["tenants"]["default"]["requests"] == 0 and report["limits_store"] == "local"
    page = httpx.get(gw.url + "/guard/usage", headers={"authorization": f"Bearer {ADMIN}"}).text
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'vllm_guard_tenant_requests_total{tenant="batch"} 3.0' in metrics
    assert 'vllm_guard_tenant_rejections_total{reason="tenant_requests_per_minute",tenant="batch"} 1.0' in metrics
    status = httpx.get(gw.url + "/guard/status", headers={"authorization": f"Bearer {ADMIN}"}).text
    for shown in (page, metrics, status):
        assert SEARCH not in shown and BATCH not in shown


# -- reload ------------------------------------------------------------------------------------------
def rewrite(path: Path, text: str) -> None:
    """Replace the file whole, as an editor or a deployment does: a poll never reads it half written."""
    before = path.stat().st_mtime_ns
    staged = path.with_name(path.name + ".new")
    staged.write_text(text, encoding="utf-8")
    os.utime(staged, ns=(before + 10**9, before + 10**9))
    os.replace(staged, path)


# Each of the gateway's serving processes watches the keys file on its own: a version is in force everywhere once
# each of them has counted its reload.
PROCESSES = int(TEST_WORKERS) if TEST_WORKERS else 1


def reloads(gw: GatewayServer, outcome: str) -> float:
    return metric(gw, f'vllm_guard_keys_file_reloads_total{{outcome="{outcome}"}}') or 0


def test_the_keys_file_is_reloaded_without_a_restart_or_a_dropped_request(
    make_gateway: Callable[..., GatewayServer], keys_file: Path
) -> None:
    gw = make_gateway()
    late = "sk-late-3e8d11"
    body = {"model": "tiny", "prompt": prompt(), "max_tokens": 1}

    def status_with(key: str) -> int:
        return httpx.post(gw.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}).status_code

    assert status_with(late) == 401
    with sdk(gw, SEARCH) as client:
        stream = client.completions.create(model="tiny", prompt=prompt(), max_tokens=50, stream=True)
        first = next(iter(stream))
        rewrite(keys_file, KEYS + f"  late:\n    keys: [{late}]\n")
        eventually(lambda: reloads(gw, "ok") >= PROCESSES, "the new version loaded by every process")
        assert status_with(late) == 200
        rest = list(stream)  # the stream in flight during the reload ends as it would have
    assert first.choices and len(rest) >= OUTPUT - 1
    rewrite(keys_file, "tenants: [\n")
    eventually(lambda: reloads(gw, "error") >= PROCESSES, "the bad version seen by every process")
    assert status_with(late) == 200 and status_with(SEARCH) == 200  # the previous version stays in force


# -- Redis ---------------------------------------------------------------------------------------------
@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


def test_two_replicas_share_the_limits_through_redis(
    make_gateway: Callable[..., GatewayServer], redis_server: RedisServer
) -> None:
    one, two = make_gateway(redis_url=redis_server.url), make_gateway(redis_url=redis_server.url)
    with sdk(one, BATCH) as first, sdk(two, BATCH) as second:
        statuses = []
        for client in (first, second, first, second):
            try:
                client.completions.create(model="tiny", prompt=prompt(), max_tokens=1)
                statuses.append(200)
            except openai.RateLimitError:
                statuses.append(429)
    assert statuses == [200, 200, 200, 429]
    assert usage(one)["limits_store"] == "redis"
    assert usage(one)["tenants"]["batch"]["requests"] + usage(two)["tenants"]["batch"]["requests"] == 3


def test_a_dead_redis_degrades_to_local_limits_and_never_to_a_500(
    make_gateway: Callable[..., GatewayServer], redis_server: RedisServer
) -> None:
    gw = make_gateway(redis_url=redis_server.url)
    with sdk(gw, SEARCH) as client:
        client.completions.create(model="tiny", prompt=prompt(), max_tokens=1)
        # On a loaded machine one answer of the live Redis may come later than the limit, which degrades the
        # gateway until its next try (RETRY_SECONDS): with Redis alive it must come back.
        deadline = time.monotonic() + 3 * RETRY_SECONDS
        while metric(gw, "vllm_guard_tenant_limits_degraded") != 0:
            assert time.monotonic() < deadline, "degraded while Redis answers"
            time.sleep(RETRY_SECONDS + 0.1)
            client.completions.create(model="tiny", prompt=prompt(), max_tokens=1)
        redis_server.stop()
        for _ in range(3):
            raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt(), max_tokens=1)
            assert raw.http_response.status_code == 200
            assert "x-ratelimit-remaining-tokens" in raw.headers
    assert metric(gw, "vllm_guard_tenant_limits_degraded") == 1
    assert usage(gw)["limits_store"] == "local (redis unreachable)"


@pytest.fixture
def one_at_a_time(make_gateway: Callable[..., GatewayServer], keys_file: Path) -> GatewayServer:
    keys_file.write_text(KEYS.replace("requests_per_minute: 50", "concurrent_requests: 1"), encoding="utf-8")
    return make_gateway()


@pytest.fixture
def slow_tokens(sim: SimServer) -> Iterator[None]:
    """Tokens 0.2 s apart for one test: its first stream (5 tokens) still runs while the test sends beside it,
    however busy the host (at the module's 1 ms a token it could end first, and free its slot, on a loaded one)."""
    before = sim.sim.config.token_delay
    sim.sim.config.token_delay = 0.2
    try:
        yield
    finally:
        sim.sim.config.token_delay = before


@pytest.mark.usefixtures("slow_tokens")
async def test_concurrent_requests_over_the_limit_are_refused_while_the_first_runs(
    one_at_a_time: GatewayServer,
) -> None:
    gw = one_at_a_time
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=SEARCH, max_retries=0) as client:
        stream = await client.completions.create(model="tiny", prompt=prompt(), max_tokens=5, stream=True)
        with pytest.raises(openai.RateLimitError, match="on concurrent requests: limit 1, 1 requests in flight"):
            await client.completions.create(model="tiny", prompt=prompt(), max_tokens=1)
        assert len([chunk async for chunk in stream]) >= 1
        # The client has the stream's last event a moment before the gateway frees the slot behind it.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                answer = await client.completions.create(model="tiny", prompt=prompt(), max_tokens=1)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the slot was not freed when the stream ended"
                await asyncio.sleep(0.01)
        assert answer.usage is not None
