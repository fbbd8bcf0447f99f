"""The guarded proxy end to end over HTTP: the openai SDK -> gateway -> the vLLM simulator."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

MAX_MODEL_LEN = 512


@pytest.fixture
def sim(tokenizer: Any, tokenizer_dir: Any) -> Iterator[SimServer]:
    config = SimConfig(
        model="tiny",
        root=str(tokenizer_dir),
        max_model_len=MAX_MODEL_LEN,
        num_blocks=256,
        block_size=16,
        tokenizer=tokenizer,
    )
    with run_sim_server(config) as server:
        yield server


@pytest.fixture
def gateway(sim: SimServer, base_settings: Settings) -> Iterator[GatewayServer]:
    with run_gateway(base_settings, upstream=sim.url) as gw:
        yield gw


@pytest.fixture
def client(gateway: GatewayServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def reference_chat_count(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return len(tokenizer.encode(text, add_special_tokens=False))


CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": [{"type": "text", "text": "three"}, {"type": "text", "text": "four"}]},
    ],
]


@pytest.mark.parametrize("messages", CHATS)
def test_a_chat_is_counted_exactly_and_answered(
    client: openai.OpenAI, tokenizer: Any, messages: list[dict[str, Any]], gateway: GatewayServer
) -> None:
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=5)  # type: ignore[arg-type]
    completion = raw.parse()
    expected = reference_chat_count(tokenizer, messages)
    assert int(raw.headers["x-guard-prompt-tokens"]) == expected
    assert completion.usage is not None and completion.usage.prompt_tokens == expected
    assert raw.headers["x-guard-max-tokens"] == "5"
    assert raw.headers["x-request-id"]
    gateway.wait_ledger_empty()


@pytest.mark.parametrize(
    ("prompt", "expected_choices"),
    [("Once upon a time", 1), (["alpha beta", "gamma"], 2), ([5, 6, 7, 8], 1), ([[5, 6], [7, 8, 9]], 2)],
)
def test_completions_in_every_prompt_shape(client: openai.OpenAI, prompt: Any, expected_choices: int) -> None:
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=3)
    completion = raw.parse()
    assert len(completion.choices) == expected_choices
    assert completion.usage is not None
    assert int(raw.headers["x-guard-prompt-tokens"]) == completion.usage.prompt_tokens


def test_an_omitted_max_tokens_is_sent_explicitly(client: openai.OpenAI, sim: SimServer) -> None:
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=CHATS[0])  # type: ignore[arg-type]
    prompt = int(raw.headers["x-guard-prompt-tokens"])
    assert int(raw.headers["x-guard-max-tokens"]) == MAX_MODEL_LEN - prompt
    assert sim.sim.requests_seen[-1]["max_tokens"] == MAX_MODEL_LEN - prompt


def test_streaming_relays_chunks_and_keeps_include_usage(client: openai.OpenAI, gateway: GatewayServer) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHATS[1],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text, chunks
    assert len(usage) == 1 and usage[0].completion_tokens == 8
    gateway.wait_ledger_empty()


def test_a_prompt_over_the_context_is_rejected_with_the_count(client: openai.OpenAI) -> None:
    long = "word " * 2000
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}])
    assert info.value.code == "context_length_exceeded"
    assert f"{MAX_MODEL_LEN} tokens" in info.value.message


def test_truncation_on_request_keeps_the_system_message_and_the_newest_turn(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "old " * 600},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "newest question"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=messages,
        max_tokens=20,
        extra_headers={"x-guard-on-overflow": "truncate"},  # type: ignore[arg-type]
    )
    completion = raw.parse()
    assert int(raw.headers["x-guard-truncated-tokens"]) > 0
    assert completion.usage is not None
    assert completion.usage.prompt_tokens + 20 <= MAX_MODEL_LEN
    assert int(raw.headers["x-guard-prompt-tokens"]) == completion.usage.prompt_tokens


def test_max_tokens_over_what_is_left_is_clamped(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model="tiny", prompt="hello", max_tokens=100_000)
    completion = raw.parse()
    prompt = int(raw.headers["x-guard-prompt-tokens"])
    assert int(raw.headers["x-guard-max-tokens"]) == MAX_MODEL_LEN - prompt
    assert completion.usage is not None and completion.usage.completion_tokens <= MAX_MODEL_LEN - prompt


def test_models_report_the_gateways_limit(sim: SimServer, base_settings: Settings) -> None:
    with run_gateway(base_settings, upstream=sim.url, max_model_len=300) as gw:
        models = httpx.get(gw.url + "/v1/models").json()
    assert models["data"][0]["max_model_len"] == 300


BAD_INPUTS: list[tuple[str, bytes, dict[str, str], int, str]] = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', {}, 400, "invalid_request_error"),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff"}]}', {}, 400, "invalid_request_error"),
    ("not an object", b"[]", {}, 400, "invalid_request_error"),
    ("messages wrong type", b'{"messages": "hi"}', {}, 400, "invalid_request_error"),
    ("empty messages", b'{"messages": []}', {}, 400, "invalid_request_error"),
    ("role-less message", b'{"messages": [{"content": "hi"}]}', {}, 400, "invalid_request_error"),
    (
        "zero max_tokens",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
        {},
        400,
        "invalid_request_error",
    ),
    (
        "negative max_tokens",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
        {},
        400,
        "invalid_request_error",
    ),
    (
        "string max_tokens",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}',
        {},
        400,
        "invalid_request_error",
    ),
    ("n zero", b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}', {}, 400, "invalid_request_error"),
    ("n huge", b'{"messages": [{"role": "user", "content": "hi"}], "n": 1000000}', {}, 400, "invalid_request_error"),
    (
        "unknown model",
        b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}',
        {},
        404,
        "invalid_request_error",
    ),
    (
        "bad priority header",
        b'{"messages": [{"role": "user", "content": "hi"}]}',
        {"x-guard-priority": "high"},
        400,
        "invalid_request_error",
    ),
    (
        "bad overflow header",
        b'{"messages": [{"role": "user", "content": "hi"}]}',
        {"x-guard-on-overflow": "drop"},
        400,
        "invalid_request_error",
    ),
]


@pytest.mark.parametrize(("case", "body", "headers", "status", "etype"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_clear_openai_error(
    gateway: GatewayServer, case: str, body: bytes, headers: dict[str, str], status: int, etype: str
) -> None:
    r = httpx.post(
        gateway.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json", **headers}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == etype and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    gateway.wait_ledger_empty()


def test_an_oversized_body_gets_413(sim: SimServer, base_settings: Settings) -> None:
    with run_gateway(base_settings, upstream=sim.url, max_body_bytes=2048) as gw:
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_fields_pass_through_untouched(client: openai.OpenAI, sim: SimServer) -> None:
    client.chat.completions.create(
        model="tiny",
        messages=CHATS[0],
        max_tokens=2,
        extra_body={"x_vendor": {"k": [1, 2]}, "top_k": 3},  # type: ignore[arg-type]
    )
    seen = sim.sim.requests_seen[-1]
    assert seen["x_vendor"] == {"k": [1, 2]} and seen["top_k"] == 3


def test_request_ids_are_propagated(gateway: GatewayServer) -> None:
    r = httpx.post(
        gateway.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"x-request-id": "abc-123"}
    )
    assert r.headers["x-request-id"] == "abc-123"


def test_a_client_that_disconnects_mid_stream_cancels_the_upstream_request(
    sim: SimServer, base_settings: Settings, tokenizer: Any, tokenizer_dir: Any
) -> None:
    sim.sim.config.token_delay = 0.02
    with run_gateway(base_settings, upstream=sim.url) as gw:
        with (
            httpx.Client() as h,
            h.stream("POST", gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 400, "stream": True}) as r,
        ):
            for _ in r.iter_raw():
                break
        wait_until(lambda: sim.sim.cancelled >= 1 and gw.ledger_is_empty())


def wait_until(condition: Any, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


class TestAuth:
    def test_a_missing_or_wrong_key_gets_401_and_a_right_one_passes(
        self, sim: SimServer, base_settings: Settings
    ) -> None:
        with run_gateway(base_settings, upstream=sim.url, api_key=["k1", "k2=5"]) as gw:
            body = {"prompt": "x", "max_tokens": 1}
            missing = httpx.post(gw.url + "/v1/completions", json=body)
            wrong = httpx.post(gw.url + "/v1/completions", json=body, headers={"authorization": "Bearer nope"})
            right = httpx.post(gw.url + "/v1/completions", json=body, headers={"authorization": "Bearer k2"})
        for r in (missing, wrong):
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert right.status_code == 200

    def test_the_upstream_key_is_injected(self, tokenizer: Any, tokenizer_dir: Any, base_settings: Settings) -> None:
        config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, api_key="up-secret")
        with (
            run_sim_server(config) as sim,
            run_gateway(base_settings, upstream=sim.url, upstream_api_key="up-secret") as gw,
        ):
            r = httpx.post(
                gw.url + "/v1/completions",
                json={"prompt": "x", "max_tokens": 1},
                headers={"authorization": "Bearer client-key-not-forwarded"},
            )
        assert r.status_code == 200, r.text


class TestUpstreamFaults:
    def test_an_unreachable_upstream_gives_503_with_retry_after(self, base_settings: Settings) -> None:
        from testing.gateway_thread import free_port

        with run_gateway(base_settings, upstream=f"http://127.0.0.1:{free_port()}") as gw:
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "retry-after" in r.headers
        assert r.json()["error"]["type"] == "server_error"

    @pytest.mark.parametrize(
        ("fault", "status", "code"),
        [
            ("HANG", 504, "upstream_timeout"),
            ("RESET", 503, "upstream_unavailable"),
            ("GARBAGE", 502, "bad_upstream_response"),
            ("ERROR_500", 500, None),
        ],
    )
    def test_upstream_faults_become_openai_errors_and_leak_nothing(
        self, sim: SimServer, base_settings: Settings, fault: str, status: int, code: str | None
    ) -> None:
        from testing.vllm_sim import Fault

        with run_gateway(base_settings, upstream=sim.url, read_timeout=1.0) as gw:
            assert gw.parts.models.cached is not None  # the listing was read while the upstream was healthy
            sim.sim.config.fault = Fault[fault]
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
            sim.sim.config.fault = None
            assert r.status_code == status, r.text
            assert r.json()["error"]["code"] == code
            gw.wait_ledger_empty()


def test_metrics_health_and_status_are_served(client: openai.OpenAI, gateway: GatewayServer) -> None:
    client.completions.create(model="tiny", prompt="x", max_tokens=1)
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'vllm_guard_requests_total{outcome="ok",route="completions"} 1.0' in metrics
    assert "vllm_guard_prompt_tokens_bucket" in metrics
    health = httpx.get(gateway.url + "/health")
    assert health.status_code == 200 and health.json()["upstream"]["state"] == "ready"
    status = httpx.get(gateway.url + "/guard/status").json()
    for key in (
        "block_size",
        "capacity_blocks",
        "committed_blocks",
        "live_used_blocks",
        "in_flight",
        "queued",
        "upstream",
        "restarts",
    ):
        assert key in status
    assert {"url", "state", "max_model_len", "last_restart_reason"} <= set(status["upstream"])


def test_tokenize_and_other_v1_routes_pass_through(gateway: GatewayServer) -> None:
    r = httpx.post(gateway.url + "/tokenize", json={"model": "tiny", "prompt": "hello"})
    assert r.status_code == 200 and r.json()["count"] > 0
    missing = httpx.get(gateway.url + "/v1/no-such-thing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_a_bug_in_the_gateway_is_a_500_with_no_internals(
    gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from gateway.guard import planning

    async def broken(*args: Any) -> list[int]:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(planning, "count", broken)
    r = httpx.post(gateway.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert "secret" not in r.text
    gateway.wait_ledger_empty()
