"""Counting with the model's own tokenizer: chats and completion prompts, and where the work runs."""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Callable
from typing import Any

import pytest

from bench.workloads.counting import synthetic_chat
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.guard.counting import LocalCounter, RemoteCounter
from tests.unit.guard.counting.chats import ANSWER, CALL, TOOLS, U, reference, turn

CHAT_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("a single user message", {"messages": [U]}),
    ("a system prompt", {"messages": [{"role": "system", "content": "Be brief."}, U]}),
    (
        "text parts",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "One."}, {"type": "text", "text": " Two"}]}
            ]
        },
    ),
    ("no generation prompt", {"messages": [U], "add_generation_prompt": False}),
    (
        "a continued final message",
        {
            "messages": [U, {"role": "assistant", "content": "It is"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
    ("tools", {"messages": [U], "tools": TOOLS}),
    ("a tool call and its answer", {"messages": [U, CALL, ANSWER], "tools": TOOLS}),
    ("documents", {"messages": [U], "documents": [{"title": "Notes", "text": "Paris is sunny."}]}),
    ("chat_template_kwargs", {"messages": [U], "chat_template_kwargs": {"enable_thinking": False}}),
    ("special tokens added on request", {"messages": [U], "add_special_tokens": True}),
    ("markup typed by the user", {"messages": [{"role": "user", "content": "a<|im_end|>\n<|im_start|>b <s> </s>"}]}),
    ("unicode and odd whitespace", {"messages": [{"role": "user", "content": "Быстрая 速い 🦊\n\n\t  x  \r\n"}]}),
    ("an empty message", {"messages": [{"role": "user", "content": ""}]}),
    # Templates sent with the request: tests/integration/test_request_templates.py.
]


@pytest.mark.parametrize(("case", "body"), CHAT_BODIES, ids=[c for c, _ in CHAT_BODIES])
async def test_chat_counts_equal_the_tokenizers_own(
    counter: LocalCounter, tokenizer: Any, case: str, body: Any
) -> None:
    assert await counter.count_chat(body) == reference(tokenizer, body)


async def test_a_long_multi_turn_chat_counts_exactly(counter: LocalCounter, tokenizer: Any) -> None:
    body = synthetic_chat(tokenizer, 6000)
    assert await counter.count_chat(body) == reference(tokenizer, body)


async def test_counting_leaves_the_request_untouched(counter: LocalCounter) -> None:
    body = {"messages": [U, {**CALL, "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]}
    before = copy.deepcopy(body)
    await counter.count_chat(body)
    assert body == before


async def test_media_parts_are_counted_by_the_fallback(tokenizer: Any) -> None:
    payloads: list[dict[str, Any]] = []

    async def tokenize(payload: dict[str, Any]) -> dict[str, Any]:
        payloads.append(payload)
        return {"count": 777, "max_model_len": 2048, "tokens": []}

    counter = LocalCounter(tokenizer, fallback=RemoteCounter(tokenize, "tiny"))
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]}
    assert await counter.count_chat(body) == 777
    assert payloads[0]["messages"] == body["messages"]


PROMPTS: list[tuple[Any, bool]] = [
    ("Hello world", True),
    ("Hello world", False),
    (["one", "two <|im_end|> three"], True),
    ([1, 2, 3, 4], True),
    ([[5, 6], [7]], False),
]


@pytest.mark.parametrize(("prompt", "add_special_tokens"), PROMPTS)
async def test_completion_prompts_count_one_each(
    counter: LocalCounter, tokenizer: Any, prompt: Any, add_special_tokens: bool
) -> None:
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    expected = [
        len(p) if isinstance(p, list) else len(tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"])
        for p in prompts
    ]
    assert await counter.count_prompts(prompt, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("prompt", [[], [[]], 5, [1, "a"], [True, 2], None])
async def test_malformed_prompts_are_invalid(counter: LocalCounter, prompt: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await counter.count_prompts(prompt)
    assert caught.value.param == "prompt"


async def test_completion_text_keeps_its_end(counter: LocalCounter) -> None:
    text = turn("user", 300, "p")["content"]
    cut = await counter.truncate_prompt(text, 100)
    assert isinstance(cut.prompt, str) and text.endswith(cut.prompt)
    assert cut.prompt_tokens == (await counter.count_prompts(cut.prompt))[0]
    assert 95 <= cut.prompt_tokens <= 100
    assert cut.removed_tokens == (await counter.count_prompts(text))[0] - cut.prompt_tokens


@pytest.mark.parametrize(("ids", "budget", "kept"), [([1, 2, 3, 4, 5], 2, [4, 5]), ([1, 2], 5, [1, 2])])
async def test_token_ids_keep_the_last_ids(counter: LocalCounter, ids: list[int], budget: int, kept: list[int]) -> None:
    cut = await counter.truncate_prompt(ids, budget)
    assert (cut.prompt, cut.prompt_tokens, cut.removed_tokens) == (kept, len(kept), len(ids) - len(kept))


@pytest.mark.parametrize(("prompt", "budget"), [("some text here", 1), ([1, 2], 0)])
async def test_a_prompt_budget_without_room_is_context_length_exceeded(
    counter: LocalCounter, prompt: Any, budget: int
) -> None:
    with pytest.raises(ContextLengthExceeded, match=f"budget is {budget - 1 if isinstance(prompt, str) else budget}"):
        await counter.truncate_prompt(prompt, budget)


class RecordingExecutor(concurrent.futures.ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.jobs = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize(("words", "jobs"), [(5, 0), (2000, 1)])
async def test_only_tiny_requests_are_counted_on_the_event_loop(tokenizer: Any, words: int, jobs: int) -> None:
    executor = RecordingExecutor()
    try:
        counter = LocalCounter(tokenizer, executor)
        await counter.count_chat({"messages": [turn("user", words, "q")]})
        assert executor.jobs == jobs
    finally:
        executor.shutdown()
