"""Pure token policy: (token counts, limits, policy) -> accept / truncate-to / clamp / reject.

No I/O and no tokenizer here: the director counts, asks these functions what to do, and (for truncation)
asks the counter to cut to the budget decided here.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import MaxTokensOverflowPolicy, PromptOverflowPolicy
from gateway.errors import ContextLengthExceeded, MaxTokensExceeded


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    min_output_tokens: int = 16

    @property
    def prompt_cap(self) -> int:
        """Longest prompt accepted as it is: one output token must always fit."""
        cap = self.max_model_len - 1
        if self.max_prompt_tokens is not None:
            cap = min(cap, self.max_prompt_tokens)
        return max(cap, 1)


def effective_max_model_len(upstream: int | None, configured: int | None) -> int | None:
    """The gateway's limit: the upstream's, lowered (never raised) by --max-model-len."""
    if upstream is None:
        return configured
    if configured is None:
        return upstream
    return min(upstream, configured)


@dataclass(frozen=True, slots=True)
class PromptDecision:
    fits: bool
    budget: int  # tokens the prompt may use; only meaningful when not fits (truncate to this)


def decide_prompt(
    prompt_tokens: int,
    limits: Limits,
    policy: PromptOverflowPolicy,
    requested_max_tokens: int | None,
    subject: str = "prompt",
) -> PromptDecision:
    """Accept a prompt that fits; else reject (raise) or say how far to truncate.

    Truncation leaves room for the output: the request's max_tokens, else --min-output-tokens, capped by
    --max-output-tokens, and never so much that the prompt would have to vanish.
    """
    if prompt_tokens <= limits.prompt_cap:
        return PromptDecision(True, prompt_tokens)
    if policy == "reject":
        param = "messages" if subject == "messages" else "prompt"
        raise ContextLengthExceeded(_prompt_message(prompt_tokens, limits, subject), param=param)
    room = requested_max_tokens if requested_max_tokens is not None else limits.min_output_tokens
    if limits.max_output_tokens is not None:
        room = min(room, limits.max_output_tokens)
    budget = min(limits.prompt_cap, limits.max_model_len - room)
    return PromptDecision(False, max(budget, 1))


def _prompt_message(prompt_tokens: int, limits: Limits, subject: str = "prompt") -> str:
    verb = "use" if subject == "messages" else "uses"
    if limits.max_prompt_tokens is not None and limits.max_prompt_tokens < limits.max_model_len - 1:
        return (
            f"This gateway accepts prompts of at most {limits.max_prompt_tokens} tokens "
            f"(the model's maximum context length is {limits.max_model_len} tokens); "
            f"your {subject} {verb} {prompt_tokens} tokens. Shorten it, or send x-guard-on-overflow: truncate."
        )
    return (
        f"This model's maximum context length is {limits.max_model_len} tokens; your {subject} {verb} "
        f"{prompt_tokens} tokens, leaving no room for the completion. Shorten it, or send "
        "x-guard-on-overflow: truncate."
    )


@dataclass(frozen=True, slots=True)
class MaxTokensDecision:
    max_tokens: int
    clamped: bool  # lowered, or set because the client omitted it


def decide_max_tokens(
    prompt_tokens: int, requested: int | None, limits: Limits, policy: MaxTokensOverflowPolicy
) -> MaxTokensDecision:
    """Bound the completion so that prompt + max_tokens fits the context (and --max-output-tokens).

    An omitted max_tokens becomes an explicit bound, so the engine never receives an unbounded request.
    ``prompt_tokens`` is the longest prompt of the request (completions may carry several).
    """
    left = limits.max_model_len - prompt_tokens
    if left < 1:
        raise ContextLengthExceeded(_prompt_message(prompt_tokens, limits))
    cap = left if limits.max_output_tokens is None else min(left, limits.max_output_tokens)
    if requested is None:
        return MaxTokensDecision(cap, True)
    if requested <= cap:
        return MaxTokensDecision(requested, False)
    if policy == "clamp":
        return MaxTokensDecision(cap, True)
    if limits.max_output_tokens is not None and requested > limits.max_output_tokens:
        raise MaxTokensExceeded(
            f"max_tokens is {requested}, but this gateway allows at most {limits.max_output_tokens} "
            "output tokens per request."
        )
    raise MaxTokensExceeded(
        f"This model's maximum context length is {limits.max_model_len} tokens; your prompt uses "
        f"{prompt_tokens} tokens, so max_tokens can be at most {left}, but {requested} was requested."
    )
