from __future__ import annotations

import pytest

from gateway.errors import ContextLengthExceeded, MaxTokensExceeded
from gateway.guard.policy import Limits, decide_max_tokens, decide_prompt, effective_max_model_len
from gateway.http.errors import status_and_type

L2048 = Limits(max_model_len=2048)


@pytest.mark.parametrize(
    ("upstream", "configured", "expected"),
    [(4096, None, 4096), (4096, 2048, 2048), (2048, 4096, 2048), (None, 1024, 1024), (None, None, None)],
)
def test_the_effective_limit_only_ever_lowers_the_upstreams(
    upstream: int | None, configured: int | None, expected: int | None
) -> None:
    assert effective_max_model_len(upstream, configured) == expected


@pytest.mark.parametrize(
    ("limits", "cap"),
    [
        (Limits(2048), 2047),
        (Limits(2048, max_prompt_tokens=1000), 1000),
        (Limits(2048, max_prompt_tokens=5000), 2047),
        (Limits(1), 1),
    ],
)
def test_the_prompt_cap_always_leaves_one_output_token(limits: Limits, cap: int) -> None:
    assert limits.prompt_cap == cap


@pytest.mark.parametrize("tokens", [1, 100, 2047])
def test_a_prompt_that_fits_is_accepted_as_it_is(tokens: int) -> None:
    decision = decide_prompt(tokens, L2048, "reject", None)
    assert decision.fits and decision.budget == tokens


@pytest.mark.parametrize(
    ("limits", "tokens", "words"),
    [
        (L2048, 5120, ["2048 tokens", "5120 tokens"]),
        (L2048, 2048, ["2048 tokens", "no room"]),
        (Limits(4096, max_prompt_tokens=1000), 1500, ["at most 1000 tokens", "1500 tokens"]),
    ],
)
def test_reject_states_the_limit_and_the_count(limits: Limits, tokens: int, words: list[str]) -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        decide_prompt(tokens, limits, "reject", None, "messages")
    err = info.value
    assert status_and_type(err)[0] == 400 and err.code == "context_length_exceeded" and err.param == "messages"
    for word in words:
        assert word in err.message


@pytest.mark.parametrize(
    ("limits", "tokens", "requested", "budget"),
    [
        (L2048, 3000, None, 2048 - 16),  # room for --min-output-tokens
        (L2048, 3000, 100, 1948),  # room for the request's max_tokens
        (Limits(2048, max_output_tokens=50), 3000, 100, 1998),  # room capped by --max-output-tokens
        (Limits(2048, max_prompt_tokens=500), 800, 10, 500),  # the prompt limit binds first
        (L2048, 3000, 5000, 1),  # absurd max_tokens: the prompt never vanishes entirely
    ],
)
def test_truncate_leaves_room_for_the_output(limits: Limits, tokens: int, requested: int | None, budget: int) -> None:
    decision = decide_prompt(tokens, limits, "truncate", requested)
    assert not decision.fits and decision.budget == budget


@pytest.mark.parametrize(
    ("limits", "prompt", "requested", "policy", "expected", "clamped"),
    [
        (L2048, 100, 50, "clamp", 50, False),
        (L2048, 100, None, "clamp", 1948, True),  # omitted: set explicitly to what is left
        (L2048, 100, None, "reject", 1948, True),
        (L2048, 2000, 500, "clamp", 48, True),
        (Limits(2048, max_output_tokens=256), 100, None, "clamp", 256, True),
        (Limits(2048, max_output_tokens=256), 100, 1000, "clamp", 256, True),
        (L2048, 1948, 100, "reject", 100, False),  # exactly fits
    ],
)
def test_max_tokens_is_bounded_by_what_the_context_leaves(
    limits: Limits, prompt: int, requested: int | None, policy: str, expected: int, clamped: bool
) -> None:
    decision = decide_max_tokens(prompt, requested, limits, policy)  # type: ignore[arg-type]
    assert (decision.max_tokens, decision.clamped) == (expected, clamped)


@pytest.mark.parametrize(
    ("limits", "prompt", "requested", "words"),
    [
        (L2048, 2000, 500, ["2048 tokens", "2000 tokens", "at most 48", "500 was requested"]),
        (Limits(2048, max_output_tokens=256), 10, 1000, ["max_tokens is 1000", "at most 256"]),
    ],
)
def test_reject_policy_names_max_tokens(limits: Limits, prompt: int, requested: int, words: list[str]) -> None:
    with pytest.raises(MaxTokensExceeded) as info:
        decide_max_tokens(prompt, requested, limits, "reject")
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    for word in words:
        assert word in info.value.message
