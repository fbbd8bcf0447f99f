"""The OpenAI request shapes the gateway reads. Everything else in a body passes through untouched.

Parsing checks only the fields the gateway acts on (types and sane ranges), and refuses the fields that
would make the engine run something other than what was counted (``fields``); the engine validates the rest
and its answer is relayed. The checks of the fields a prompt is made of are shared with counting (``prompts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway import jsonio
from gateway.errors import InvalidRequest
from gateway.guard import fields
from gateway.guard.prompts import (
    Prompt,
    flag,
    is_ids,
    is_int,
    json_type,
    messages_of,
    optional_list,
    optional_object,
    prompt_list,
    prompt_shape_error,
)

Route = Literal["chat", "completions", "responses"]
# OpenAI's own cap on n; far beyond it a request is a mistake, not a workload.
MAX_N = 128


@dataclass(slots=True)
class GuardedRequest:
    route: Route
    body: dict[str, Any]
    model: str | None
    stream: bool
    n: int  # sequences generated per prompt (max of n and best_of)
    max_tokens: int | None  # as requested; None when omitted
    # completions: one entry per prompt, normalised to str or token ids; chat: empty
    prompts: list[Prompt] = field(default_factory=list)
    prompt_kind: Literal["text", "texts", "ids", "ids_list", "chat"] = "chat"
    # chat and responses: the chat request the engine renders (for chat, the body itself)
    conversation: dict[str, Any] | None = None


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


def parse_chat(body: dict[str, Any]) -> GuardedRequest:
    messages_of(body)
    fields.check("chat", body)
    optional_list(body.get("tools"), "tools")
    optional_object(body.get("chat_template_kwargs"), "chat_template_kwargs")
    for name in ("add_generation_prompt", "continue_final_message"):
        flag(body, name, False)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    return GuardedRequest(
        route="chat", body=body, model=model_field(body), stream=_stream(body), n=_n(body, "chat"),
        max_tokens=max_tokens, conversation=body,
    )


def parse_responses(body: dict[str, Any]) -> GuardedRequest:
    """OpenAI's Responses API: one generation from ``instructions`` and ``input`` (see responses.py)."""
    from gateway.guard import responses  # it uses this module's helpers

    responses.refuse_stateful(body)
    fields.check("responses", body)
    conversation = responses.chat_request(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be a boolean, not {json_type(stream)}.", param="stream")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise InvalidRequest(f"'truncation' must be 'auto' or 'disabled'; got {truncation!r}.", param="truncation")
    return GuardedRequest(
        route="responses", body=body, model=model_field(body), stream=bool(stream), n=1,
        max_tokens=_max_tokens(body, ("max_output_tokens",)), conversation=conversation,
    )


def parse_completion(body: dict[str, Any]) -> GuardedRequest:
    fields.check("completions", body)
    raw = body.get("prompt")
    prompts = [list(p) if isinstance(p, list) else p for p in prompt_list(raw)]
    kind: Literal["text", "texts", "ids", "ids_list"]
    if isinstance(raw, str):
        kind = "text"
    elif is_ids(raw):
        kind = "ids"
    elif all(isinstance(p, str) for p in prompts):
        kind = "texts"
    elif all(isinstance(p, list) for p in prompts):
        kind = "ids_list"
    else:  # vLLM takes a list of prompts of one shape only
        raise prompt_shape_error(raw)
    return GuardedRequest(
        route="completions", body=body, model=model_field(body), stream=_stream(body), n=_n(body, "completions"),
        max_tokens=_max_tokens(body, ("max_tokens",)), prompts=prompts, prompt_kind=kind,
    )


def set_prompts(req: GuardedRequest, prompts: list[Prompt]) -> None:
    """Write (truncated) prompts back in the shape the client used."""
    req.prompts = prompts
    if req.prompt_kind in ("text", "ids"):
        req.body["prompt"] = prompts[0]
    else:
        req.body["prompt"] = prompts


def set_max_tokens(req: GuardedRequest, value: int) -> None:
    """Send an explicit bound upstream in every field the client used (max_tokens when none)."""
    if req.route == "responses":
        req.body["max_output_tokens"] = value
        return
    names = [f for f in ("max_completion_tokens", "max_tokens") if req.body.get(f) is not None]
    for f in names or ["max_tokens"]:
        req.body[f] = value


def model_field(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str) or not model:
        raise InvalidRequest(f"'model' must be a non-empty string, not {json_type(model)}.", param="model")
    return model


def _stream(body: dict[str, Any]) -> bool:
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


def _n(body: dict[str, Any], route: Route) -> int:
    n = _positive_int(body, "n", upper=MAX_N)
    best_of = _positive_int(body, "best_of", upper=MAX_N) if route == "completions" else None
    n = 1 if n is None else n
    if best_of is not None and best_of < n:
        raise InvalidRequest(f"'best_of' ({best_of}) must be at least 'n' ({n}).", param="best_of")
    return max(n, best_of or 0)


def _max_tokens(body: dict[str, Any], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = _positive_int(body, name)
        if value is not None:
            return value
    return None


def _positive_int(body: dict[str, Any], name: str, upper: int | None = None) -> int | None:
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
