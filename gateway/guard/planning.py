"""The planning stage: count a request's prompts as the engine will, apply the prompt and output policies, and
fit it to the KV budget. The result is a ``Plan``: the ``Booking`` admission reserves, and what the engine is to
be sent in place of what the client sent (the bound, the prompts as truncated); the request itself is never
edited. What was done (counted, truncated, clamped) is recorded in the request's outcome.

Two families: generating routes (chat, completions, responses) count prompts, truncate or reject them, and bound
and book ``max_tokens`` (where they differ, their ``Endpoint`` says how); pooling routes (embeddings, pooling,
classify, score, rerank) count each input against the context and book only prompt blocks, one sequence per
prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gateway.config import PromptOverflowPolicy
from gateway.engine.vllm_api import reading
from gateway.errors import KVBudgetExceeded, MaxTokensExceeded
from gateway.guard import offload
from gateway.guard.context import Booking, Plan
from gateway.guard.counting import PromptTokens
from gateway.guard.endpoints import pooling
from gateway.guard.endpoints.base import GuardedRequest
from gateway.guard.endpoints.pooling import PoolingRequest
from gateway.guard.parts import Outcome, Parts
from gateway.guard.policy import Limits, PromptDecision, decide_max_tokens, decide_prompt
from gateway.guard.prefixes import prompt_prefix
from gateway.guard.prompts import Prompt
from gateway.guard.seams import Admitting

# What the prompt policy made of the prompts: their tokens as the engine will run them, and the chat's messages
# or the completions' prompts as cut (None: as the client sent them).
Fitted = tuple[list[PromptTokens], list[dict[str, Any]] | None, list[Prompt] | None]


# -- generating routes ----------------------------------------------------------------------------
async def plan_generation(
    parts: Parts, req: GuardedRequest, limits: Limits, policy: PromptOverflowPolicy, out: Outcome
) -> Plan:
    s = parts.settings
    tokens = await count(parts, req)
    tokens, messages, prompts = await apply_prompt_policy(parts, req, tokens, limits, policy, out)
    sizes = await offload.run(PromptSizes.of, tokens)  # a million prompts for a body of one-token prompts
    prompt_ids = tokens[0].ids if sizes.number == 1 else None
    await offload.release(tokens)
    out.prompt_tokens = sizes.total
    sequences = req.n * sizes.number
    prefix = prompt_prefix(req.endpoint, req.body, prompt_ids)
    bound = req.endpoint.bound
    try:
        decision = decide_max_tokens(sizes.longest, req.max_tokens, limits, s.on_max_tokens_overflow)
    except MaxTokensExceeded as exc:
        if bound == "max_tokens":
            raise
        # The same bound under the endpoint's own name for it (the Responses API's max_output_tokens).
        raise MaxTokensExceeded(exc.message.replace("max_tokens", bound), param=bound) from None
    # Each sequence is charged for the longest prompt: an upper bound that stays tight. With prefix sharing the
    # n sequences of one known prompt hold its shareable blocks once.
    max_tokens = parts.admission.fit(
        sizes.longest, decision.max_tokens, sequences, clamp=s.on_max_tokens_overflow == "clamp",
        prefix_known=prefix is not None,
    )
    parts.metrics.record_max_tokens(req.route, max_tokens, decision.clamped or max_tokens != decision.max_tokens)
    out.max_tokens = max_tokens
    booking = Booking(sizes.longest, max_tokens, sequences, stream=req.stream, prompt_ids=prompt_ids, prefix=prefix,
                      min_output=sure_output(req, max_tokens))
    return Plan(booking, max_tokens, messages, prompts)


@dataclass(frozen=True)
class PromptSizes:
    """What planning needs of a request's prompts: one pass over them (a million for a body of one-token prompts,
    ~50 ms of CPU: done in a worker for a large body, not three times on the loop)."""

    total: int
    longest: int
    number: int

    @classmethod
    def of(cls, tokens: list[PromptTokens]) -> PromptSizes:
        counts = [t.count for t in tokens]
        return cls(sum(counts), max(counts), len(counts))


def sure_output(req: GuardedRequest, max_tokens: int) -> int:
    """Output tokens per sequence the engine will generate whatever the model says, read as vLLM reads the fields:
    all of ``max_tokens`` with ``ignore_eos`` (EOS never ends it; a stop string the client also sent might, and
    the request is still booked whole: what a client declares long is never booked short), at least
    ``min_tokens`` (vLLM masks EOS, stop tokens and stop strings until then). A value vLLM refuses counts as
    absent: the engine answers it with its own 400. Responses has no ``min_tokens``."""
    if reading.flag(req.body, "ignore_eos"):
        return max_tokens
    least = reading.count(req.body, "min_tokens") if req.endpoint.min_tokens else 0
    return max(0, min(least or 0, max_tokens))


async def count(parts: Parts, req: GuardedRequest) -> list[PromptTokens]:
    """Each prompt's tokens as the engine will schedule them (one for a chat or Responses request)."""
    counter = await parts.models.counter()
    t0 = time.perf_counter()
    if req.conversation is not None:
        tokens = [await counter.tokenize_chat(req.conversation)]
    else:
        tokens = await counter.tokenize_prompts(
            req.prompts,  # type: ignore[arg-type]  # one list, mixed shapes
            add_special_tokens=_adds_special_tokens(req),
        )
    total = await offload.run(lambda: sum(t.count for t in tokens))
    parts.metrics.record_counted(total, time.perf_counter() - t0)
    return tokens


def _adds_special_tokens(req: GuardedRequest) -> bool:
    return req.body.get("add_special_tokens", True) is not False


async def apply_prompt_policy(
    parts: Parts, req: GuardedRequest, tokens: list[PromptTokens], limits: Limits, policy: PromptOverflowPolicy,
    out: Outcome,
) -> Fitted:
    """The prompts once the policy has run: as counted, or truncated (with the tokens of the prompts as cut)."""
    fits = req.endpoint.fits
    if fits is not None:  # never truncated: the endpoint's own check
        fits(tokens[0].count, limits, policy)
        return tokens, None, None
    # One decision per prompt: a million of them for a body of one-token prompts, so off the loop for a large body.
    decisions, fit = await offload.run(
        _decide_prompts, tokens, limits, policy, req.max_tokens, req.endpoint.prompt_field
    )
    if fit:
        return tokens, None, None
    counter = await parts.models.counter()
    messages: list[dict[str, Any]] | None = None
    prompts: list[Prompt] | None = None
    if req.conversation is not None:
        chat = await counter.truncate_chat(req.body, decisions[0].budget)
        messages = chat.messages
        out.truncated_tokens = chat.removed_tokens
        # Truncation counts; the ids are those of the chat as cut, re-tokenized (mostly from the piece cache).
        new_tokens = [await counter.tokenize_chat({**req.body, "messages": messages})]
    else:
        # Each prompt that does not fit is cut to its budget and re-tokenized for its ids.
        add_special_tokens = _adds_special_tokens(req)
        prompts, new_tokens = [], []
        for prompt, t, d in zip(req.prompts, tokens, decisions, strict=True):
            if d.fits:
                prompts.append(prompt)
                new_tokens.append(t)
                continue
            cut = await counter.truncate_prompt(prompt, d.budget, add_special_tokens=add_special_tokens)
            out.truncated_tokens += cut.removed_tokens
            prompts.append(cut.prompt)
            new_tokens += await counter.tokenize_prompts(cut.prompt, add_special_tokens=add_special_tokens)
    parts.metrics.record_truncation(req.route, out.truncated_tokens)
    return new_tokens, messages, prompts


def _decide_prompts(
    tokens: list[PromptTokens], limits: Limits, policy: PromptOverflowPolicy, max_tokens: int | None, subject: str
) -> tuple[list[PromptDecision], bool]:
    """Each prompt's decision where one does not fit (none when all fit: a million of them are freed here, in the
    worker, not on the loop), and whether all of them fit."""
    decisions = [decide_prompt(t.count, limits, policy, max_tokens, subject) for t in tokens]
    fit = all(d.fits for d in decisions)
    return ([] if fit else decisions), fit


# -- pooling routes -------------------------------------------------------------------------------
async def plan_pooling(
    parts: Parts, req: PoolingRequest, limits: Limits, policy: PromptOverflowPolicy, engine_max_model_len: int,
    out: Outcome,
) -> Plan:
    counter = await parts.models.counter()
    t0 = time.perf_counter()
    counts = await pooling.count(counter, req.inputs)
    parts.metrics.record_counted(sum(counts), time.perf_counter() - t0)
    counts, cut, truncate = await offload.run(pooling.fit_context, req, counts, limits, policy, engine_max_model_len)
    if cut:
        out.truncated_tokens = cut
        parts.metrics.record_truncation(req.route, cut)
    out.prompt_tokens = sum(counts)
    longest = max(counts)
    booking = Booking(longest, 0, batch_sequences(parts.admission, longest, len(counts)), learns_output=False)
    return Plan(booking, truncate_prompt_tokens=truncate)


def batch_sequences(admission: Admitting, prompt_tokens: int, n: int) -> int:
    """How many prompts of a pooling batch to book, each for the longest one: all ``n``, or, for a batch
    larger than the whole KV budget, as many as the budget holds. The engine runs a batch's prompts as
    separate requests and only as many at once as its cache holds, so such a batch runs alone, in waves,
    rather than being refused. One prompt that cannot fit the budget is refused (``KVBudgetExceeded``)."""

    def fits(k: int) -> bool:
        try:
            admission.fit(prompt_tokens, 0, k, clamp=False)
        except KVBudgetExceeded:
            return False
        return True

    if fits(n):
        return n
    admission.fit(prompt_tokens, 0, 1, clamp=False)  # raises when not even one prompt fits
    low, high = 1, n  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
