"""What every guarded endpoint shares: its description (``Endpoint``), the validated request of a generating
route (``GuardedRequest``), the checks of the fields several routes read, and the body the engine is sent.

A request is validated once, into a frozen record; the client's body it came from is never edited. What the
guard decides for it (the ``Plan``: the bound sent, a truncated conversation or prompts, the engine's own cut)
is written over a copy of that body in one place, ``engine_body``, on the way out. Everything else in a body
passes through untouched: parsing checks only the fields the gateway acts on (types and sane ranges) and
refuses the fields that would make the engine run something other than what was counted (``fields``); the
engine validates the rest and its answer is relayed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from gateway import jsonio
from gateway.config import PromptOverflowPolicy
from gateway.engine.usage import EVERYTHING, UsageAsk, ask_engine_for_usage
from gateway.errors import InvalidRequest
from gateway.guard.context import Plan
from gateway.guard.policy import Limits
from gateway.guard.prompts import Prompt, is_int, json_type

Family = Literal["generating", "pooling"]
PromptKind = Literal["text", "texts", "ids", "ids_list", "chat"]
# OpenAI's own cap on n; far beyond it a request is a mistake, not a workload.
MAX_N = 128


class Validated(Protocol):
    """What every endpoint's validated request has: its endpoint, the client's body (never edited), its model."""

    @property
    def endpoint(self) -> Endpoint[Validated]: ...

    @property
    def body(self) -> dict[str, Any]: ...

    @property
    def model(self) -> str | None: ...


R = TypeVar("R", bound=Validated, covariant=True)


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[R]):
    """One guarded endpoint: its route name (the metrics' label, the access log's, the fields table's key),
    the canonical paths it is served on, its family, and its parser. The generating routes also say how they
    differ where the request path is common to them:

    ``bound``: the output bound's name in what the client is told; ``bound_fields``: the fields the client
    may state it in, read in this order, and written back with the bound sent (the last when none was given);
    ``prompt_field``: what a prompt too long for the context is called; ``asks_usage``: a stream asks the
    engine for its usage figures (``gateway.engine.usage``); ``echo_logprobs``: the field that, with ``echo``,
    asks for prompt logprobs (``prefixes``); ``min_tokens``: vLLM reads ``min_tokens`` here; ``fits``: the
    check of an endpoint whose prompt is never truncated, in place of the prompt policy; ``operation``: its
    ``gen_ai.operation.name`` in traces (the GenAI semantic conventions' well-known value where one fits).
    """

    name: str
    paths: tuple[str, ...]
    family: Family
    parse: Callable[[dict[str, Any]], R]
    bound: str = "max_tokens"
    bound_fields: tuple[str, ...] = ("max_tokens",)
    prompt_field: str = "prompt"
    asks_usage: bool = False
    echo_logprobs: str | None = None
    min_tokens: bool = True
    fits: Callable[[int, Limits, PromptOverflowPolicy], None] | None = None
    operation: str | None = None


@dataclass(frozen=True, slots=True)
class GuardedRequest:
    """A generating route's request as validated. ``body``: the client's, never edited."""

    endpoint: Endpoint[GuardedRequest]
    body: dict[str, Any]
    model: str | None
    stream: bool
    n: int  # sequences generated per prompt (max of n and best_of)
    max_tokens: int | None  # as requested; None when omitted
    # completions: one entry per prompt, normalised to str or token ids; chat: empty
    prompts: list[Prompt] = field(default_factory=list)
    prompt_kind: PromptKind = "chat"
    # chat and responses: the chat request the engine renders (for chat, the body itself)
    conversation: dict[str, Any] | None = None

    @property
    def route(self) -> str:
        return self.endpoint.name


def engine_body(req: Validated, plan: Plan) -> tuple[dict[str, Any], UsageAsk]:
    """The body sent to the engine: the client's with the plan's decisions written over it (a field the client
    sent keeps its place, one it did not comes last), and what of a stream's usage the client asked for: a
    stream of an endpoint that ``asks_usage`` asks the engine for its figures, and the relay takes out what was
    not asked."""
    patch: dict[str, Any] = {}
    if plan.messages is not None:
        patch["messages"] = plan.messages
    if plan.prompts is not None and isinstance(req, GuardedRequest):
        patch["prompt"] = plan.prompts[0] if req.prompt_kind in ("text", "ids") else plan.prompts
    if plan.max_tokens is not None:
        names = req.endpoint.bound_fields
        for name in [f for f in names if req.body.get(f) is not None] or [names[-1]]:
            patch[name] = plan.max_tokens
    if plan.truncate_prompt_tokens is not None:
        patch["truncate_prompt_tokens"] = plan.truncate_prompt_tokens
    body = {**req.body, **patch} if patch else req.body
    if plan.booking.stream and req.endpoint.asks_usage:
        return ask_engine_for_usage(body)
    return body, EVERYTHING


# -- the fields several routes read ----------------------------------------------------------------
def decode_json(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        data = jsonio.loads(raw)
    except jsonio.TooDeep as exc:
        raise InvalidRequest(str(exc)) from exc
    except ValueError as exc:
        # orjson reports invalid UTF-8 and malformed JSON alike; say which when we can.
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as ue:
            raise InvalidRequest(f"The request body is not valid UTF-8 (byte {ue.start}).") from exc
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest(f"The request body must be a JSON object, not {json_type(data)}.")
    return data


def model_field(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str) or not model:
        raise InvalidRequest(f"'model' must be a non-empty string, not {json_type(model)}.", param="model")
    return model


def stream_flag(body: dict[str, Any]) -> bool:
    """``stream``, with ``stream_options`` allowed only beside a stream."""
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be a boolean, not {json_type(stream)}.", param="stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    return bool(stream)


def sequences(body: dict[str, Any], *, best_of: bool) -> int:
    """Sequences generated per prompt: ``n``, or ``best_of`` where the route reads it and it is larger."""
    n = positive_int(body, "n", upper=MAX_N)
    most = positive_int(body, "best_of", upper=MAX_N) if best_of else None
    n = 1 if n is None else n
    if most is not None and most < n:
        raise InvalidRequest(f"'best_of' ({most}) must be at least 'n' ({n}).", param="best_of")
    return max(n, most or 0)


def output_bound(body: dict[str, Any], names: tuple[str, ...]) -> int | None:
    """The output bound the client asked for: the first of ``names`` it gave."""
    for name in names:
        value = positive_int(body, name)
        if value is not None:
            return value
    return None


def positive_int(body: dict[str, Any], name: str, upper: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise InvalidRequest(f"'{name}' must be an integer, not {json_type(value)}.", param=name)
    if value < 1:
        raise InvalidRequest(f"'{name}' must be at least 1; got {value}.", param=name)
    if upper is not None and value > upper:
        raise InvalidRequest(f"'{name}' must be at most {upper}; got {value}.", param=name)
    return int(value)
