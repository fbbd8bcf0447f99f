"""Prompt tokens with the model's own tokenizer, exactly as vLLM 0.32 computes them, without blocking the event loop.

Chat requests are rendered the way vLLM renders them (``chatformat`` reproduces its message handling; the text is
the tokenizer's own ``apply_chat_template``'s, rendered for less by ``rendering``) and the text is tokenized with
the request's ``add_special_tokens`` (chat: off by default; completions: on) by the cached ``TextCounter``, which
gives the ids or just their count. Large inputs (or any input of a large body: ``offload``) are tokenized in a thread
pool, small ones inline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple

from gateway.errors import InvalidRequest
from gateway.guard import offload
from gateway.guard.counting.chatformat import MediaContent, prepare_chat
from gateway.guard.counting.counter import (
    Counter,
    PromptField,
    PromptTokens,
    PromptTruncation,
    check_budget,
    given_ids,
    keep_last_ids,
)
from gateway.guard.counting.rendering import ChatRenderer
from gateway.guard.counting.template_wire import template_error_reason
from gateway.guard.counting.templates import RequestTemplates, TemplateInputs
from gateway.guard.counting.text import DEFAULT_CACHE_BYTES, TextCounter
from gateway.guard.counting.truncation import ChatTruncation, Messages, truncate_messages
from gateway.guard.prompts import Prompt, messages_of, prompt_list, prompt_shape_error

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")
Args = TypeVarTuple("Args")

# Requests with less text than this are counted on the event loop. Measured here (2 busy cores, tiny
# model's tokenizer; medians): a thread-pool round trip costs ~50 us; counting 100 characters of
# completion text costs ~37 us and a 100-character chat (template render included) ~69 us, growing
# about linearly from there (300 characters: ~94 / ~142 us). Around 100 characters the two are even on
# latency alone, but the pool costs more than its hop: the template render is pure Python and holds the GIL,
# so a busy worker thread stalls the event loop anyway, and under load the GIL hand-offs cost the gateway
# a third of its throughput (the overhead benchmark: ~1,700 -> ~2,500 req/s at concurrency 64). So the pool is
# for large inputs only, where a single count would hold the loop for more than ~0.3 ms.
INLINE_CHARS = 2048


@dataclass(frozen=True)
class ChatPrompt:
    """What is counted for one chat request."""

    token_count: int


class LocalCounter:
    """Tokenizes with the model's own tokenizer, in ``executor`` (the loop's default pool when None).

    ``fallback`` (e.g. a RemoteCounter) counts chat requests with media parts, whose tokens only the
    engine knows (their ids are left unknown: the engine's prefix keys include the media's hashes); without
    one they are rejected as invalid. ``templates`` says whether a chat template sent
    in a request is refused (the default) or rendered in its sandbox; such a template never runs here.
    ``cache_bytes`` bounds the text counter's piece cache; ``longest`` gives the context (``TextCounter``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        executor: concurrent.futures.Executor | None = None,
        *,
        fallback: Counter | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        longest: Callable[[], int | None] = lambda: None,
        templates: RequestTemplates | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.text = TextCounter(tokenizer, cache_bytes, longest)
        self._executor = executor
        self._fallback = fallback
        self._templates = templates or RequestTemplates(trusted=False)
        self._template_inputs = TemplateInputs(tokenizer)
        self._renderer = ChatRenderer(tokenizer)

    async def _run(self, size: int | Callable[[], int], fn: Callable[[*Args], T], *args: *Args) -> T:
        # ``size`` measures only the text being counted (a function: measured only for a small body); the whole
        # body decides first (a 7 MB role or chat_template_kwargs, a million one-token prompts: none of it is
        # text ``size`` sees, and measuring it would walk the body on the loop).
        if offload.inline() and (size if isinstance(size, int) else size()) <= INLINE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- chat
    def render_chat(self, body: dict[str, Any]) -> tuple[str, bool]:
        """The prompt text vLLM renders for ``body`` with the model's template, and whether it adds special tokens.

        A template sent with the request is refused here; when trusted, only ``count_chat`` and
        ``truncate_chat`` render it, in the sandbox.
        """
        if self._templates.requested(body) is not None:
            raise RuntimeError("a request's own chat template renders only in the sandbox (count_chat)")
        template = self._model_template(None, body)
        prepared = prepare_chat(body, template)
        try:
            text = self._renderer.render(prepared)  # as apply_chat_template renders it
        except Exception as exc:  # templates raise anything; vLLM answers all of it with a 400 too
            raise InvalidRequest(template_error_reason(exc)) from exc
        if not isinstance(text, str):
            raise InvalidRequest("The chat template did not render text")
        return text, prepared.add_special_tokens

    def _model_template(self, requested: str | None, body: dict[str, Any]) -> str:
        try:
            return self.tokenizer.get_chat_template(requested, tools=body.get("tools") or None)
        except ValueError as exc:
            raise InvalidRequest(f"No chat template is available for this model: {exc}") from exc

    def count_chat_sync(self, body: dict[str, Any]) -> ChatPrompt:
        text, add_special = self.render_chat(body)
        return ChatPrompt(self.text.count(text, add_special))

    def tokenize_chat_sync(self, body: dict[str, Any], with_ids: bool = True) -> PromptTokens:
        text, add_special = self.render_chat(body)
        return self._text_tokens(text, add_special, with_ids)

    def _text_tokens(self, text: str, add_special_tokens: bool, with_ids: bool) -> PromptTokens:
        # Counting alone only sums the pieces' lengths, without joining their ids into one tuple.
        if not with_ids:
            return PromptTokens(self.text.count(text, add_special_tokens), None)
        ids = self.text.ids(text, add_special_tokens)
        return PromptTokens(len(ids), ids)

    async def count_chat(self, body: dict[str, Any]) -> int:
        return (await self._chat(body, with_ids=False)).count

    async def tokenize_chat(self, body: dict[str, Any]) -> PromptTokens:
        return await self._chat(body, with_ids=True)

    async def _chat(self, body: dict[str, Any], *, with_ids: bool) -> PromptTokens:
        requested = self._templates.requested(body)  # refused before anything renders, when untrusted
        try:
            if requested is not None:
                return await self._tokens_with_request_template(body, requested, with_ids)
            return await self._run(lambda: _chat_chars(body), self.tokenize_chat_sync, body, with_ids)
        except MediaContent:
            if self._fallback is None:
                raise
            return PromptTokens(await self._fallback.count_chat(body), None)

    def _request_template_job(self, body: dict[str, Any], requested: str) -> tuple[bytes, bool]:
        """The sandbox's job for ``body``: validated here, with the template itself run only in the worker."""
        template = self._model_template(requested, body)  # a name picks one of the model's named templates
        # An empty template validates the messages and builds the arguments without running anything.
        prepared = prepare_chat(body, "")
        job = self._template_inputs.job(template, body["messages"], prepared, self._templates.limits)
        return job, prepared.add_special_tokens

    async def _tokens_with_request_template(
        self, body: dict[str, Any], requested: str, with_ids: bool
    ) -> PromptTokens:
        job, add_special = await self._run(
            lambda: _chat_chars(body), self._request_template_job, body, requested
        )
        text = await self._templates.sandbox.render(job)
        return await self._run(len(text), self._text_tokens, text, add_special, with_ids)

    async def truncate_chat(self, body: dict[str, Any], budget: int) -> ChatTruncation:
        requested = self._templates.requested(body)
        messages = await offload.run(messages_of, body)

        def size() -> int:
            return _chat_chars(body)

        async def count(msgs: Messages) -> int:
            if requested is not None:
                cut = {**body, "messages": msgs}
                return (await self._tokens_with_request_template(cut, requested, False)).count
            return await self._run(size, lambda: self.count_chat_sync({**body, "messages": msgs}).token_count)

        async def drop_front(text: str, tokens: int) -> str:
            return await self._run(len(text), self.text.drop_front, text, tokens)

        try:
            return await truncate_messages(messages, budget, count, drop_front)
        except MediaContent:
            if self._fallback is None:
                raise
            return await self._fallback.truncate_chat(body, budget)

    # -- completions
    def _count_prompt(self, prompt: Prompt, add_special_tokens: bool) -> int:
        return len(prompt) if isinstance(prompt, list) else self.text.count(prompt, add_special_tokens)

    async def count_prompts(self, prompt: PromptField, *, add_special_tokens: bool = True) -> list[int]:
        return await self._run(
            lambda: _prompt_chars(prompt),
            lambda: [self._count_prompt(p, add_special_tokens) for p in prompt_list(prompt)],
        )

    def _prompt_tokens(self, prompt: Prompt, add_special_tokens: bool) -> PromptTokens:
        return given_ids(prompt) if isinstance(prompt, list) else self._text_tokens(prompt, add_special_tokens, True)

    async def tokenize_prompts(
        self, prompt: PromptField, *, add_special_tokens: bool = True
    ) -> list[PromptTokens]:
        return await self._run(
            lambda: _prompt_chars(prompt),
            lambda: [self._prompt_tokens(p, add_special_tokens) for p in prompt_list(prompt)],
        )

    def _truncate_text(self, text: str, budget: int, add_special_tokens: bool) -> PromptTruncation:
        original = self.text.count(text, add_special_tokens)
        if original <= budget:
            return PromptTruncation(text, original, 0)
        room = budget - (self.text.count("", True) if add_special_tokens else 0)
        check_budget(room, "prompt")
        keep = room
        while True:
            # Cutting at a token's start can re-merge across the cut; take fewer tokens until it fits.
            tail = self.text.keep_end(text, keep)
            n = self.text.count(tail, add_special_tokens)
            if n <= budget:
                return PromptTruncation(tail, n, original - n)
            keep -= n - budget

    async def truncate_prompt(
        self, prompt: Prompt, budget: int, *, add_special_tokens: bool = True
    ) -> PromptTruncation:
        if isinstance(prompt, list):
            return keep_last_ids(prompt, budget)
        if not isinstance(prompt, str):
            raise prompt_shape_error(prompt)
        return await self._run(len(prompt), self._truncate_text, prompt, budget, add_special_tokens)

    # -- text pairs (score, rerank)
    def _count_pairs(self, pairs: list[tuple[str, str]], max_first: int, max_second: int) -> list[int]:
        # A pair encodes each text alone and joins them with the pair's special tokens ([CLS] a [SEP] b
        # [SEP]), so its length is the sum; a text shared by many pairs (a rerank query) is counted once.
        specials = int(self.tokenizer.num_special_tokens_to_add(pair=True))
        known: dict[str, int] = {}

        def one(text: str, bound: int) -> int:
            n = known.get(text)
            if n is None:
                n = known[text] = self.text.count(text, False)
            return min(n, bound) if bound > 0 else n

        return [one(a, max_first) + one(b, max_second) + specials for a, b in pairs]

    async def count_pairs(
        self, pairs: list[tuple[str, str]], *, max_first: int = 0, max_second: int = 0
    ) -> list[int]:
        """Tokens of each text pair as ``tokenizer(first, text_pair=second)`` encodes it, each side first cut
        to its bound (0: none)."""
        return await self._run(
            lambda: sum(len(a) + len(b) for a, b in pairs), self._count_pairs, pairs, max_first, max_second
        )


def _prompt_chars(prompt: PromptField) -> int:
    return sum(len(p) for p in prompt_list(prompt) if isinstance(p, str))


def _chat_chars(body: dict[str, Any]) -> int:
    """A cheap size of a chat request: the characters of its text, enough to choose inline or pool."""
    total = 0
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            texts = (p.get("text") for p in content if isinstance(p, dict))
            total += sum(len(t) for t in texts if isinstance(t, str)) + 16 * len(content)
        total += 16
    if body.get("tools") or body.get("documents") or body.get("chat_template"):
        total += INLINE_CHARS  # schemas and templates are unbounded: never inline
    return total
