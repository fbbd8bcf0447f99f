"""Prompt tokens from the engine's ``/tokenize``, for models whose tokenizer cannot be loaded here.

The same interface as ``LocalCounter``; each count is an HTTP round trip, and truncation cuts text by its
average characters per token and re-counts, since ``/tokenize`` gives no character offsets. The ids are the
ones ``/tokenize`` answers, except for chats with media parts, whose prefix keys only the engine can compute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.errors import BadUpstreamResponse
from gateway.guard.counting.chatformat import has_media, template_kwargs
from gateway.guard.counting.counter import (
    PromptField,
    PromptTokens,
    PromptTruncation,
    check_budget,
    given_ids,
    keep_last_ids,
)
from gateway.guard.counting.templates import RequestTemplates
from gateway.guard.counting.truncation import ChatTruncation, Messages, truncate_messages
from gateway.guard.prompts import Prompt, is_int, messages_of, prompt_list


class RemoteCounter:
    """Counts through the upstream's ``/tokenize`` (``tokenize(payload)`` posts and returns its JSON)."""

    def __init__(
        self,
        tokenize: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
        model: str,
        templates: RequestTemplates | None = None,
    ) -> None:
        self._tokenize = tokenize
        self._model = model
        # A trusted request template goes to the engine's /tokenize, which renders it under its own flag.
        self._templates = templates or RequestTemplates(trusted=False)

    async def _count(self, payload: dict[str, Any]) -> int:
        return (await self._tokens(payload)).count

    async def _tokens(self, payload: dict[str, Any]) -> PromptTokens:
        answer = await self._tokenize({"model": self._model, **payload})
        count = answer.get("count") if isinstance(answer, dict) else None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        ids = tuple(tokens) if isinstance(tokens, list) and all(is_int(t) for t in tokens) else None
        if type(count) is not int:
            if not isinstance(tokens, list):
                raise BadUpstreamResponse(f"/tokenize answered without a count: {str(answer)[:200]}")
            count = len(tokens)
        # Ids that disagree with the count are not the prompt's (an engine answering counts only): unknown.
        return PromptTokens(count, ids if ids is not None and len(ids) == count else None)

    def chat_payload(self, body: dict[str, Any]) -> dict[str, Any]:
        """The /tokenize request equivalent to a chat request (its extra template inputs go as kwargs)."""
        self._templates.requested(body)
        messages_of(body)
        kwargs = template_kwargs(body)
        payload: dict[str, Any] = {
            "messages": body["messages"],
            "add_generation_prompt": kwargs.pop("add_generation_prompt"),
            "continue_final_message": kwargs.pop("continue_final_message"),
            "add_special_tokens": body.get("add_special_tokens", False),
        }
        if kwargs:
            payload["chat_template_kwargs"] = kwargs
        for key in ("tools", "chat_template", "media_io_kwargs", "mm_processor_kwargs"):
            if body.get(key) is not None:
                payload[key] = body[key]
        return payload

    async def count_chat(self, body: dict[str, Any]) -> int:
        return await self._count(self.chat_payload(body))

    async def tokenize_chat(self, body: dict[str, Any]) -> PromptTokens:
        tokens = await self._tokens(self.chat_payload(body))
        # Media parts are placeholder ids here, while the engine keys their blocks by the media's hashes.
        return PromptTokens(tokens.count, None) if has_media(body["messages"]) else tokens

    async def count_prompts(self, prompt: PromptField, *, add_special_tokens: bool = True) -> list[int]:
        async def one(p: Prompt) -> int:
            if isinstance(p, list):
                return len(p)
            return await self._count({"prompt": p, "add_special_tokens": add_special_tokens})

        return list(await asyncio.gather(*(one(p) for p in prompt_list(prompt))))

    async def tokenize_prompts(
        self, prompt: PromptField, *, add_special_tokens: bool = True
    ) -> list[PromptTokens]:
        async def one(p: Prompt) -> PromptTokens:
            if isinstance(p, list):
                return given_ids(p)
            return await self._tokens({"prompt": p, "add_special_tokens": add_special_tokens})

        return list(await asyncio.gather(*(one(p) for p in prompt_list(prompt))))

    async def _drop_front(self, text: str, tokens: int) -> str:
        # No offsets over HTTP: cut by the text's average characters per token (the caller re-counts).
        n = max(1, await self._count({"prompt": text, "add_special_tokens": False}))
        return text[min(len(text), -(-tokens * len(text) // n)) :]

    async def truncate_chat(self, body: dict[str, Any], budget: int) -> ChatTruncation:
        messages = messages_of(body)

        async def count(msgs: Messages) -> int:
            return await self.count_chat({**body, "messages": msgs})

        return await truncate_messages(messages, budget, count, self._drop_front)

    async def truncate_prompt(
        self, prompt: Prompt, budget: int, *, add_special_tokens: bool = True
    ) -> PromptTruncation:
        if isinstance(prompt, list):
            return keep_last_ids(prompt, budget)
        original = (await self.count_prompts(prompt, add_special_tokens=add_special_tokens))[0]
        if original <= budget:
            return PromptTruncation(prompt, original, 0)
        specials = (await self.count_prompts([""], add_special_tokens=add_special_tokens))[0] if prompt else 0
        check_budget(budget - specials, "prompt")
        chars = len(prompt) * (budget - specials) // original
        while True:
            tail = prompt[len(prompt) - chars :] if chars > 0 else ""
            n = (await self.count_prompts([tail], add_special_tokens=add_special_tokens))[0]
            if n <= budget:
                return PromptTruncation(tail, n, original - n)
            chars -= max(1, (n - budget) * len(prompt) // original)

    async def count_pairs(
        self, pairs: list[tuple[str, str]], *, max_first: int = 0, max_second: int = 0
    ) -> list[int]:
        """As ``LocalCounter.count_pairs``, but /tokenize knows no pairs: a pair's special tokens are taken as
        twice a single text's, which covers the common templates (BERT adds 3 for 2, RoBERTa 4 for 2)."""
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        alone = await self.count_prompts(texts, add_special_tokens=False) if texts else []
        counts = dict(zip(texts, alone, strict=True))
        specials = 2 * (await self.count_prompts([""], add_special_tokens=True))[0]

        def one(text: str, bound: int) -> int:
            return min(counts[text], bound) if bound > 0 else counts[text]

        return [one(a, max_first) + one(b, max_second) + specials for a, b in pairs]
