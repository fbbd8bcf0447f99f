"""The planning stage books the ids the engine will schedule: for one prompt, as counted or as truncated."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import PromptOverflowPolicy, Settings
from gateway.guard import planning
from gateway.guard.context import Plan
from gateway.guard.counting import Counter, LocalCounter, RemoteCounter
from gateway.guard.endpoints.base import GuardedRequest, engine_body
from gateway.guard.endpoints.chat import parse_chat
from gateway.guard.endpoints.completions import parse_completion
from gateway.guard.endpoints.responses import parse_responses
from gateway.guard.parts import Outcome
from gateway.guard.policy import Limits
from gateway.metrics import Metrics
from tests.unit.guard.counting.chats import U, reference_ids, turn

LONG = turn("user", 400, "w")


class FakeModels:
    def __init__(self, counter: Counter) -> None:
        self._counter = counter

    async def counter(self) -> Counter:
        return self._counter


class GenerousAdmission:
    def fit(self, prompt_tokens: int, max_tokens: int, n: int, *, clamp: bool, prefix_known: bool = False) -> int:
        return max_tokens


async def plan(
    counter: Counter, req: GuardedRequest, policy: PromptOverflowPolicy, max_model_len: int
) -> tuple[Plan, Outcome]:
    parts = SimpleNamespace(
        settings=Settings(), metrics=Metrics(), models=FakeModels(counter), admission=GenerousAdmission()
    )
    out = Outcome("r1")
    planned = await planning.plan_generation(parts, req, Limits(max_model_len), policy, out)  # type: ignore[arg-type]
    assert out.prompt_tokens >= planned.booking.prompt_tokens
    return planned, out


def chat_ids(tok: Any, req: GuardedRequest, sent: dict[str, Any]) -> tuple[int, ...]:
    conversation = sent if req.route == "chat" else req.conversation  # a chat's body is its conversation
    assert conversation is not None
    return reference_ids(tok, conversation)


def prompt_ids(tok: Any, req: GuardedRequest, sent: dict[str, Any]) -> tuple[int, ...]:
    prompt = sent["prompt"]
    return tuple(prompt) if isinstance(prompt, list) else tuple(tok(prompt)["input_ids"])


# (case, parser, body, policy, max_model_len, the ids expected from the request as sent upstream, or None)
CASES: list[tuple[str, Callable[[dict[str, Any]], GuardedRequest], dict[str, Any], PromptOverflowPolicy, int, Any]] = [
    ("a chat", parse_chat, {"messages": [U]}, "reject", 4096, chat_ids),
    ("a Responses request", parse_responses, {"input": "Hello there", "instructions": "Be brief."}, "reject", 4096,
     chat_ids),
    ("a text prompt", parse_completion, {"prompt": "Once upon a time"}, "reject", 4096, prompt_ids),
    ("a token-id prompt", parse_completion, {"prompt": [9, 8, 7, 6]}, "reject", 4096, prompt_ids),
    ("a batch of prompts", parse_completion, {"prompt": ["one", "two"]}, "reject", 4096, None),
    ("a batch of token-id prompts", parse_completion, {"prompt": [[9, 8], [7]]}, "reject", 4096, None),
    ("a truncated chat", parse_chat, {"messages": [U, turn("assistant", 300, "a"), LONG], "max_tokens": 8},
     "truncate", 300, chat_ids),
    ("a truncated text prompt", parse_completion, {"prompt": LONG["content"], "max_tokens": 8}, "truncate", 300,
     prompt_ids),
    ("a truncated token-id prompt", parse_completion, {"prompt": list(range(5, 505)), "max_tokens": 8}, "truncate",
     300, prompt_ids),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "parse", "body", "policy", "max_model_len", "expected"), CASES, ids=[c[0] for c in CASES]
)
async def test_a_booking_carries_the_ids_of_its_one_prompt_as_sent_upstream(
    counter: LocalCounter, tokenizer: Any, case: str, parse: Callable[[dict[str, Any]], GuardedRequest],
    body: dict[str, Any], policy: PromptOverflowPolicy, max_model_len: int, expected: Any,
) -> None:
    req = parse(dict(body))
    planned, out = await plan(counter, req, policy, max_model_len)
    booking = planned.booking
    assert (out.truncated_tokens > 0) == (policy == "truncate")
    if expected is None:
        assert booking.prompt_ids is None
        return
    sent, _ = engine_body(req, planned)
    assert req.body == body  # the client's request stays as it came; truncation is written to the engine's body
    ids = expected(tokenizer, req, sent)
    assert booking.prompt_ids == ids and booking.prompt_tokens == len(ids)
    assert policy == "reject" or len(ids) <= max_model_len - 8


async def test_a_chat_with_media_books_no_ids(tokenizer: Any) -> None:
    async def tokenize(payload: dict[str, Any]) -> dict[str, Any]:
        return {"count": 12, "tokens": list(range(12))}

    counter = LocalCounter(tokenizer, fallback=RemoteCounter(tokenize, "tiny"))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    req = parse_chat({"messages": [{"role": "user", "content": [image]}]})
    planned, _ = await plan(counter, req, "reject", 4096)
    assert (planned.booking.prompt_tokens, planned.booking.prompt_ids) == (12, None)
