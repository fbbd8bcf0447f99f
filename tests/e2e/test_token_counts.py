"""The gateway counts prompt tokens exactly as the real vLLM does, for every shape of request, and its prompt
token ids (local tokenizer and the engine's /tokenize alike) are exactly the ids vLLM schedules."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.guard.counting import LocalCounter, PromptTokens, RemoteCounter, load_tokenizer
from testing.payloads import token_ids
from testing.servers import ServerProcess

pytestmark = pytest.mark.e2e

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}

CHAT_CASES: list[tuple[str, dict[str, Any]]] = [
    ("a single user message", {"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    (
        "a system message before the user",
        {
            "messages": [
                {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                {"role": "user", "content": "Summarize the document in three sentences."},
            ]
        },
    ),
    (
        "a multi-turn conversation",
        {
            "messages": [
                {"role": "system", "content": "Be precise."},
                {"role": "user", "content": "What is the weather like today?"},
                {"role": "assistant", "content": "It is sunny with a light breeze."},
                {"role": "user", "content": "And tomorrow, in degrees Celsius?"},
            ]
        },
    ),
    (
        "content given as text parts",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Read this first part."},
                        {"type": "text", "text": " Then this second part, and answer."},
                    ],
                }
            ]
        },
    ),
    (
        "tools offered to the model",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER_TOOL],
            # "auto" would need a tool-call parser in vLLM; "none" still renders the tools in the prompt.
            "tool_choice": "none",
        },
    ),
    (
        "a tool call and its result in the history",
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            ],
            "tools": [WEATHER_TOOL],
            "tool_choice": "none",
        },
    ),
    (
        "no generation prompt",
        {
            "messages": [{"role": "user", "content": "Hello!"}],
            "extra_body": {"add_generation_prompt": False},
        },
    ),
    (
        "continuing the final assistant message",
        {
            "messages": [
                {"role": "user", "content": "Count to five."},
                {"role": "assistant", "content": "One, two, three"},
            ],
            "extra_body": {"add_generation_prompt": False, "continue_final_message": True},
        },
    ),
]

COMPLETION_CASES: list[tuple[str, str | list[str] | list[int] | list[list[int]]]] = [
    ("a string", "Once upon a time there was a small model"),
    ("a list of strings", ["The quick brown fox", "jumps over the lazy dog", "again and again"]),
    ("token ids", token_ids(37, seed=1)),
    ("a list of token-id prompts", [token_ids(11, seed=2), token_ids(23, seed=3)]),
]


@pytest.mark.parametrize(("case", "request_args"), CHAT_CASES, ids=[c for c, _ in CHAT_CASES])
def test_chat_prompt_count_matches_vllm_usage(
    client: openai.OpenAI, case: str, request_args: dict[str, Any]
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", max_tokens=1, temperature=0.0, **request_args
    )
    completion = raw.parse()

    assert completion.usage is not None
    assert int(raw.headers["x-guard-prompt-tokens"]) == completion.usage.prompt_tokens, case


@pytest.mark.parametrize(("case", "prompt"), COMPLETION_CASES, ids=[c for c, _ in COMPLETION_CASES])
def test_completion_prompt_count_matches_vllm_usage(
    client: openai.OpenAI, case: str, prompt: str | list[str] | list[int] | list[list[int]]
) -> None:
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0.0)
    completion = raw.parse()

    assert completion.usage is not None
    # vLLM's usage sums the prompt tokens of every prompt in a batch; so must the gateway's header.
    assert int(raw.headers["x-guard-prompt-tokens"]) == completion.usage.prompt_tokens, case


def test_gateway_and_direct_vllm_agree_on_the_same_chat(
    client: openai.OpenAI, vllm_client: openai.OpenAI
) -> None:
    messages: Any = CHAT_CASES[2][1]["messages"]

    through_gateway = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=1
    )
    direct = vllm_client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)

    assert direct.usage is not None
    assert int(through_gateway.headers["x-guard-prompt-tokens"]) == direct.usage.prompt_tokens


# -- token ids: the gateway's against those vLLM schedules (``return_token_ids``) -------------------------
@pytest.fixture(scope="module")
def counters(tiny_model: Path, vllm: ServerProcess) -> Iterator[tuple[LocalCounter, RemoteCounter]]:
    """The gateway's two counters for the served model: its tokenizer (as the gateway loads it from
    /v1/models' root), and the engine's /tokenize."""
    with httpx.Client(base_url=vllm.url, timeout=60) as http:

        async def tokenize(payload: dict[str, Any]) -> dict[str, Any]:
            answer = await asyncio.to_thread(http.post, "/tokenize", json=payload)
            answer.raise_for_status()
            result: dict[str, Any] = answer.json()
            return result

        yield LocalCounter(load_tokenizer(str(tiny_model))), RemoteCounter(tokenize, "tiny")


def chat_body(request_args: dict[str, Any]) -> dict[str, Any]:
    """The chat request the SDK sends for ``request_args`` (extra_body merged in), without the model."""
    body = {k: v for k, v in request_args.items() if k != "extra_body"}
    return {**body, **request_args.get("extra_body", {})}


def gateway_tokens(counters: tuple[LocalCounter, RemoteCounter], chat: dict[str, Any] | None = None,
                   prompt: Any = None) -> list[list[PromptTokens]]:
    """Each prompt's tokens by each counter: [local, remote] for every prompt."""

    async def both() -> list[list[PromptTokens]]:
        if chat is not None:
            return [[await c.tokenize_chat(chat)] for c in counters]
        return [await c.tokenize_prompts(prompt) for c in counters]

    return asyncio.run(both())


@pytest.mark.parametrize(("case", "request_args"), CHAT_CASES, ids=[c for c, _ in CHAT_CASES])
def test_chat_prompt_ids_are_the_ids_vllm_schedules(
    client: openai.OpenAI, counters: tuple[LocalCounter, RemoteCounter], case: str, request_args: dict[str, Any]
) -> None:
    extra = {**request_args.get("extra_body", {}), "return_token_ids": True}
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", max_tokens=1, temperature=0.0, **{**request_args, "extra_body": extra}
    )
    scheduled = raw.http_response.json()["prompt_token_ids"]

    local, remote = gateway_tokens(counters, chat=chat_body(request_args))
    assert scheduled and int(raw.headers["x-guard-prompt-tokens"]) == len(scheduled), case
    assert local == remote == [PromptTokens(len(scheduled), tuple(scheduled))], case


@pytest.mark.parametrize(("case", "prompt"), COMPLETION_CASES, ids=[c for c, _ in COMPLETION_CASES])
def test_completion_prompt_ids_are_the_ids_vllm_schedules(
    client: openai.OpenAI, counters: tuple[LocalCounter, RemoteCounter], case: str,
    prompt: str | list[str] | list[int] | list[list[int]],
) -> None:
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0.0, extra_body={"return_token_ids": True}
    )
    choices = sorted(raw.http_response.json()["choices"], key=lambda c: c["index"])
    scheduled = [tuple(c["prompt_token_ids"]) for c in choices]

    local, remote = gateway_tokens(counters, prompt=prompt)
    assert local == remote == [PromptTokens(len(ids), ids) for ids in scheduled], case
