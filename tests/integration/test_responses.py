"""POST /v1/responses through the guard: rendered as vLLM renders it, counted, clamped, booked, and refused
where the gateway cannot count (stored state) — against the vLLM simulator, and checked against vLLM's own
conversion code where vLLM is installed."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.config import Settings
from gateway.errors import InvalidRequest
from gateway.guard.counting.chatformat import normalize_tools
from gateway.guard.endpoints.responses import chat_tools, continues_final_message, input_messages, parse_responses
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server
from tests.integration.test_proxy import wait_until

MAX_MODEL_LEN = 512

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}

# (id, request fields): every input shape vLLM renders differently.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("a string input", {"input": "What is the capital of France?"}),
    ("instructions before a string input", {"instructions": "Answer briefly.", "input": "Why is the sky blue?"}),
    ("an empty instructions string is dropped", {"instructions": "", "input": "Hello"}),
    (
        "message items with input_text parts",
        {"input": [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Read this first part."},
            {"type": "input_text", "text": "Then this one, and answer."}]}]},
    ),
    (
        "a multi-turn conversation with an earlier answer",
        {"input": [
            {"role": "user", "content": "Hi there"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Hello! How can I help?"},
                {"type": "output_text", "text": "(ignored: vLLM keeps the first part)"}]},
            {"role": "user", "content": "Tell me a joke."}]},
    ),
    (
        "a developer message",
        {"input": [{"role": "developer", "content": "Use metric units."},
                   {"role": "user", "content": "How far is the moon?"}]},
    ),
    (
        "a function call and its output, with tools",
        {"tools": [WEATHER], "tool_choice": "none", "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}]},
    ),
    (
        "reasoning merged into the answer that follows it",
        {"input": [
            {"role": "user", "content": "2 + 2?"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Add them."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
            {"role": "user", "content": "And 3 + 3?"}]},
    ),
    (
        "a partial assistant message is continued",
        {"input": [
            {"role": "user", "content": "Count to five."},
            {"type": "message", "role": "assistant", "status": "incomplete",
             "content": [{"type": "output_text", "text": "One, two, three"}]}]},
    ),
    (
        "custom and namespaced tools, built-in tools left out",
        {"tool_choice": "none", "input": "List the files.", "tools": [
            {"type": "custom", "name": "shell", "description": "Run a shell command."},
            {"type": "namespace", "name": "fs", "description": "Files.", "tools": [
                {"type": "function", "name": "read", "parameters": {"type": "object"}}]},
            {"type": "web_search_preview"}]},
    ),
    (
        "a custom tool call and its output",
        {"input": [
            {"role": "user", "content": "List files."},
            {"type": "custom_tool_call", "call_id": "c1", "name": "shell", "input": "ls -l"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "a.txt b.txt"}]},
    ),
]


# -- the conversion, against vLLM's own code ------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_responses() -> Any:
    # vLLM's own imports (torch, triton) warn about themselves: nothing this suite is about.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm", reason="vLLM is not installed here")
        from vllm.entrypoints.openai.responses import protocol, utils

    return protocol, utils


@pytest.mark.parametrize(("case", "fields"), CASES, ids=[c for c, _ in CASES])
def test_the_conversation_is_the_one_vllm_builds(vllm_responses: Any, case: str, fields: dict[str, Any]) -> None:
    protocol, utils = vllm_responses
    theirs = protocol.ResponsesRequest(model="tiny", **fields)
    expected_messages = utils.construct_input_messages(
        request_instructions=theirs.instructions, request_input=theirs.input
    )
    expected_tools = utils.construct_tool_dicts(theirs.tools, theirs.tool_choice)

    assert input_messages(fields.get("instructions"), fields["input"]) == expected_messages
    assert normalize_tools(chat_tools(fields.get("tools"))) == expected_tools
    assert continues_final_message(fields["input"]) is utils.should_continue_final_message(theirs.input)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stored in the engine"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "stored conversation"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt"),
        ({"input": "x", "previous_input_messages": []}, "previous_input_messages", "Harmony"),
        ({"input": "x", "background": True}, "background", "keeps generating"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "stored item by id"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]}, "input[0].encrypted_content",
         "Encrypted"),
        ({"input": 5}, "input", "string or a list"),
        ({"input": []}, "input", "empty"),
        ({"input": "x", "instructions": 3}, "instructions", "string"),
        ({"input": ["hello"]}, "input[0]", "object"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "Unsupported input item type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "one of"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "string"),
        ({"input": [{"role": "assistant", "content": []}]}, "input[0].content", "output_text"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "string"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens", "integer"),
        ({"input": "x", "stream": "yes"}, "stream", "boolean"),
        ({"input": "x", "truncation": "sometimes"}, "truncation", "'auto' or 'disabled'"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_what_cannot_be_counted_or_is_malformed_is_refused_clearly(
    body: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_responses(body)
    assert info.value.param == param
    assert words in info.value.message


def test_the_clamped_bound_is_written_to_max_output_tokens_only() -> None:
    from gateway.guard.context import Booking, Plan
    from gateway.guard.endpoints.base import engine_body

    req = parse_responses({"input": "x", "max_output_tokens": 900})
    sent, _ = engine_body(req, Plan(Booking(1, 40, 1), max_tokens=40))
    assert sent["max_output_tokens"] == 40 and "max_tokens" not in sent


# -- through the gateway --------------------------------------------------------------------------------
@pytest.fixture
def sim(tokenizer: Any, tokenizer_dir: Any) -> Iterator[SimServer]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), max_model_len=MAX_MODEL_LEN, num_blocks=256,
                       block_size=16, tokenizer=tokenizer)
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


@pytest.mark.parametrize(("case", "fields"), CASES, ids=[c for c, _ in CASES])
def test_every_input_shape_is_counted_as_the_engine_counts_it(
    client: openai.OpenAI, gateway: GatewayServer, case: str, fields: dict[str, Any]
) -> None:
    raw = client.responses.with_raw_response.create(model="tiny", max_output_tokens=4, **fields)
    response = raw.parse()

    assert response.usage is not None
    assert int(raw.headers["x-guard-prompt-tokens"]) == response.usage.input_tokens, case
    assert raw.headers["x-guard-max-tokens"] == "4"
    gateway.wait_ledger_empty()


def test_the_sdk_gets_its_answer(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Say something.", max_output_tokens=5)
    assert response.output_text
    assert response.usage is not None and response.usage.output_tokens == 5


@pytest.mark.parametrize(
    ("requested", "expected"),
    [(10_000, "what the context leaves"), (None, "what the context leaves"), (7, 7)],
    ids=["too large: clamped", "omitted: sent explicitly", "within the context: kept"],
)
def test_max_output_tokens_is_bounded_by_what_the_context_leaves(
    client: openai.OpenAI, sim: SimServer, requested: int | None, expected: int | str
) -> None:
    extra = {} if requested is None else {"max_output_tokens": requested}
    raw = client.responses.with_raw_response.create(model="tiny", input="Hello", **extra)  # type: ignore[arg-type]
    prompt = int(raw.headers["x-guard-prompt-tokens"])
    bound = MAX_MODEL_LEN - prompt if expected == "what the context leaves" else expected
    assert int(raw.headers["x-guard-max-tokens"]) == bound
    sent = sim.sim.requests_seen[-1]
    assert sent["max_output_tokens"] == bound and "max_tokens" not in sent


def test_max_output_tokens_over_the_context_is_rejected_by_that_name_under_the_reject_policy(
    sim: SimServer, base_settings: Settings
) -> None:
    with run_gateway(base_settings, upstream=sim.url, on_max_tokens_overflow="reject") as gw:
        answer = httpx.post(gw.url + "/v1/responses", json={"input": "Hello", "max_output_tokens": 10_000})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["param"] == "max_output_tokens" and error["code"] == "context_length_exceeded"
        assert "max_output_tokens can be at most" in error["message"]
        assert not sim.sim.requests_seen
        gw.wait_ledger_empty()


@pytest.mark.parametrize("overflow", ["reject", "truncate"])
def test_input_over_the_context_is_rejected_even_when_truncation_is_asked_for(
    gateway: GatewayServer, sim: SimServer, overflow: str
) -> None:
    body = {"input": [{"role": "user", "content": "word " * 2000}], "truncation": "auto"}
    answer = httpx.post(gateway.url + "/v1/responses", json=body, headers={"x-guard-on-overflow": overflow})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert ("never truncated" in error["message"]) is (overflow == "truncate")
    assert not sim.sim.requests_seen
    gateway.wait_ledger_empty()


@pytest.mark.parametrize(
    ("field", "value"),
    [("previous_response_id", "resp_abc"), ("conversation", {"id": "conv_1"}), ("background", True)],
)
def test_stateful_requests_are_refused_before_reaching_the_engine(
    gateway: GatewayServer, sim: SimServer, field: str, value: Any
) -> None:
    answer = httpx.post(gateway.url + "/v1/responses", json={"model": "tiny", "input": "Hi", field: value})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == field
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert not sim.sim.requests_seen


def test_a_stream_is_relayed_event_by_event_with_its_usage(client: openai.OpenAI, gateway: GatewayServer) -> None:
    raw = client.responses.with_raw_response.create(model="tiny", input="Stream please.", max_output_tokens=6,
                                                     stream=True)
    events = list(raw.parse())
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 6
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.input_tokens == int(raw.headers["x-guard-prompt-tokens"])
    gateway.wait_ledger_empty()


def test_a_client_leaving_mid_stream_frees_its_blocks(tokenizer: Any, tokenizer_dir: Any,
                                                      base_settings: Settings) -> None:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), max_model_len=MAX_MODEL_LEN, num_blocks=256,
                       block_size=16, tokenizer=tokenizer, token_delay=0.02)
    with run_sim_server(config) as sim, run_gateway(base_settings, upstream=sim.url) as gw:
        body = {"model": "tiny", "input": "Go on for a while.", "max_output_tokens": 200, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=10) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()
            assert next(lines).startswith("event: response.created")
            assert gw.status()["committed_blocks"] > 0
        wait_until(lambda: gw.ledger_is_empty())
