"""Chat requests rewritten as vLLM rewrites them before its template runs, and refused as it refuses them."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.guard.counting import LocalCounter
from tests.unit.guard.counting.chats import ANSWER, CALL, DUMPED_BARE_TOOL, U, reference

# Requests that vLLM rewrites before its template runs, each with the request it becomes.
EQUIVALENT: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "tool-call arguments given as a JSON string are parsed",
        {
            "messages": [
                U,
                {**CALL, "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            ]
        },
        {
            "messages": [
                U,
                {**CALL, "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            ]
        },
    ),
    (
        "arguments that are not a JSON object become {}",
        {"messages": [U, {**CALL, "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}]},
        {"messages": [U, {**CALL, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
    ),
    (
        "tool answers given as parts are joined with newlines",
        {"messages": [U, CALL, {**ANSWER, "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
        {"messages": [U, CALL, {**ANSWER, "content": "a\nb"}]},
    ),
    (
        "developer messages become one system message up front",
        {"messages": [{"role": "system", "content": "S"}, U, {"role": "developer", "content": "D"}]},
        {"messages": [{"role": "system", "content": "S\n\nD"}, U]},
    ),
    (
        "a missing content is empty text",
        {"messages": [U, {"role": "assistant", "content": None}, U]},
        {"messages": [U, {"role": "assistant", "content": ""}, U]},
    ),
    (
        "a tool without description or parameters is dumped with nulls",
        {"messages": [U], "tools": [{"type": "function", "function": {"name": "noop", "extra": 1}}]},
        {"messages": [U], "tools": [DUMPED_BARE_TOOL], "_reference_only": True},
    ),
    (
        "reasoning_effort none switches thinking off",
        {"messages": [U], "reasoning_effort": "none"},
        {"messages": [U], "chat_template_kwargs": {"enable_thinking": False}},
    ),
    (
        "add_generation_prompt inside chat_template_kwargs loses to the request field",
        {"messages": [U], "chat_template_kwargs": {"add_generation_prompt": False}},
        {"messages": [U]},
    ),
    (
        "the per-request billing header line is dropped from system text",
        {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."}, U]},
        {"messages": [{"role": "system", "content": "Be brief."}, U]},
    ),
]


@pytest.mark.parametrize(("case", "body", "same_as"), EQUIVALENT, ids=[c for c, _, _ in EQUIVALENT])
async def test_requests_are_rewritten_as_vllm_does(
    counter: LocalCounter, tokenizer: Any, case: str, body: dict[str, Any], same_as: dict[str, Any]
) -> None:
    same_as = {k: v for k, v in same_as.items() if k != "_reference_only"}
    assert await counter.count_chat(body) == reference(tokenizer, same_as)


BAD_CHATS: list[tuple[dict[str, Any], str | None, str]] = [
    ({}, "messages", "must be a list of message objects"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [U, "hi"]}, "messages[1]", "must be an object"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "needs a 'role' string"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "not a number"),
    ({"messages": [{"role": "user", "content": ["a", 5]}]}, "messages[0].content[1]", "must be an object"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
        "must be a string",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "video_game"}]}]},
        "messages[0].content[0].type",
        "got 'video_game'",
    ),
    (
        {"messages": [U, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
        "messages[1].tool_calls[0].function.name",
        "must be a string",
    ),
    ({"messages": [U], "tools": [{"type": "function"}]}, "tools[0]", "function tool"),
    ({"messages": [U], "chat_template_kwargs": []}, "chat_template_kwargs", "must be an object"),
    ({"messages": [U], "add_generation_prompt": "yes"}, "add_generation_prompt", "must be a boolean"),
    (
        {"messages": [U], "continue_final_message": True, "add_generation_prompt": True},
        "continue_final_message",
        "Cannot set both",
    ),
    ({"messages": [U], "continue_final_message": True}, None, "not compatible"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, None, "Unknown message role: narrator"),
    (
        {"messages": [U, U], "chat_template": "{{ raise_exception('Conversation roles must alternate') }}"},
        "chat_template",
        "--trust-request-chat-template",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
        "only the engine can count its tokens",
    ),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_CHATS)
async def test_bad_chat_requests_are_invalid_requests_naming_the_parameter(
    counter: LocalCounter, body: dict[str, Any], param: str | None, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        await counter.count_chat(body)
    assert caught.value.param == param
