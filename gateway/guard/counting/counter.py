"""The interface both prompt counters implement (the model's tokenizer here, or the engine's ``/tokenize``),
and what their tokenization and prompt truncation return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import ContextLengthExceeded
from gateway.guard.counting.truncation import ChatTruncation
from gateway.guard.prompts import Prompt, prompt_list, prompt_shape_error

# A completions request's prompt field: one prompt, or a list of prompts of one shape.
PromptField = Prompt | list[str] | list[list[int]]


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """One prompt as the engine schedules it: its token count and, where they can be known here, its token ids."""

    count: int
    ids: tuple[int, ...] | None  # exactly the ids vLLM schedules; None where only the engine knows them (media parts)


@dataclass(frozen=True)
class PromptTruncation:
    prompt: Prompt  # same kind as given: text keeps its end, token ids keep the last ids
    prompt_tokens: int
    removed_tokens: int


class Counter(Protocol):
    async def count_chat(self, body: dict[str, Any]) -> int: ...

    async def count_prompts(self, prompt: PromptField, *, add_special_tokens: bool = True) -> list[int]: ...

    async def tokenize_chat(self, body: dict[str, Any]) -> PromptTokens: ...

    async def tokenize_prompts(
        self, prompt: PromptField, *, add_special_tokens: bool = True
    ) -> list[PromptTokens]: ...

    async def truncate_chat(self, body: dict[str, Any], budget: int) -> ChatTruncation: ...

    async def count_pairs(
        self, pairs: list[tuple[str, str]], *, max_first: int = 0, max_second: int = 0
    ) -> list[int]: ...

    async def truncate_prompt(
        self, prompt: Prompt, budget: int, *, add_special_tokens: bool = True
    ) -> PromptTruncation: ...


def check_budget(budget: int, what: str) -> None:
    if budget < 1:
        raise ContextLengthExceeded(f"No room is left for the {what}: the budget is {budget} tokens.", param=what)


def keep_last_ids(prompt: list[int], budget: int) -> PromptTruncation:
    """A token-id prompt cut to its last ``budget`` ids."""
    ids = prompt_list(prompt)[0]
    if not isinstance(ids, list):
        raise prompt_shape_error(prompt)
    check_budget(budget, "prompt")
    kept = ids[-budget:]
    return PromptTruncation(kept, len(kept), len(ids) - len(kept))


def given_ids(ids: list[int]) -> PromptTokens:
    """A prompt sent as token ids: the engine schedules them exactly as given."""
    return PromptTokens(len(ids), tuple(ids))
