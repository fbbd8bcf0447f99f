"""Exact prompt token counts, as vLLM 0.32 computes them, without blocking the event loop.

Chat requests are rendered the way vLLM renders them (``chatformat`` reproduces its message handling;
the tokenizer's own ``apply_chat_template`` renders) and the text is tokenized with the request's
``add_special_tokens`` (chat: off by default; completions: on). Two counters share one interface:
``LocalCounter`` runs the model's tokenizer in a thread pool; ``RemoteCounter`` asks the upstream's
``/tokenize`` when no tokenizer can be loaded here.

Speed comes from splitting rendered text at special tokens. The tokenizer extracts special tokens
before it normalises or pre-tokenizes, so no merge ever crosses one, and each piece that starts with a
special token tokenizes the same alone as in place. Piece counts are therefore additive and are cached
by piece text: a conversation whose earlier turns were counted before only pays for its new turns, and
pieces not in the cache are tokenized together in one batch call. Whether a tokenizer has that property
is checked against whole-text tokenization when the counter is built; if not, text is counted whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gateway.errors import BadUpstreamResponse, ContextLengthExceeded, InvalidRequest
from gateway.guard.counting.chatformat import MediaContent, prepare_chat, template_kwargs, validate_messages
from gateway.guard.counting.template_worker import template_error_reason
from gateway.guard.counting.templates import RequestTemplates, TemplateInputs
from gateway.guard.counting.truncation import ChatTruncation, Messages, truncate_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ChatPrompt",
    "ChatTruncation",
    "Counter",
    "LocalCounter",
    "PromptTruncation",
    "RemoteCounter",
    "TextCounter",
    "TokenizerUnavailable",
    "bench_counting",
    "load_tokenizer",
    "synthetic_chat",
]

Prompt = str | list[str] | list[int] | list[list[int]]

# Requests with less text than this are counted on the event loop. Measured here (2 busy cores, tiny
# model's tokenizer; medians): a thread-pool round trip costs ~50 us; counting 100 characters of
# completion text costs ~37 us and a 100-character chat (template render included) ~69 us, growing
# about linearly from there (300 characters: ~94 / ~142 us). Around 100 characters the two are even on
# latency alone, but the pool costs more than its hop: the template render is pure Python and holds the GIL,
# so a busy worker thread stalls the event loop anyway, and under load the GIL hand-offs cost the gateway
# a third of its throughput (bench/overhead.py: ~1,700 -> ~2,500 req/s at concurrency 64). So the pool is
# for large inputs only, where a single count would hold the loop for more than ~0.3 ms.
INLINE_CHARS = 2048
DEFAULT_CACHE_CHARS = 32 * 1024 * 1024


class TokenizerUnavailable(Exception):
    """No tokenizer could be loaded from the given source without downloading."""


@dataclass(frozen=True)
class ChatPrompt:
    """What is counted for one chat request."""

    token_count: int


@dataclass(frozen=True)
class PromptTruncation:
    prompt: str | list[int]  # same kind as given: text keeps its end, token ids keep the last ids
    prompt_tokens: int
    removed_tokens: int


class Counter(Protocol):
    async def count_chat(self, body: dict[str, Any]) -> int: ...

    async def count_prompts(self, prompt: Prompt, *, add_special_tokens: bool = True) -> list[int]: ...

    async def truncate_chat(self, body: dict[str, Any], budget: int) -> ChatTruncation: ...

    async def count_pairs(
        self, pairs: list[tuple[str, str]], *, max_first: int = 0, max_second: int = 0
    ) -> list[int]: ...

    async def truncate_prompt(
        self, prompt: str | list[int], budget: int, *, add_special_tokens: bool = True
    ) -> PromptTruncation: ...


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """A local tokenizer directory, or a hub id already in the local HF cache (never downloads).

    Slow (seconds: it imports transformers); call it from a worker thread, not the event loop.
    """
    looks_like_path = source.startswith(("/", "./", "../", "~")) or Path(source).expanduser().exists()
    if looks_like_path and not Path(source).expanduser().is_dir():
        raise TokenizerUnavailable(f"tokenizer directory {source!r} does not exist")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            str(Path(source).expanduser()) if looks_like_path else source,
            local_files_only=True,
            trust_remote_code=False,
        )
    except Exception as exc:  # transformers raises OSError, ValueError, ImportError, ... by case
        where = "directory" if looks_like_path else "hub id (local cache only)"
        raise TokenizerUnavailable(f"cannot load a tokenizer from {where} {source!r}: {exc}") from exc


# -- text counting ---------------------------------------------------------------------------------
class TextCounter:
    """Counts text exactly as ``len(tokenizer(text, add_special_tokens=...)["input_ids"])``; thread-safe."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cache_chars: int = DEFAULT_CACHE_CHARS) -> None:
        self.tokenizer = tokenizer
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
        self._specials_added = int(tokenizer.num_special_tokens_to_add(pair=False))
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._cache_chars = 0
        self._cache_limit = cache_chars
        self._lock = threading.Lock()
        self._split: re.Pattern[str] | None = None
        boundaries = self._boundary_tokens() if self._backend is not None else []
        if boundaries:
            # Split at the tokens the chat template writes (a few suffice, some models define hundreds),
            # and only after checking on probes that counts really add up across them.
            template = str(getattr(tokenizer, "chat_template", None) or "")
            boundaries = sorted(boundaries, key=lambda b: (b not in template, b))[:8]
            self._split = re.compile("|".join(re.escape(b) for b in sorted(boundaries, key=len, reverse=True)))
            if not self._additivity_holds(boundaries):
                self._split = None

    @property
    def splits_at_special_tokens(self) -> bool:
        return self._split is not None

    def _boundary_tokens(self) -> list[str]:
        if getattr(self.tokenizer, "split_special_tokens", False):
            return []
        boundaries: list[str] = []
        for token_id, added in self._backend.get_added_tokens_decoder().items():
            # A token that eats whitespace on its left, matches only whole words or on normalized text
            # depends on what precedes it, so a piece starting with it would not tokenize the same alone.
            if not added.special or added.lstrip or added.single_word or added.normalized:
                continue
            if self._backend.encode(added.content, add_special_tokens=False).ids != [token_id]:
                continue
            boundaries.append(added.content)
        return boundaries

    def _additivity_holds(self, specials: list[str]) -> bool:
        samples = ["", "x", " x", "\n\n", "héllo  wörld ", "a\n b", "  ", "1 2", "\t!"]
        probes = []
        for s in specials:
            for before in samples:
                for after in samples:
                    probes.append(f"{before}{s}{after}{s}{after}")
        probes.append("".join(specials) + " end")
        for text in probes:
            for add in (False, True):
                whole = len(self.tokenizer(text, add_special_tokens=add)["input_ids"])
                if self._count_uncached(text, add) != whole:
                    return False
        return True

    def _pieces(self, text: str) -> list[str]:
        if self._split is None:
            return [text]
        starts = [m.start() for m in self._split.finditer(text)]
        if not starts or starts[0] != 0:
            starts.insert(0, 0)
        starts.append(len(text))
        return [text[a:b] for a, b in itertools.pairwise(starts) if b > a]

    def _encode_counts(self, pieces: list[str]) -> list[int]:
        if self._backend is None:
            return [len(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pieces]
        # The batch call skips offsets (3-4x faster than encode) and spreads pieces over the cores.
        return [len(e.ids) for e in self._backend.encode_batch_fast(pieces, add_special_tokens=False)]

    def _count_uncached(self, text: str, add_special_tokens: bool) -> int:
        pieces = self._pieces(text)
        total = sum(self._encode_counts(pieces)) if pieces else 0
        return total + (self._specials_added if add_special_tokens else 0)

    def count(self, text: str, add_special_tokens: bool = False) -> int:
        if self._split is None:
            return len(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        pieces = self._pieces(text)
        counts: dict[str, int] = {}
        with self._lock:
            for p in pieces:
                hit = self._cache.get(p)
                if hit is not None:
                    self._cache.move_to_end(p)
                    counts[p] = hit
        missing = [p for p in dict.fromkeys(pieces) if p not in counts]
        if missing:
            fresh = self._encode_counts(missing)
            counts.update(zip(missing, fresh, strict=True))
            self._remember(zip(missing, fresh, strict=True))
        total = sum(counts[p] for p in pieces)
        return total + (self._specials_added if add_special_tokens else 0)

    def _remember(self, items: Any) -> None:
        with self._lock:
            for piece, n in items:
                if len(piece) > self._cache_limit or piece in self._cache:
                    continue
                self._cache[piece] = n
                self._cache_chars += len(piece)
            while self._cache_chars > self._cache_limit and self._cache:
                old, _ = self._cache.popitem(last=False)
                self._cache_chars -= len(old)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cache_chars = 0

    def ids(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def drop_front(self, text: str, tokens: int) -> str:
        """``text`` without (about) its first ``tokens`` tokens, cut at a token's first character."""
        if tokens <= 0:
            return text
        if self._backend is not None:
            offsets = self._backend.encode(text, add_special_tokens=False).offsets
            return text[offsets[tokens][0] :] if tokens < len(offsets) else ""
        # Slow tokenizers have no offsets: cut by the average characters per token instead.
        n = max(1, self.count(text))
        return text[min(len(text), -(-tokens * len(text) // n)) :]

    def keep_end(self, text: str, tokens: int) -> str:
        """The shortest end of ``text`` whose tokens start ``tokens`` from its end (approximately)."""
        if self._backend is None:
            n = max(1, self.count(text))
            return text[max(0, len(text) - tokens * len(text) // n) :]
        offsets = self._backend.encode(text, add_special_tokens=False).offsets
        if tokens >= len(offsets):
            return text
        return text[offsets[len(offsets) - tokens][0] :] if tokens > 0 else ""


# -- prompts (completions) -------------------------------------------------------------------------
def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request, shape-checked: one string or id list per prompt."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        return list(prompt)
    raise InvalidRequest(
        "prompt must be a string, an array of strings, an array of token ids or an array of such arrays, "
        "none of them empty",
        param="prompt",
    )


def _check_budget(budget: int, what: str) -> None:
    if budget < 1:
        raise ContextLengthExceeded(f"No room is left for the {what}: the budget is {budget} tokens.", param=what)


def _keep_last_ids(ids: list[int], budget: int) -> PromptTruncation:
    _check_budget(budget, "prompt")
    kept = ids[-budget:]
    return PromptTruncation(kept, len(kept), len(ids) - len(kept))


# -- the local counter -----------------------------------------------------------------------------
class LocalCounter:
    """Counts with the model's own tokenizer, in ``executor`` (the loop's default pool when None).

    ``fallback`` (e.g. a RemoteCounter) counts chat requests with media parts, whose tokens only the
    engine knows; without one they are rejected as invalid. ``templates`` says whether a chat template sent
    in a request is refused (the default) or rendered in its sandbox; such a template never runs here.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        executor: concurrent.futures.Executor | None = None,
        *,
        fallback: Counter | None = None,
        cache_chars: int = DEFAULT_CACHE_CHARS,
        templates: RequestTemplates | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.text = TextCounter(tokenizer, cache_chars)
        self._executor = executor
        self._fallback = fallback
        self._templates = templates or RequestTemplates(trusted=False)
        self._template_inputs = TemplateInputs(tokenizer)

    async def _run(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        if size <= INLINE_CHARS:
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
            text = self.tokenizer.apply_chat_template(
                prepared.conversation,
                tools=prepared.tools,  # type: ignore[arg-type]
                chat_template=template,
                tokenize=False,
                **prepared.kwargs,
            )
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

    async def count_chat(self, body: dict[str, Any]) -> int:
        requested = self._templates.requested(body)  # refused before anything renders, when untrusted
        try:
            if requested is not None:
                return await self._count_with_request_template(body, requested)
            prompt: ChatPrompt = await self._run(_chat_chars(body), self.count_chat_sync, body)
        except MediaContent:
            if self._fallback is None:
                raise
            return await self._fallback.count_chat(body)
        return prompt.token_count

    def _request_template_job(self, body: dict[str, Any], requested: str) -> tuple[bytes, bool]:
        """The sandbox's job for ``body``: validated here, with the template itself run only in the worker."""
        template = self._model_template(requested, body)  # a name picks one of the model's named templates
        # An empty template validates the messages and builds the arguments without running anything.
        prepared = prepare_chat(body, "")
        job = self._template_inputs.job(template, validate_messages(body), prepared, self._templates.limits)
        return job, prepared.add_special_tokens

    async def _count_with_request_template(self, body: dict[str, Any], requested: str) -> int:
        job, add_special = await self._run(_chat_chars(body), self._request_template_job, body, requested)
        text = await self._templates.sandbox.render(job)
        return int(await self._run(len(text), self.text.count, text, add_special))

    async def truncate_chat(self, body: dict[str, Any], budget: int) -> ChatTruncation:
        requested = self._templates.requested(body)
        messages = validate_messages(body)
        size = _chat_chars(body)

        async def count(msgs: Messages) -> int:
            if requested is not None:
                return await self._count_with_request_template({**body, "messages": msgs}, requested)
            return int(await self._run(size, lambda: self.count_chat_sync({**body, "messages": msgs}).token_count))

        async def drop_front(text: str, tokens: int) -> str:
            return str(await self._run(len(text), self.text.drop_front, text, tokens))

        try:
            return await truncate_messages(messages, budget, count, drop_front)
        except MediaContent:
            if self._fallback is None:
                raise
            return await self._fallback.truncate_chat(body, budget)

    # -- completions
    def _count_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> int:
        return len(prompt) if isinstance(prompt, list) else self.text.count(prompt, add_special_tokens)

    async def count_prompts(self, prompt: Prompt, *, add_special_tokens: bool = True) -> list[int]:
        prompts = _prompt_list(prompt)
        size = sum(len(p) for p in prompts if isinstance(p, str))
        return list(await self._run(size, lambda: [self._count_prompt(p, add_special_tokens) for p in prompts]))

    def _truncate_text(self, text: str, budget: int, add_special_tokens: bool) -> PromptTruncation:
        original = self.text.count(text, add_special_tokens)
        if original <= budget:
            return PromptTruncation(text, original, 0)
        room = budget - (self.text.count("", True) if add_special_tokens else 0)
        _check_budget(room, "prompt")
        keep = room
        while True:
            # Cutting at a token's start can re-merge across the cut; take fewer tokens until it fits.
            tail = self.text.keep_end(text, keep)
            n = self.text.count(tail, add_special_tokens)
            if n <= budget:
                return PromptTruncation(tail, n, original - n)
            keep -= n - budget

    async def truncate_prompt(
        self, prompt: str | list[int], budget: int, *, add_special_tokens: bool = True
    ) -> PromptTruncation:
        if isinstance(prompt, list):
            return _keep_last_ids(_prompt_list(prompt)[0], budget)  # type: ignore[arg-type]
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt must be a string or an array of token ids", param="prompt")
        cut: PromptTruncation = await self._run(len(prompt), self._truncate_text, prompt, budget, add_special_tokens)
        return cut

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
        size = sum(len(a) + len(b) for a, b in pairs)
        return list(await self._run(size, self._count_pairs, pairs, max_first, max_second))


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


# -- the remote counter ----------------------------------------------------------------------------
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
        answer = await self._tokenize({"model": self._model, **payload})
        count = answer.get("count") if isinstance(answer, dict) else None
        if type(count) is not int:
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(tokens, list):
                raise BadUpstreamResponse(f"/tokenize answered without a count: {str(answer)[:200]}")
            count = len(tokens)
        return count

    def chat_payload(self, body: dict[str, Any]) -> dict[str, Any]:
        """The /tokenize request equivalent to a chat request (its extra template inputs go as kwargs)."""
        self._templates.requested(body)
        validate_messages(body)
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

    async def count_prompts(self, prompt: Prompt, *, add_special_tokens: bool = True) -> list[int]:
        async def one(p: str | list[int]) -> int:
            if isinstance(p, list):
                return len(p)
            return await self._count({"prompt": p, "add_special_tokens": add_special_tokens})

        return list(await asyncio.gather(*(one(p) for p in _prompt_list(prompt))))

    async def _drop_front(self, text: str, tokens: int) -> str:
        # No offsets over HTTP: cut by the text's average characters per token (the caller re-counts).
        n = max(1, await self._count({"prompt": text, "add_special_tokens": False}))
        return text[min(len(text), -(-tokens * len(text) // n)) :]

    async def truncate_chat(self, body: dict[str, Any], budget: int) -> ChatTruncation:
        messages = validate_messages(body)

        async def count(msgs: Messages) -> int:
            return await self.count_chat({**body, "messages": msgs})

        return await truncate_messages(messages, budget, count, self._drop_front)

    async def truncate_prompt(
        self, prompt: str | list[int], budget: int, *, add_special_tokens: bool = True
    ) -> PromptTruncation:
        if isinstance(prompt, list):
            return _keep_last_ids(_prompt_list(prompt)[0], budget)  # type: ignore[arg-type]
        original = (await self.count_prompts(prompt, add_special_tokens=add_special_tokens))[0]
        if original <= budget:
            return PromptTruncation(prompt, original, 0)
        specials = (await self.count_prompts([""], add_special_tokens=add_special_tokens))[0] if prompt else 0
        _check_budget(budget - specials, "prompt")
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


# -- micro-benchmark -------------------------------------------------------------------------------
def synthetic_chat(tokenizer: PreTrainedTokenizerBase, tokens: int, turn_tokens: int = 400) -> dict[str, Any]:
    """A system prompt and alternating user/assistant turns of varied prose, about ``tokens`` long."""
    import random

    from gateway.tools.tinymodel import corpus_text

    rng = random.Random(tokens)
    words = corpus_text().split()
    per_word = len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) / len(words)
    messages: Messages = [{"role": "system", "content": "You are a helpful assistant."}]
    total = 0
    while total < tokens:
        n = min(turn_tokens, tokens - total)
        text = " ".join(rng.choice(words) for _ in range(max(1, round(n / per_word))))
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": text})
        total += n
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Please go on."})
    return {"messages": messages}


def bench_counting(
    tokenizer: PreTrainedTokenizerBase | None = None, sizes: tuple[int, ...] = (1024, 8192, 32768), repeat: int = 5
) -> dict[str, dict[str, float]]:
    """Time counting chats of ``sizes`` tokens; best of ``repeat`` runs, milliseconds.

    Per size: ``tokens`` (exact count), ``naive_ms`` (``apply_chat_template(tokenize=True)``), ``cold_ms``
    (empty cache), ``prefix_ms`` (the same chat after counting it without its last user turn, as in a
    conversation that grows by one turn) and ``warm_ms`` (counted before); ``naive_cpu_ms`` and
    ``cold_cpu_ms`` are the CPU time of the process (all threads), steadier than wall time on a busy
    machine. Uses the tiny model's tokenizer when none is given.
    """
    if tokenizer is None:
        import tempfile

        from gateway.tools.tinymodel import build_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = load_tokenizer(str(build_tokenizer(Path(tmp))))
    counter = LocalCounter(tokenizer)
    return {str(size): _bench_one(counter, synthetic_chat(tokenizer, size), repeat) for size in sizes}


def _timed(repeat: int, fn: Callable[[], object], before: Callable[[], object], clock: Callable[[], float]) -> float:
    times = []
    for _ in range(repeat):
        before()
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1000)
    return min(times)


def _bench_one(counter: LocalCounter, body: dict[str, Any], repeat: int) -> dict[str, float]:
    earlier = {"messages": body["messages"][:-1]}

    def naive() -> object:
        return counter.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)

    def count() -> object:
        return counter.count_chat_sync(body)

    def count_earlier() -> None:
        counter.text.clear_cache()
        counter.count_chat_sync(earlier)

    def nothing() -> None:
        return None

    wall, cpu = time.perf_counter, time.process_time
    return {
        "tokens": counter.count_chat_sync(body).token_count,
        "naive_ms": _timed(repeat, naive, nothing, wall),
        "cold_ms": _timed(repeat, count, counter.text.clear_cache, wall),
        "prefix_ms": _timed(repeat, count, count_earlier, wall),
        "warm_ms": _timed(repeat, count, nothing, wall),
        "naive_cpu_ms": _timed(repeat, naive, nothing, cpu),
        "cold_cpu_ms": _timed(repeat, count, counter.text.clear_cache, cpu),
    }
