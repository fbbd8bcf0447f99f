"""vLLM's ``/tokenize`` and ``/detokenize`` behind the gateway, bounded like the guarded routes.

vLLM's API server tokenizes on its one event loop: a 7.8 MB ``/tokenize`` held it ~9 s, during which no stream,
scrape or other request moved, and its 19.5 MB answer was read whole. Here both routes take the guarded routes'
limits: the body within ``--max-body-bytes``, and the prompt's tokens within the context (and
``--max-prompt-tokens``) exactly as a guarded prompt (400 ``context_length_exceeded`` past it).

``/tokenize`` is answered by the gateway itself when it has the model's tokenizer: counted by the counting layer as
the guarded routes count (large inputs in its worker, never on the loop), in vLLM 0.32's shape
(``entrypoints/serve/tokenize``: ``{count, max_model_len, tokens, token_strs}``, ``max_model_len`` being the
gateway's limit, as ``/v1/models`` reports it). Without a local tokenizer, and for chats with media parts (whose
tokens only the engine knows), it goes to the engine, and the engine's count is held to the same limit.
``/detokenize`` is counted by its ids and goes to the engine only within the limit. Engine answers are read
within ``--max-answer-bytes`` (``passthrough.forward``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.errors import BadUpstreamResponse, ContextLengthExceeded, InvalidRequest, UpstreamUnavailable
from gateway.guard.counting import LocalCounter, PromptTokens
from gateway.guard.endpoints.base import decode_json
from gateway.guard.parts import Parts
from gateway.guard.pipeline import served_listing
from gateway.guard.policy import Limits, decide_prompt, effective_max_model_len
from gateway.guard.prompts import flag, is_int, json_type
from gateway.http.auth import authenticate
from gateway.http.body import BodyLimits, read_body
from gateway.http.context import request_id
from gateway.http.passthrough import forward

# Bodies larger than this are parsed in a worker thread: orjson takes ~10 ms a megabyte of token ids.
INLINE_PARSE_BYTES = 64 * 1024
# Token strings for more ids than this are looked up in a worker thread.
INLINE_TOKEN_STRS = 2048
# The fields of vLLM 0.32's TokenizeChatRequest (others are ignored by vLLM, so they must not reach the template
# here: a chat completion's ``documents`` would change the count).
CHAT_FIELDS = (
    "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "tools", "media_io_kwargs", "mm_processor_kwargs",
)
MAX_TOKEN_ID = 2**63 - 1  # vLLM's DetokenizeRequest: ids are 0 <= id <= 2**63 - 1


async def tokenize(parts: Parts, request: Request) -> Response:
    rid = request_id(request)
    read = await _read(parts, request)
    if read is None:
        return Response(status_code=499)
    raw, body = read
    chat = _is_chat(body)
    limits = await _limits(parts, body)
    counter = await parts.models.counter()
    if isinstance(counter, LocalCounter):
        tokens = await _count(counter, body, chat)
        _check(tokens.count, limits, "messages" if chat else "prompt")
        if tokens.ids is not None:
            return await _answer(counter, tokens.ids, limits.max_model_len, body, rid)
        # Media parts: counted and bounded, but only the engine knows their ids.
    return await forward(
        parts, request, "/tokenize", raw, rid, check=lambda answer: _check_answer(answer, limits, chat)
    )


async def detokenize(parts: Parts, request: Request) -> Response:
    rid = request_id(request)
    read = await _read(parts, request)
    if read is None:
        return Response(status_code=499)
    raw, body = read
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise InvalidRequest(f"'tokens' must be a list of token ids, not {json_type(ids)}.", param="tokens")
    limits = await _limits(parts, body)
    if len(ids) > limits.prompt_cap:  # before walking a list that may hold millions of entries
        raise ContextLengthExceeded(
            f"This gateway accepts at most {limits.prompt_cap} tokens (the model's maximum context length is "
            f"{limits.max_model_len} tokens); your tokens list holds {len(ids)} ids.", param="tokens",
        )
    if not all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise InvalidRequest(f"'tokens' must hold integers from 0 to {MAX_TOKEN_ID}.", param="tokens")
    return await forward(parts, request, "/detokenize", raw, rid)


# Pass-through paths this module serves (``handlers.forwarding``): the others are forwarded as they are.
HANDLERS: dict[str, Callable[[Parts, Request], Awaitable[Response]]] = {
    "/tokenize": tokenize, "/detokenize": detokenize,
}


async def _read(parts: Parts, request: Request) -> tuple[bytes, dict[str, Any]] | None:
    """The caller authenticated, then the body within the guarded routes' limits and its JSON object (parsed off
    the loop when large); None when the client left while sending it."""
    authenticate(parts.settings, request)
    try:
        raw = await read_body(request, BodyLimits.of(parts.settings))
    except ClientDisconnect:
        return None
    body = decode_json(raw) if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(decode_json, raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, not {json_type(model)}.", param="model")
    return raw, body


def _is_chat(body: dict[str, Any]) -> bool:
    """Which of vLLM's two tokenize requests ``body`` is; one that could be read as both is refused."""
    if "messages" in body and "prompt" in body:
        raise InvalidRequest("Send either 'prompt' or 'messages' to /tokenize, not both.", param="messages")
    if "messages" in body:
        if flag(body, "continue_final_message", False) and flag(body, "add_generation_prompt", True):
            raise InvalidRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        return True
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest(
            f"/tokenize takes a 'prompt' string or a 'messages' list; 'prompt' is {json_type(prompt)}.", param="prompt"
        )
    return False


async def _limits(parts: Parts, body: dict[str, Any]) -> Limits:
    """The guarded routes' limits for the requested model (404 for one the engine does not serve)."""
    s = parts.settings
    info = await served_listing(parts)
    parts.models.check_model(body.get("model"), info)
    limit = effective_max_model_len(info.max_model_len, s.max_model_len)
    if limit is None:
        raise UpstreamUnavailable("The upstream does not report max_model_len yet.", retry_after=5)
    return Limits(limit, s.max_prompt_tokens, s.max_output_tokens, s.min_output_tokens)


async def _count(counter: LocalCounter, body: dict[str, Any], chat: bool) -> PromptTokens:
    flag(body, "return_token_strs", False)
    if chat:
        return await counter.tokenize_chat({k: body[k] for k in CHAT_FIELDS if k in body})
    prompt: str = body["prompt"]
    add_special_tokens = flag(body, "add_special_tokens", True)
    return (await counter.tokenize_prompts(prompt, add_special_tokens=add_special_tokens))[0]


def _check(count: int, limits: Limits, subject: str) -> None:
    decide_prompt(count, limits, "reject", None, subject)  # raises ContextLengthExceeded past the limit


def _check_answer(answer: bytes, limits: Limits, chat: bool) -> None:
    """The engine's count of a forwarded /tokenize, held to the limit a local count is held to."""
    try:
        count = orjson.loads(answer).get("count")
    except (orjson.JSONDecodeError, AttributeError) as exc:
        raise BadUpstreamResponse("The upstream's /tokenize answered 200 without a JSON object.") from exc
    if not is_int(count):
        raise BadUpstreamResponse("The upstream's /tokenize answered 200 without a count.")
    _check(count, limits, "messages" if chat else "prompt")


async def _answer(
    counter: LocalCounter, ids: tuple[int, ...], max_model_len: int, body: dict[str, Any], rid: str
) -> Response:
    """vLLM's TokenizeResponse, field for field (``token_strs`` null unless asked for)."""
    token_strs: list[str] | None = None
    if flag(body, "return_token_strs", False):
        convert = counter.tokenizer.convert_ids_to_tokens
        strs = convert(list(ids)) if len(ids) <= INLINE_TOKEN_STRS else await asyncio.to_thread(convert, list(ids))
        token_strs = [str(s) for s in strs]
    payload = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}
    return Response(orjson.dumps(payload), media_type="application/json", headers={"x-request-id": rid})
