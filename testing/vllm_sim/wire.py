"""Wire formats of the vLLM simulator: request fields, response bodies, SSE chunks, validation wording.

Shapes are those of vLLM 0.32's pydantic models as its server serialises them: non-streaming bodies with
``model_dump()`` (every field, nulls included), stream chunks with ``model_dump_json(exclude_unset=True)``,
the final usage chunk with ``exclude_none=True``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from .engine import Sequence

_WORDS = ("the ", "quick ", "brown ", "fox ", "jumps ", "over ", "a ", "lazy ", "dog ", "while ", "tokens ",
          "stream ", "out ", "of ", "the ", "simulated ", "engine ", "one ", "step ", "at ", "a ", "time ")
_INTERNAL_LOC = frozenset({"function-wrap", "function-after", "function-before", "function-plain", "union",
                           "tagged-union", "default", "nullable", "chain", "lax-or-strict", "json-or-python",
                           "str", "int", "float", "bool", "list", "dict", "none"})

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatBody(BaseModel):
    """The fields of vLLM's ChatCompletionRequest the simulator reads, with vLLM's types and defaults."""

    model_config = ConfigDict(extra="allow")
    messages: list[dict[str, Any]]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None
    ignore_eos: bool = False
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None


_TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: _TokenIds | list[_TokenIds] | str | list[str] | None = None
    max_tokens: int | None = 16
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None
    ignore_eos: bool = False
    add_special_tokens: bool = True


@dataclass
class Plan:
    """A validated generation request: what to submit and how to answer."""

    chat: bool
    request_id: str
    prompts: list[int]
    max_tokens: list[int]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    ignore_eos: bool
    role: str = "assistant"
    # The prompts' token ids (``prompts`` are their lengths) and what else keys their KV blocks.
    prompt_ids: list[list[int]] = field(default_factory=list)
    lora: tuple[str, str] | None = None
    cache_salt: str | None = None
    # The name responses carry: the base model's, or the LoRA adapter's the request named.
    model: str = ""
    # --enable-prompt-tokens-details: usage carries prompt_tokens_details.
    prompt_details: bool = False
    # What ends answers before max_tokens: EOS masked for min_tokens tokens, and the logit bias on EOS.
    min_tokens: int = 0
    eos_bias: float = 0.0
    # Tokens per stream chunk at most, as vLLM's output processor sends them: the first token at once, then
    # every ``stream_interval`` tokens and at the end (the larger of the request's and the server's).
    stream_interval: int = 1
    # Stamped on full answers, on the usage chunk, and (without usage) on each choice's last chunk.
    fingerprint: str | None = None


def token_text(start: int, end: int) -> str:
    return "".join(_WORDS[i % len(_WORDS)] for i in range(start, end))


def full_body(plan: Plan, seqs: list[Sequence], model: str) -> dict[str, Any]:
    """The non-streaming response, with every field vLLM's ``model_dump()`` writes."""
    created = int(time.time())
    completion = sum(s.generated for s in seqs)
    prompt = plan.prompts[0] if plan.chat else sum(plan.prompts)
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
             "prompt_tokens_details": _prompt_details(plan, seqs), "completion_tokens_details": None}
    if plan.chat:
        choices: list[dict[str, Any]] = [
            {"index": s.index, "message": {"role": plan.role, "content": token_text(0, s.generated),
                                           "refusal": None, "annotations": None, "audio": None,
                                           "function_call": None, "reasoning": None},
             "logprobs": None, "finish_reason": s.finish_reason, "stop_reason": None, "token_ids": None,
             "routed_experts": None} for s in seqs]
        return {"id": plan.request_id, "object": "chat.completion", "created": created,
                "model": model, "choices": choices, "service_tier": None,
                "system_fingerprint": plan.fingerprint, "usage": usage, "prompt_logprobs": None,
                "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
                "metrics": None}
    choices = [{"index": s.index, "text": token_text(0, s.generated), "logprobs": None,
                "finish_reason": s.finish_reason, "stop_reason": None, "token_ids": None,
                "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None} for s in seqs]
    return {"id": plan.request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "service_tier": None, "system_fingerprint": plan.fingerprint, "usage": usage,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def _prompt_details(plan: Plan, seqs: list[Sequence]) -> dict[str, Any] | None:
    """``usage.prompt_tokens_details`` of a full response: the prefill stats of the sequence whose output
    completed the request (for completions, of the last prompt), as vLLM's final RequestOutput carries them."""
    if not plan.prompt_details:
        return None
    last = max(seqs if plan.chat else seqs[-plan.n:], key=lambda s: s.finish_order)
    created = last.created_cache_tokens if plan.chat else None  # the completions route reports hits only
    return {"cached_tokens": last.cached_tokens, "created_cache_tokens": created, "multimodal_tokens": None}


class SseWriter:
    """vLLM's SSE chunks, byte for byte the shapes of ``model_dump_json(exclude_unset=True)``."""

    def __init__(self, plan: Plan, model: str, created: int, choices: int) -> None:
        self.plan = plan
        kind = "chat.completion.chunk" if plan.chat else "text_completion"
        self.head = (b'data: {"id":' + orjson.dumps(plan.request_id) + b',"object":"' + kind.encode()
                     + b'","created":' + str(created).encode() + b',"model":' + orjson.dumps(model))
        self.done = [0] * choices
        self.started = False
        self.sent = 0

    def _prompt_tokens(self, index: int) -> int:
        return self.plan.prompts[0 if self.plan.chat else index // self.plan.n]

    def _chunk(self, choice: dict[str, Any], usage: dict[str, int] | None = None, extra: bytes = b"") -> bytes:
        usage_field = b',"usage":' + orjson.dumps(usage) if usage is not None else b""
        return self.head + b',"choices":[' + orjson.dumps(choice) + b"]" + usage_field + extra + b"}\n\n"

    def token_chunks(self, index: int, generated: int, finish: str | None) -> list[bytes]:
        chunks: list[bytes] = []
        plan = self.plan
        if plan.chat and not self.started:
            # vLLM sends the role delta of every choice with the first engine output.
            self.started = True
            for i in range(len(self.done)):
                usage = self._usage(i, 0) if plan.continuous_usage else None
                chunks.append(self._chunk({"index": i, "delta": {"role": plan.role, "content": ""},
                                           "logprobs": None, "finish_reason": None}, usage,
                                          b',"prompt_token_ids":null,"prompt_text":null'))
        sent = self.done[index]
        if plan.stream_interval > 1:
            if finish is None and sent > 0 and generated - sent < plan.stream_interval:
                return chunks  # vLLM's output processor holds them until the interval fills or the end
            spans = [(sent, generated)] if generated > sent else []
        else:
            spans = [(k, k + 1) for k in range(sent, generated)]
        for start, end in spans:
            last = end == generated and finish is not None
            text = token_text(start, end)
            choice: dict[str, Any]
            if plan.chat:
                choice = {"index": index, "delta": {"content": text}, "logprobs": None,
                          "finish_reason": finish if last else None}
                if last:
                    choice["stop_reason"] = None
                choice["token_ids"] = None
            else:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish if last else None,
                          "stop_reason": None, "prompt_token_ids": None, "token_ids": None}
            stamp = b""
            if last and plan.fingerprint is not None and not plan.include_usage:
                stamp = b',"system_fingerprint":' + orjson.dumps(plan.fingerprint)
            chunks.append(self._chunk(choice, self._usage(index, end) if plan.continuous_usage else None, stamp))
        self.done[index] = max(self.done[index], generated)
        return chunks

    def _usage(self, index: int, completion: int) -> dict[str, int]:
        prompt = self._prompt_tokens(index)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    def usage_chunk(self, first: Sequence | None = None) -> bytes:
        """The final usage chunk; ``first`` is the sequence whose output came first (its prefill stats)."""
        prompt = self.plan.prompts[0] if self.plan.chat else sum(self.plan.prompts)
        completion = sum(self.done)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                 "completion_tokens": completion}
        if self.plan.prompt_details and first is not None:
            details = {"cached_tokens": first.cached_tokens}
            if self.plan.chat:
                details["created_cache_tokens"] = first.created_cache_tokens
            usage["prompt_tokens_details"] = details
        stamp = b',"system_fingerprint":' + orjson.dumps(self.plan.fingerprint) if self.plan.fingerprint else b""
        return self.head + b',"choices":[],"usage":' + orjson.dumps(usage) + stamp + b"}\n\n"


def clean_loc(loc: Any) -> str:
    parts = [str(p) for p in loc if not (any(c in str(p) for c in "[]{}()") or str(p).lower() in _INTERNAL_LOC)]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def format_error(err: Any) -> str:
    if isinstance(err, dict):
        err = dict(err)
        value = err.get("input")
        if isinstance(value, (list, tuple, set, dict)):
            err["input"] = f"<{type(value).__name__} of {len(value)} items>"
        elif isinstance(value, str) and len(value) > 200:
            err["input"] = value[:200] + "...[truncated]"
        if isinstance(err.get("loc"), (tuple, list)):
            err["loc"] = clean_loc(err["loc"])
    text = str(err)
    return text[:1000] + "...[truncated]" if len(text) > 1000 else text
