"""Chat truncation: whole turns dropped oldest first, the last turn cut from its front when alone too long."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import ContextLengthExceeded
from gateway.guard.counting import ChatTruncation, LocalCounter
from tests.unit.guard.counting.chats import A1, A2, ANSWER, SYS, TCALL, U1, U2, U3, counted, turn

TRUNCATIONS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]] = [
    ("the oldest turns go, the system message stays", [SYS, U1, A1, U2, A2, U3], [SYS, U2, A2, U3]),
    ("dropping stops at the first turn that fits", [SYS, U1, A1, U2, A2, U3], [SYS, U1, A1, U2, A2, U3]),
    ("a tool call goes with its answers", [SYS, U1, TCALL, ANSWER, ANSWER, U2, A2, U3], [SYS, U2, A2, U3]),
    ("system messages stay wherever they are", [U1, A1, SYS, U2, A2, U3], [SYS, U2, A2, U3]),
]


@pytest.mark.parametrize(("case", "messages", "expected"), TRUNCATIONS, ids=[c for c, _, _ in TRUNCATIONS])
async def test_chat_truncation_drops_whole_turns(
    counter: LocalCounter, case: str, messages: list[dict[str, Any]], expected: list[dict[str, Any]]
) -> None:
    budget = await counted(counter, expected)
    original = await counted(counter, messages)
    cut = await counter.truncate_chat({"messages": messages}, budget)
    assert cut == ChatTruncation(expected, budget, original - budget)


async def test_chat_truncation_never_starts_with_a_tool_answer(counter: LocalCounter) -> None:
    messages = [U1, TCALL, ANSWER, ANSWER, U3]
    budget = await counted(counter, [ANSWER, ANSWER, U3])  # would fit only if the call were split off
    cut = await counter.truncate_chat({"messages": messages}, budget)
    assert cut.messages[0]["role"] == "user"
    assert cut.prompt_tokens <= budget


async def test_chat_truncation_cuts_the_front_of_the_last_turn_when_it_alone_is_too_long(
    counter: LocalCounter,
) -> None:
    big = turn("user", 400, "x")
    messages = [SYS, U1, A1, big]
    budget = await counted(counter, [SYS, big]) - 150
    cut = await counter.truncate_chat({"messages": messages}, budget)
    assert cut.messages[0] == SYS and len(cut.messages) == 2
    kept = cut.messages[1]["content"]
    assert big["content"].endswith(kept) and len(kept) < len(big["content"])
    assert cut.prompt_tokens == await counted(counter, cut.messages)
    assert budget - 3 <= cut.prompt_tokens <= budget
    assert cut.removed_tokens == await counted(counter, messages) - cut.prompt_tokens


async def test_a_conversation_that_fits_is_returned_as_it_is(counter: LocalCounter) -> None:
    n = await counted(counter, [SYS, U1])
    assert await counter.truncate_chat({"messages": [SYS, U1]}, n) == ChatTruncation([SYS, U1], n, 0)


async def test_an_impossible_budget_names_budget_and_minimum(counter: LocalCounter) -> None:
    huge_system = {"role": "system", "content": turn("user", 300, "s")["content"]}
    minimum = await counted(counter, [huge_system, {"role": "user", "content": ""}])
    with pytest.raises(ContextLengthExceeded, match=rf"truncated to 50 tokens.*at least {minimum} tokens"):
        await counter.truncate_chat({"messages": [huge_system, U1, A1, U3]}, 50)


async def test_a_conversation_of_many_turns_is_cut_in_a_few_counts() -> None:
    """Each candidate cut is built when counted: building all of them costs turns x messages (30,000 turns:
    ~450 million list entries, gigabytes) where bisection needs ~15."""
    from gateway.guard.counting.truncation import truncate_messages

    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(60_000)]
    counted_lengths: list[int] = []

    async def count(msgs: list[dict[str, Any]]) -> int:
        counted_lengths.append(len(msgs))
        return len(msgs)

    async def drop_front(text: str, tokens: int) -> str:
        return text

    cut = await truncate_messages(messages, 1001, count, drop_front)
    assert cut.messages == messages[-1000:] and cut.prompt_tokens == 1000
    assert len(counted_lengths) <= 20
