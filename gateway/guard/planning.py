"""The planning stage: count a request's prompts as the engine will, apply the prompt and output policies, and
fit it to the KV budget. The result is the ``Booking`` admission reserves; what was done (counted, truncated,
clamped) is recorded in the request's outcome.

Two families: generating routes (chat, completions, responses) count prompts, truncate or reject them, and bound
and book ``max_tokens``; pooling routes (embeddings, pooling, classify, score, rerank) count each input against
the context and book only prompt blocks, one sequence per prompt.
"""

from __future__ import annotations

import time

from gateway.admission.controller import Admission
from gateway.config import PromptOverflowPolicy, Settings
from gateway.errors import KVBudgetExceeded, MaxTokensExceeded
from gateway.guard import pooling, responses
from gateway.guard.context import Booking
from gateway.guard.parts import Outcome, Parts
from gateway.guard.policy import Limits, MaxTokensDecision, decide_max_tokens, decide_prompt
from gateway.guard.pooling import PoolingRequest
from gateway.guard.prompts import Prompt
from gateway.guard.protocol import GuardedRequest, set_max_tokens, set_prompts


# -- generating routes ----------------------------------------------------------------------------
async def plan_generation(
    parts: Parts, req: GuardedRequest, limits: Limits, policy: PromptOverflowPolicy, out: Outcome
) -> Booking:
    s = parts.settings
    counts = await count(parts, req)
    counts = await apply_prompt_policy(parts, req, counts, limits, policy, out)
    out.prompt_tokens = sum(counts)
    decision = decide_output(req, max(counts), limits, s)
    sequences = req.n * len(counts)
    # Each sequence is charged for the longest prompt: an upper bound that stays tight.
    max_tokens = parts.admission.fit(
        max(counts), decision.max_tokens, sequences, clamp=s.on_max_tokens_overflow == "clamp"
    )
    parts.metrics.record_max_tokens(req.route, max_tokens, decision.clamped or max_tokens != decision.max_tokens)
    set_max_tokens(req, max_tokens)
    out.max_tokens = max_tokens
    return Booking(max(counts), max_tokens, sequences, stream=req.stream)


async def count(parts: Parts, req: GuardedRequest) -> list[int]:
    counter = await parts.models.counter()
    t0 = time.perf_counter()
    if req.conversation is not None:
        counts = [await counter.count_chat(req.conversation)]
    else:
        counts = await counter.count_prompts(
            req.prompts,  # type: ignore[arg-type]  # one list, mixed shapes
            add_special_tokens=req.body.get("add_special_tokens", True) is not False,
        )
    parts.metrics.record_counted(sum(counts), time.perf_counter() - t0)
    return counts


async def apply_prompt_policy(
    parts: Parts, req: GuardedRequest, counts: list[int], limits: Limits, policy: PromptOverflowPolicy,
    out: Outcome,
) -> list[int]:
    if req.route == "responses":
        responses.check_fits(counts[0], limits, policy)
        return counts
    subject = "messages" if req.route == "chat" else "prompt"
    decisions = [decide_prompt(c, limits, policy, req.max_tokens, subject) for c in counts]
    if all(d.fits for d in decisions):
        return counts
    counter = await parts.models.counter()
    if req.route == "chat":
        cut = await counter.truncate_chat(req.body, decisions[0].budget)
        req.body["messages"] = cut.messages
        out.truncated_tokens = cut.removed_tokens
        new_counts = [cut.prompt_tokens]
    else:
        prompts: list[Prompt] = []
        new_counts = []
        for prompt, c, d in zip(req.prompts, counts, decisions, strict=True):
            if d.fits:
                prompts.append(prompt)
                new_counts.append(c)
                continue
            t = await counter.truncate_prompt(
                prompt, d.budget, add_special_tokens=req.body.get("add_special_tokens", True) is not False
            )
            prompts.append(t.prompt)
            new_counts.append(t.prompt_tokens)
            out.truncated_tokens += t.removed_tokens
        set_prompts(req, prompts)
    parts.metrics.record_truncation(req.route, out.truncated_tokens)
    return new_counts


def decide_output(req: GuardedRequest, prompt_tokens: int, limits: Limits, s: Settings) -> MaxTokensDecision:
    try:
        return decide_max_tokens(prompt_tokens, req.max_tokens, limits, s.on_max_tokens_overflow)
    except MaxTokensExceeded as exc:
        if req.route != "responses":
            raise
        # The same bound under the Responses API's name for it.
        raise MaxTokensExceeded(
            exc.message.replace("max_tokens", "max_output_tokens"), param="max_output_tokens"
        ) from None


# -- pooling routes -------------------------------------------------------------------------------
async def plan_pooling(
    parts: Parts, req: PoolingRequest, limits: Limits, policy: PromptOverflowPolicy, engine_max_model_len: int,
    out: Outcome,
) -> Booking:
    counter = await parts.models.counter()
    t0 = time.perf_counter()
    counts = await pooling.count(counter, req.inputs)
    parts.metrics.record_counted(sum(counts), time.perf_counter() - t0)
    counts, cut = pooling.fit_context(req, counts, limits, policy, engine_max_model_len)
    if cut:
        out.truncated_tokens = cut
        parts.metrics.record_truncation(req.route, cut)
    out.prompt_tokens = sum(counts)
    longest = max(counts)
    return Booking(longest, 0, batch_sequences(parts.admission, longest, len(counts)), learns_output=False)


def batch_sequences(admission: Admission, prompt_tokens: int, n: int) -> int:
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
