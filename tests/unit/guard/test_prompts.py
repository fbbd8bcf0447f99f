"""The prompt fields' shape checks: one message per mistake, whichever path (parsing or counting) finds it."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.guard.counting import LocalCounter
from gateway.guard.endpoints.chat import parse_chat
from gateway.guard.endpoints.completions import parse_completion
from gateway.guard.prompts import json_type, prompt_list

U = {"role": "user", "content": "hi"}
MISTAKES: list[dict[str, Any]] = [
    {},
    {"messages": []},
    {"messages": [U, 3]},
    {"messages": [{"role": "", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [U], "tools": {}},
    {"messages": [U], "chat_template_kwargs": []},
    {"messages": [U], "add_generation_prompt": "no"},
    {"messages": [U], "continue_final_message": 1},
]


@pytest.mark.parametrize("body", MISTAKES)
async def test_a_chat_mistake_reads_the_same_in_parsing_and_in_counting(tokenizer: Any, body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as parsed:
        parse_chat(body)
    with pytest.raises(InvalidRequest) as counted:
        await LocalCounter(tokenizer).count_chat(body)
    assert (counted.value.message, counted.value.param) == (parsed.value.message, parsed.value.param)


def test_a_list_of_prompts_may_mix_shapes_but_a_request_may_not() -> None:
    assert prompt_list(["a", [1, 2]]) == ["a", [1, 2]]
    with pytest.raises(InvalidRequest) as refused:
        parse_completion({"prompt": ["a", [1, 2]]})
    with pytest.raises(InvalidRequest) as malformed:
        prompt_list(5)
    assert refused.value.message.split(";")[0] == malformed.value.message.split(";")[0]
    assert refused.value.param == malformed.value.param == "prompt"


@pytest.mark.parametrize(
    ("value", "words"),
    [(None, "null"), (True, "a boolean"), (1.5, "a number"), ("x", "a string"), ([], "an empty list"),
     ([1], "a list"), ({}, "an object")],
)  # fmt: skip
def test_json_types_are_named_as_a_client_wrote_them(value: Any, words: str) -> None:
    assert json_type(value) == words
