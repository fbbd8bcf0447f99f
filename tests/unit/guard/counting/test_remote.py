"""Counting through the engine's /tokenize: equivalent requests, the same truncation rules."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import BadUpstreamResponse
from gateway.guard.counting import LocalCounter, RemoteCounter
from tests.unit.guard.counting.chats import A1, A2, SYS, TOOLS, U1, U2, U3, U, counted, turn


class FakeTokenize:
    """The upstream's /tokenize, computed with the local tokenizer; remembers what it was sent."""

    def __init__(self, counter: LocalCounter) -> None:
        self.counter = counter
        self.payloads: list[dict[str, Any]] = []

    async def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.payloads.append(payload)
        if "prompt" in payload:
            n = self.counter.text.count(payload["prompt"], payload.get("add_special_tokens", True))
        else:
            n = self.counter.count_chat_sync({k: v for k, v in payload.items() if k != "model"}).token_count
        return {"count": n, "max_model_len": 4096, "tokens": list(range(n))}


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
