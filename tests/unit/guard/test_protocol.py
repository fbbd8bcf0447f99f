from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.guard.context import Booking, Plan
from gateway.guard.endpoints.base import decode_json, engine_body
from gateway.guard.endpoints.chat import parse_chat
from gateway.guard.endpoints.completions import parse_completion
from gateway.http.errors import status_and_type

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"", "empty"),
        (b"   ", "empty"),
        (b"{not json", "not valid JSON"),
        (b'{"a": "\xff\xfe"}', "not valid UTF-8"),
        (b"[1, 2]", "a list"),
        (b'"text"', "a string"),
        (b"null", "null"),
    ],
)
def test_bodies_that_are_not_json_objects_are_refused(raw: bytes, words: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_json(raw)
    assert words in info.value.message and status_and_type(info.value)[0] == 400


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"messages": None}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [1]}, "messages[0]"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"n": 100000}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": 3}, "model"),
        ({"tools": {}}, "tools"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ],
)
def test_chat_fields_the_gateway_reads_are_type_checked(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat({**CHAT, **patch})
    assert info.value.param == param


def test_a_chat_request_keeps_unknown_fields_and_reads_its_limits() -> None:
    body = {**CHAT, "max_completion_tokens": 7, "n": 3, "stream": True, "x_custom": {"a": 1}}
    req = parse_chat(body)
    assert (req.route, req.model, req.stream, req.n, req.max_tokens) == ("chat", "tiny", True, 3, 7)
    assert req.body["x_custom"] == {"a": 1}


@pytest.mark.parametrize(
    ("prompt", "kind", "prompts"),
    [
        ("hello", "text", ["hello"]),
        (["a", "b"], "texts", ["a", "b"]),
        ([1, 2, 3], "ids", [[1, 2, 3]]),
        ([[1, 2], [3]], "ids_list", [[1, 2], [3]]),
    ],
)
def test_completion_prompts_come_in_four_shapes(prompt: Any, kind: str, prompts: list[Any]) -> None:
    req = parse_completion({"prompt": prompt})
    assert (req.prompt_kind, req.prompts) == (kind, prompts)


@pytest.mark.parametrize("prompt", [None, 5, [], [[]], [1, "a"], [[1], "a"], [True, 1], {"text": "x"}])
def test_malformed_completion_prompts_are_refused(prompt: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion({"prompt": prompt})
    assert info.value.param == "prompt"


@pytest.mark.parametrize(("n", "best_of", "expected"), [(None, None, 1), (2, None, 2), (2, 5, 5)])
def test_best_of_counts_as_generated_sequences(n: int | None, best_of: int | None, expected: int) -> None:
    body: dict[str, Any] = {"prompt": "x", "n": n, "best_of": best_of}
    assert parse_completion(body).n == expected


def test_best_of_below_n_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        parse_completion({"prompt": "x", "n": 3, "best_of": 2})


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({**CHAT}, {"max_tokens": 9}),
        ({**CHAT, "max_completion_tokens": 100}, {"max_completion_tokens": 9}),
        ({**CHAT, "max_tokens": 100, "max_completion_tokens": 100}, {"max_tokens": 9, "max_completion_tokens": 9}),
    ],
)
def test_max_tokens_is_written_to_the_fields_the_client_used(body: dict[str, Any], fields: dict[str, int]) -> None:
    asked = {**body}
    req = parse_chat(body)
    sent, _ = engine_body(req, Plan(Booking(1, 9, 1), max_tokens=9))
    for name, value in fields.items():
        assert sent[name] == value
    assert set(fields) <= set(sent)
    assert req.body == asked  # the client's body is never edited


def test_the_engine_body_keeps_the_clients_field_order_and_adds_new_fields_last() -> None:
    req = parse_chat({"max_tokens": 100, **CHAT, "stream": True})
    sent, _ = engine_body(req, Plan(Booking(1, 9, 1, stream=True), max_tokens=9, messages=[{"role": "user"}]))
    assert list(sent) == ["max_tokens", "model", "messages", "stream", "stream_options"]
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert (sent["max_tokens"], sent["messages"]) == (9, [{"role": "user"}])


@pytest.mark.parametrize(
    ("prompt", "new", "written"),
    [("long text", ["text"], "text"), (["a", "b"], ["a", "c"], ["a", "c"]), ([1, 2, 3], [[3]], [3])],
)
def test_truncated_prompts_keep_the_clients_shape(prompt: Any, new: list[Any], written: Any) -> None:
    req = parse_completion({"prompt": prompt})
    sent, _ = engine_body(req, Plan(Booking(1, 1, 1), prompts=new))
    assert sent["prompt"] == written and req.body["prompt"] == prompt
