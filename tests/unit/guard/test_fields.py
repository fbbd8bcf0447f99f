"""The request-field table: every refused field is refused by its route's parser with a 400 naming it, the values
vLLM reads as harmless pass, and the fields counted or harmless pass whatever their value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gateway.errors import UnsupportedField
from gateway.guard import fields
from gateway.guard.endpoints.chat import CHAT, parse_chat
from gateway.guard.endpoints.table import BY_NAME
from gateway.guard.fields import ROUTES, TABLE
from gateway.guard.prefixes import reads_prefix_cache
from gateway.http.errors import error_body, status_and_type

IDS = {"prompt_token_ids": [1, 2, 3]}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
BASES: dict[str, dict[str, Any]] = {
    "chat": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    "completions": {"model": "tiny", "prompt": "hi", "max_tokens": 8},
    "responses": {"model": "tiny", "input": "hi", "max_output_tokens": 8},
    "embeddings": {"model": "tiny", "input": "hi"},
    "pooling": {"model": "tiny", "input": "hi"},
    "classify": {"model": "tiny", "input": "hi"},
    "score": {"model": "tiny", "text_1": "a", "text_2": ["b", "c"]},
    "rerank": {"model": "tiny", "query": "a", "documents": ["b", "c"]},
}
PARSE: dict[str, Callable[[dict[str, Any]], Any]] = {name: endpoint.parse for name, endpoint in BY_NAME.items()}
_GENERATE = ("chat", "completions", "responses")
_EVERYWHERE = ROUTES
# A value each refused field is refused with, on the routes that have it: the table claims exactly these.
REFUSED: dict[str, tuple[Any, tuple[str, ...]]] = {
    "kv_transfer_params": (IDS, _GENERATE),
    "ec_transfer_params": ({"do_remote_encode": True}, _GENERATE),
    "vllm_xargs": ({"kv_transfer_params": IDS}, _GENERATE),
    "priority": (-5, _EVERYWHERE),
    "mm_processor_kwargs": ({"max_pixels": 10**9}, _EVERYWHERE[:1] + _EVERYWHERE[2:]),
    "media_io_kwargs": ({"video": {"num_frames": 10**6}}, ("chat", "responses", "embeddings", "pooling", "classify")),
    "min_tokens": (9, ("chat", "completions")),
    "use_beam_search": (True, ("chat", "completions")),
    "prompt_embeds": ("AAAA", ("completions",)),
    "suffix": ("def f(): return 1" * 100, ("completions",)),
    "previous_response_id": ("resp_1", ("responses",)),
    "previous_input_messages": ([{"role": "user", "content": "x"}], ("responses",)),
    "prompt": ({"id": "pmpt_1"}, ("responses",)),
    "background": (True, ("responses",)),
    "data": ({"plugin": "input"}, ("pooling",)),
    "instruction": ("Judge relevance at length.", ("score", "rerank")),
    "chat_template_kwargs": ({"instruction": "x" * 100}, ("score", "rerank")),
}
# Values of refused fields that vLLM treats as absent or within the booking: these pass.
ALLOWED: list[tuple[str, str, Any]] = [
    ("chat", "kv_transfer_params", None),
    ("chat", "kv_transfer_params", {}),
    ("chat", "priority", 0),
    ("chat", "use_beam_search", False),
    ("chat", "min_tokens", 8),
    ("completions", "min_tokens", 3),
    ("chat", "vllm_xargs", {"my_logits_processor": 3}),
    ("responses", "background", False),
    ("score", "chat_template_kwargs", {}),
    ("embeddings", "mm_processor_kwargs", {}),
    ("pooling", "data", {"plugin": "input"}),
]


def _refused_claims() -> set[tuple[str, str]]:
    return {(r, name) for r in ROUTES for name, rule in TABLE[r].items() if rule.kind == "refused"}


def _cases() -> list[Any]:
    return [pytest.param(r, name, value, id=f"{r}-{name}") for name, (value, routes) in REFUSED.items()
            for r in routes]  # fmt: skip


def test_the_table_classifies_the_fields_of_every_guarded_endpoint() -> None:
    assert set(ROUTES) == set(TABLE) == set(BY_NAME)


def test_the_refused_fields_are_exactly_those_the_table_claims() -> None:
    assert {(r, name) for name, (_, routes) in REFUSED.items() for r in routes} == _refused_claims()


@pytest.mark.parametrize("route", ROUTES)
def test_every_rule_has_a_class_and_a_reason_and_only_refusals_refuse(route: str) -> None:
    for name, rule in TABLE[route].items():
        assert rule.kind in ("counted", "harmless", "refused"), name
        assert len(rule.reason) > 10 and not rule.reason.endswith("."), name
        assert (rule.refuses is not None) == (rule.kind == "refused"), name


@pytest.mark.parametrize(("route", "name", "value"), _cases())
def test_a_refused_field_is_a_400_that_names_it_and_says_why(route: str, name: str, value: Any) -> None:
    body = {**BASES[route], name: value}
    if name == "data":
        del body["input"]  # vLLM reads a plugin's data only from a request without input
    with pytest.raises(UnsupportedField) as info:
        PARSE[route](body)

    err = info.value
    assert err.param == name and f"'{name}'" in err.message and TABLE[route][name].reason in err.message
    assert status_and_type(err) == (400, "invalid_request_error")
    assert error_body(err)["error"] == {
        "message": err.message, "type": "invalid_request_error", "param": name, "code": "unsupported_field",
    }


@pytest.mark.parametrize(("route", "name", "value"), ALLOWED, ids=[f"{r}-{n}-{v!r}" for r, n, v in ALLOWED])
def test_values_that_change_nothing_the_gateway_counts_pass(route: str, name: str, value: Any) -> None:
    PARSE[route]({**BASES[route], name: value})


@pytest.mark.parametrize("route", ROUTES)
def test_counted_and_harmless_fields_pass_whatever_their_value(route: str) -> None:
    for name, rule in TABLE[route].items():
        if rule.kind != "refused":
            fields.check(route, {name: {"anything": 1}})


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("chat", {"messages": [{"role": "user", "content": [IMAGE]}]}),
        ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
        ("embeddings", {"messages": [[{"role": "user", "content": [IMAGE]}]]}),
    ],
    ids=["chat", "responses", "a batch of embedding conversations"],
)
def test_processor_options_pass_with_media_the_engine_counts(route: str, body: dict[str, Any]) -> None:
    fields.check(route, {**body, "mm_processor_kwargs": {"max_pixels": 1024}, "media_io_kwargs": {"v": {}}})


def test_a_refused_field_is_named_even_among_counted_ones() -> None:
    body = {**BASES["chat"], "n": 2, "tools": [], "kv_transfer_params": IDS, "temperature": 0.0}

    with pytest.raises(UnsupportedField) as info:
        parse_chat(body)
    assert info.value.param == "kv_transfer_params" and "prompt_token_ids" in info.value.message


def test_fields_vllm_does_not_declare_pass_through_untouched() -> None:
    body = {**BASES["chat"], "best_of": 2, "x_custom": {"prompt_token_ids": [1]}}

    assert parse_chat(dict(body)).body == body


@pytest.mark.parametrize(
    ("body", "reads"),
    [
        ({}, True),
        ({"truncate_prompt_tokens": 100}, False),
        ({"truncate_prompt_tokens": -1}, False),
        ({"prompt_logprobs": 1}, False),
    ],
)
def test_a_prompt_the_engine_truncates_is_booked_without_prefix_sharing(body: dict[str, Any], reads: bool) -> None:
    assert reads_prefix_cache(CHAT, body) is reads
