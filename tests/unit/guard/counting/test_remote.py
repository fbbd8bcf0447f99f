"""Counting through the engine's /tokenize: equivalent requests, the same truncation rules."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import BadUpstreamResponse
from gateway.guard.counting import LocalCounter, PromptTokens, RemoteCounter
from tests.unit.guard.counting.chats import A1, A2, SYS, TOOLS, U1, U2, U3, U, counted, turn


class FakeTokenize:
    """The upstream's /tokenize, computed with the local tokenizer; remembers what it was sent."""

    def __init__(self, counter: LocalCounter) -> None:
        self.counter = counter
        self.payloads: list[dict[str, Any]] = []

    async def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.payloads.append(payload)
        if "prompt" in payload:
            ids = self.counter.text.ids(payload["prompt"], payload.get("add_special_tokens", True))
        else:
            ids = self.counter.tokenize_chat_sync({k: v for k, v in payload.items() if k != "model"}).ids or ()
        return {"count": len(ids), "max_model_len": 4096, "tokens": list(ids)}


@pytest.fixture
def remote(counter: LocalCounter) -> tuple[RemoteCounter, FakeTokenize]:
    fake = FakeTokenize(counter)
    return RemoteCounter(fake, "tiny"), fake


async def test_remote_chat_counts_send_an_equivalent_tokenize_request(
    remote: tuple[RemoteCounter, FakeTokenize], counter: LocalCounter
) -> None:
    rc, fake = remote
    body = {"messages": [U], "documents": [{"title": "T", "text": "x"}], "reasoning_effort": "none", "tools": TOOLS}
    assert await rc.count_chat(body) == await counter.count_chat(body)
    assert fake.payloads[0] == {
        "model": "tiny",
        "messages": [U],
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
        "chat_template_kwargs": {
            "documents": [{"title": "T", "text": "x"}],
            "reasoning_effort": "none",
            "enable_thinking": False,
        },
        "tools": TOOLS,
    }


async def test_remote_prompt_counts_ask_only_for_text(remote: tuple[RemoteCounter, FakeTokenize]) -> None:
    rc, fake = remote
    mixed: Any = ["Hello world", [1, 2, 3]]
    assert await rc.count_prompts(mixed) == [7, 3]
    assert [p["prompt"] for p in fake.payloads] == ["Hello world"]


async def test_remote_truncation_keeps_the_same_rules(
    remote: tuple[RemoteCounter, FakeTokenize], counter: LocalCounter
) -> None:
    rc, _ = remote
    budget = await counted(counter, [SYS, U2, A2, U3])
    cut = await rc.truncate_chat({"messages": [SYS, U1, A1, U2, A2, U3]}, budget)
    assert cut.messages == [SYS, U2, A2, U3] and cut.prompt_tokens == budget
    big = turn("user", 400, "x")
    budget = await counted(counter, [big]) - 100
    cut = await rc.truncate_chat({"messages": [big]}, budget)
    assert big["content"].endswith(cut.messages[0]["content"]) and cut.prompt_tokens <= budget


async def test_remote_completion_truncation_keeps_the_end(remote: tuple[RemoteCounter, FakeTokenize]) -> None:
    rc, _ = remote
    text = turn("user", 300, "p")["content"]
    cut = await rc.truncate_prompt(text, 100)
    assert isinstance(cut.prompt, str) and text.endswith(cut.prompt) and cut.prompt_tokens <= 100


@pytest.mark.parametrize("answer", [{}, {"count": "3"}, {"error": "x"}])
async def test_a_tokenize_answer_without_a_count_is_a_bad_upstream_response(answer: dict[str, Any]) -> None:
    async def tokenize(payload: dict[str, Any]) -> dict[str, Any]:
        return answer

    with pytest.raises(BadUpstreamResponse, match="without a count"):
        await RemoteCounter(tokenize, "tiny").count_prompts("x")


ID_CHATS: list[dict[str, Any]] = [
    {"messages": [U]},
    {"messages": [SYS, U1, A1, U2], "add_generation_prompt": True},
    {"messages": [U], "tools": TOOLS, "add_special_tokens": True},
]


@pytest.mark.parametrize("body", ID_CHATS)
async def test_remote_chat_ids_are_the_engines_and_equal_the_local_ones(
    remote: tuple[RemoteCounter, FakeTokenize], counter: LocalCounter, body: dict[str, Any]
) -> None:
    rc, _ = remote
    tokens = await rc.tokenize_chat(body)
    assert tokens == await counter.tokenize_chat(body)
    assert tokens.ids is not None and tokens.count == len(tokens.ids) > 0


@pytest.mark.parametrize("add_special_tokens", [True, False])
async def test_remote_prompt_ids_ask_only_for_text_and_keep_token_ids_as_given(
    remote: tuple[RemoteCounter, FakeTokenize], counter: LocalCounter, add_special_tokens: bool
) -> None:
    rc, fake = remote
    mixed: Any = ["Hello world", [9, 8, 7]]
    tokens = await rc.tokenize_prompts(mixed, add_special_tokens=add_special_tokens)
    assert tokens == await counter.tokenize_prompts(mixed, add_special_tokens=add_special_tokens)
    assert tokens[1] == PromptTokens(3, (9, 8, 7))
    assert [p["prompt"] for p in fake.payloads] == ["Hello world"]


TOKENIZE_ANSWERS: list[tuple[str, dict[str, Any], PromptTokens]] = [
    ("a count and its tokens", {"count": 3, "tokens": [4, 5, 6]}, PromptTokens(3, (4, 5, 6))),
    ("tokens without a count", {"tokens": [4, 5]}, PromptTokens(2, (4, 5))),
    ("a count without tokens", {"count": 3}, PromptTokens(3, None)),
    ("tokens that disagree with the count", {"count": 3, "tokens": []}, PromptTokens(3, None)),
    ("tokens that are not ids", {"count": 2, "tokens": [4, "x"]}, PromptTokens(2, None)),
]


@pytest.mark.parametrize(("case", "answer", "expected"), TOKENIZE_ANSWERS, ids=[c for c, _, _ in TOKENIZE_ANSWERS])
async def test_remote_ids_are_known_only_when_the_answer_holds_exactly_the_counted_ids(
    case: str, answer: dict[str, Any], expected: PromptTokens
) -> None:
    async def tokenize(payload: dict[str, Any]) -> dict[str, Any]:
        return answer

    assert await RemoteCounter(tokenize, "tiny").tokenize_prompts("x") == [expected]
    assert await RemoteCounter(tokenize, "tiny").tokenize_chat({"messages": [U]}) == expected
