"""The gateway counts prompt tokens exactly as the real vLLM does, for every shape of request."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from .payloads import token_ids

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
