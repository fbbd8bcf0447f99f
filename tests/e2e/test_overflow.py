"""Prompts and max_tokens that do not fit: rejected, truncated or clamped by the gateway, never by luck."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from testing.payloads import token_ids, words
from testing.servers import DEFAULT_MAX_MODEL_LEN, GATEWAY_MAX_MODEL_LEN

pytestmark = pytest.mark.e2e


def test_a_prompt_over_the_gateway_limit_is_rejected_with_context_length_exceeded(client: openai.OpenAI) -> None:
    # vLLM itself would take this prompt (its limit is 2048): only the gateway's 1536 refuses it.
    prompt = token_ids(GATEWAY_MAX_MODEL_LEN + 64, seed=10)

    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=8)

    error = caught.value
    assert error.status_code == 400
    assert error.code == "context_length_exceeded"
    assert isinstance(error.body, dict)
    assert error.body["type"] == "invalid_request_error"
    # The message states the limit and the value given.
    assert str(GATEWAY_MAX_MODEL_LEN) in error.body["message"]
    assert str(len(prompt)) in error.body["message"]


def test_a_chat_over_the_limit_is_rejected_before_it_reaches_vllm(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": words(2 * DEFAULT_MAX_MODEL_LEN, seed=11)}]

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)

    assert caught.value.code == "context_length_exceeded"


def test_truncate_keeps_the_end_of_a_completion_prompt(truncating_client: openai.OpenAI) -> None:
    prompt = token_ids(DEFAULT_MAX_MODEL_LEN + 400, seed=12)
    max_tokens = 16

    raw = truncating_client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body={"return_token_ids": True}
    )
    completion = raw.parse()

    assert completion.usage is not None
    kept = completion.usage.prompt_tokens
    assert kept + max_tokens <= DEFAULT_MAX_MODEL_LEN
    assert int(raw.headers["x-guard-truncated-tokens"]) == len(prompt) - kept
    assert int(raw.headers["x-guard-prompt-tokens"]) == kept
    # vLLM echoes the ids it actually ran: the newest ones, in order.
    echoed = completion.choices[0].model_dump().get("prompt_token_ids")
    assert echoed == prompt[-kept:]


def test_truncate_drops_the_oldest_turns_and_keeps_the_system_message(truncating_client: openai.OpenAI) -> None:
    history: list[dict[str, str]] = []
    for turn in range(6):
        history.append({"role": "user", "content": words(250, seed=100 + turn)})
        history.append({"role": "assistant", "content": words(250, seed=200 + turn)})
    messages: Any = [
        {"role": "system", "content": "You are a careful assistant."},
        *history,
        {"role": "user", "content": "Now answer the last question."},
    ]

    raw = truncating_client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=32
    )
    completion = raw.parse()

    assert completion.usage is not None
    assert int(raw.headers["x-guard-truncated-tokens"]) > 0
    assert completion.usage.prompt_tokens + 32 <= DEFAULT_MAX_MODEL_LEN
    assert int(raw.headers["x-guard-prompt-tokens"]) == completion.usage.prompt_tokens


def test_a_request_header_switches_one_request_to_truncation(client: openai.OpenAI) -> None:
    prompt = token_ids(GATEWAY_MAX_MODEL_LEN + 100, seed=13)

    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=8, extra_headers={"x-guard-on-overflow": "truncate"}
    )
    completion = raw.parse()

    assert completion.usage is not None
    assert completion.usage.prompt_tokens + 8 <= GATEWAY_MAX_MODEL_LEN
    assert int(raw.headers["x-guard-truncated-tokens"]) == len(prompt) - completion.usage.prompt_tokens


def test_max_tokens_past_the_context_is_clamped_to_what_is_left(client: openai.OpenAI) -> None:
    prompt = token_ids(GATEWAY_MAX_MODEL_LEN - 40, seed=14)

    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=1000, extra_body={"ignore_eos": True}
    )
    completion = raw.parse()

    assert completion.usage is not None
    left = GATEWAY_MAX_MODEL_LEN - len(prompt)
    assert int(raw.headers["x-guard-max-tokens"]) == left
    # vLLM alone would have run to its own 2048 limit; the gateway's clamp is what stopped it.
    assert completion.usage.completion_tokens == left
    assert completion.choices[0].finish_reason == "length"


def test_max_tokens_that_fits_is_passed_on_unchanged(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=token_ids(100, seed=15), max_tokens=24, extra_body={"ignore_eos": True}
    )

    assert int(raw.headers["x-guard-max-tokens"]) == 24
    assert "x-guard-truncated-tokens" not in raw.headers
    usage = raw.parse().usage
    assert usage is not None
    assert usage.completion_tokens == 24
