from __future__ import annotations

import concurrent.futures
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import BadUpstreamResponse, ContextLengthExceeded, InvalidRequest
from gateway.guard.counting.tokens import (
    ChatTruncation,
    LocalCounter,
    RemoteCounter,
    TokenizerUnavailable,
    bench_counting,
    load_tokenizer,
    synthetic_chat,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# What vLLM hands the template for TOOLS and for a bare tool (its pydantic dump fills in nulls).
DUMPED_BARE_TOOL = {"type": "function", "function": {"name": "noop", "description": None, "parameters": None}}
U = {"role": "user", "content": "What is the weather in Paris today?"}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ],
}
ANSWER = {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 degrees"}


def reference(tok: Any, body: dict[str, Any]) -> int:
    """The count by the tokenizer itself, the way vLLM calls it for a chat request."""
    kwargs = {
        "tools": body.get("tools"),
        "documents": body.get("documents"),
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "chat_template": body.get("chat_template"),
        **(body.get("chat_template_kwargs") or {}),
    }
    text = tok.apply_chat_template(body["messages"], tokenize=False, **kwargs)
    ids = tok(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"]
    if not body.get("add_special_tokens"):
        assert ids == tok.apply_chat_template(body["messages"], tokenize=True, return_dict=False, **kwargs)
    return len(ids)


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


@pytest.fixture(scope="module")
def counter(tokenizer: Any) -> LocalCounter:
    return LocalCounter(tokenizer)


@pytest.mark.parametrize(("case", "body"), CHAT_BODIES, ids=[c for c, _ in CHAT_BODIES])
async def test_chat_counts_equal_the_tokenizers_own(
    counter: LocalCounter, tokenizer: Any, case: str, body: Any
) -> None:
    assert await counter.count_chat(body) == reference(tokenizer, body)


async def test_a_long_multi_turn_chat_counts_exactly(counter: LocalCounter, tokenizer: Any) -> None:
    body = synthetic_chat(tokenizer, 6000)
    assert await counter.count_chat(body) == reference(tokenizer, body)


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


async def test_counting_leaves_the_request_untouched(counter: LocalCounter) -> None:
    body = {"messages": [U, {**CALL, "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]}
    before = copy.deepcopy(body)
    await counter.count_chat(body)
    assert body == before


async def test_a_growing_conversation_reuses_what_was_counted(tokenizer: Any, monkeypatch: Any) -> None:
    counter = LocalCounter(tokenizer)
    uncached = LocalCounter(tokenizer, cache_chars=0)
    encoded: list[str] = []
    real = counter.text._encode_counts

    def recording(pieces: list[str]) -> list[int]:
        encoded.extend(pieces)
        return real(pieces)

    monkeypatch.setattr(counter.text, "_encode_counts", recording)
    messages = synthetic_chat(tokenizer, 3000)["messages"]
    for turns in range(2, len(messages) + 1):
        body = {"messages": messages[:turns]}
        encoded.clear()
        n = await counter.count_chat(body)
        assert n == await uncached.count_chat(body) == reference(tokenizer, body)
        # Only the newest turn (and the generation prompt) is tokenized again.
        older = messages[turns - 2]["content"]
        assert turns == 2 or not any(older in piece for piece in encoded)


SPLIT_TEXTS = [
    "",
    "<|im_start|>",
    "x<|im_end|> y",
    " <|im_start|>  \n\n<|im_end|><|im_end|>z",
    "<s><s> </s>\t<pad>a",
    "héllo<|im_start|>wörld   <|im_end|>\n",
    "<|im_start|" + "im_end|>",
]


@pytest.mark.parametrize("text", SPLIT_TEXTS)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_text_split_at_special_tokens_counts_like_the_whole(
    counter: LocalCounter, tokenizer: Any, text: str, add_special_tokens: bool
) -> None:
    assert counter.text.splits_at_special_tokens
    expected = len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    assert counter.text.count(text, add_special_tokens) == expected


BAD_CHATS: list[tuple[dict[str, Any], str | None, str]] = [
    ({}, "messages", "non-empty array"),
    ({"messages": []}, "messages", "non-empty array"),
    ({"messages": [U, "hi"]}, "messages[1]", "must be an object"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "role must be a non-empty string"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "got int"),
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


# -- truncation ------------------------------------------------------------------------------------
def turn(role: str, words: int, tag: str) -> dict[str, Any]:
    return {"role": role, "content": " ".join(f"{tag}{i}" for i in range(words))}


SYS = {"role": "system", "content": "You are terse."}
U1 = turn("user", 60, "u")
A1 = turn("assistant", 60, "a")
U2 = turn("user", 60, "v")
A2 = turn("assistant", 60, "b")
U3 = turn("user", 20, "w")
TCALL = {**CALL, "content": "checking"}


async def counted(counter: LocalCounter, messages: list[dict[str, Any]]) -> int:
    return await counter.count_chat({"messages": messages})


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


# -- where the work runs ---------------------------------------------------------------------------
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


# -- remote counting -------------------------------------------------------------------------------
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


# -- loading and benchmarking ----------------------------------------------------------------------
def test_a_tokenizer_loads_from_a_directory(tokenizer_dir: Path) -> None:
    assert load_tokenizer(str(tokenizer_dir)).bos_token == "<s>"


@pytest.mark.parametrize("source", ["/nonexistent/tokenizer", "nobody-knows/no-such-model-xyz"])
def test_a_tokenizer_that_cannot_load_without_downloading_is_unavailable(source: str) -> None:
    with pytest.raises(TokenizerUnavailable, match=json.dumps(source)[1:-1]):
        load_tokenizer(source)


def test_bench_counting_reports_each_size(tokenizer: Any) -> None:
    figures = bench_counting(tokenizer, sizes=(300,), repeat=1)
    row = figures["300"]
    assert set(row) == {"tokens", "naive_ms", "cold_ms", "prefix_ms", "warm_ms", "naive_cpu_ms", "cold_cpu_ms"}
    assert 250 <= row["tokens"] <= 450
