"""The vLLM simulator's Responses API and pooling routes, answered the way vLLM 0.32 answers them.

- ``POST /v1/responses``: ``instructions`` and ``input`` become chat messages (``construct_input_messages``),
  rendered with the chat template and tokenized *with* special tokens (``ResponsesRequest.build_tok_params``
  keeps ``TokenizeParams``' default); one generation, answered as a ``response`` object or streamed as
  ``event:``/``data:`` SSE events, with ``usage.input_tokens``.
- ``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score`` (``/v1``), ``/rerank`` (``/v1``, ``/v2``): each
  input or text pair is one prompt, counted as vLLM tokenizes it (``truncate_prompt_tokens``, ``padding``,
  ``max_tokens_per_query``/``doc`` included), refused over the context; ``usage.prompt_tokens`` is their
  sum. Pairs are encoded as a cross-encoder's, ``tokenizer(text, text_pair=...)``. Nothing is generated, so
  nothing goes through the simulated engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Send

from .dp import RANK_HEADER
from .engine import Sequence
from .handling import Handlers, Rejected, Run, asgi, until_disconnect
from .text import ChatTemplateError
from .wire import token_text

_CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}


class SimRoutes:
    """Handlers for the simulator's app; ``app`` is the app's own handlers, as ``Handlers`` (handling.py) names what
    of them these use (errors, body reading, counter, engine, checks)."""

    def __init__(self, app: Handlers) -> None:
        self.app = app

    async def _answer(self, request: Request, plan: Any) -> Response:
        body = await self.app.read_json(request)
        if isinstance(body, JSONResponse):
            return body
        self.app.sim.record_request(body, request.headers.get(RANK_HEADER))
        try:
            self.app.check_model(body.get("model"))
            result: Response = await plan(body, request)
            return result
        except Rejected as exc:
            error: Response = self.app.error(exc.message, exc.err_type, exc.status, exc.param)
        except ChatTemplateError as exc:
            error = self.app.error(str(exc))
        return error

    # -- /v1/responses --------------------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        return await self._answer(request, self._respond)

    async def _respond(self, body: dict[str, Any], request: Request) -> Response:
        app = self.app
        limit = app.config.max_model_len
        if body.get("background"):
            raise Rejected("This vLLM engine does not support `store=True` and therefore does not support the "
                            "background mode. To enable these features, set the environment variable "
                            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                            "background", "invalid_request_error")
        if body.get("previous_response_id") is not None:
            raise Rejected(f"Response with id '{body['previous_response_id']}' not found.", "response_id",
                            "invalid_request_error", 404)
        requested = body.get("max_output_tokens")
        if requested is not None and requested > limit:
            raise Rejected(f"max_output_tokens={requested} cannot be greater than max_model_len={limit}. Please "
                            "request fewer output tokens.", "max_output_tokens")
        items = body["input"]
        last = items[-1] if isinstance(items, list) and items else None
        continued = isinstance(last, dict) and last.get("type", "message") in ("message", "reasoning") and \
            last.get("status") in ("in_progress", "incomplete")
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.update(add_generation_prompt=not continued, continue_final_message=continued)
        effort = (body.get("reasoning") or {}).get("effort")
        if effort is not None:
            kwargs.update(reasoning_effort=effort, enable_thinking=effort != "none")
        text = app.counter.chat_text(_messages(body.get("instructions"), items), _tools(body.get("tools")), kwargs)
        ids = app.prompt_ids(text, True)
        prompt = len(ids)
        if prompt > limit:
            raise Rejected(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                            f"at least {prompt} input tokens, which exceeds this limit even without any output "
                            "tokens. Please reduce the length of the input prompt.", "input_tokens")
        if prompt >= limit:
            raise Rejected(f"The engine prompt length {prompt} exceeds the max_model_len {limit}. Please reduce "
                            "prompt.", "input", "invalid_request_error")
        max_tokens = limit - prompt if requested is None else min(requested, limit - prompt)
        run = Run(1, bool(body.get("stream")))
        target = app.sim.output_length(app.sim.request_count - 1, max_tokens, bool(body.get("ignore_eos")))
        keys = app.kv_keys(body)
        run.seqs += app.sim.submit(ids, 1, max_tokens, target, run.on_token, lora=keys["lora"],
                                   cache_salt=keys["cache_salt"])
        shape = _ResponseShape(body, keys["model"], prompt, max_tokens)
        if body.get("stream"):
            return asgi(lambda receive, send: self._stream(receive, send, run, shape))
        return asgi(lambda receive, send: self._respond_when_done(receive, send, run, shape))

    async def _respond_when_done(self, receive: Receive, send: Send, run: Run, shape: _ResponseShape) -> None:
        gone = asyncio.ensure_future(until_disconnect(receive))
        done = asyncio.ensure_future(run.finished.wait())
        try:
            await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            done.cancel()
        if not run.finished.is_set():
            self.app.sim.abort(run.seqs)
            return
        seq = run.seqs[0]
        payload = orjson.dumps(shape.response(seq.generated, seq.finish_reason, seq))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})

    async def _stream(self, receive: Receive, send: Send, run: Run, shape: _ResponseShape) -> None:
        assert run.events is not None
        events = run.events

        async def watch() -> None:
            await until_disconnect(receive)
            events.put_nowait((None, 0, None))

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            await send({"type": "http.response.body", "body": shape.opening(), "more_body": True})
            sent = 0
            while True:
                seq, generated, finish = await events.get()
                if seq is None:
                    return
                deltas = b"".join(shape.delta(token_text(k, k + 1)) for k in range(sent, generated))
                sent = generated
                if finish is not None:
                    await send({"type": "http.response.body", "body": deltas + shape.closing(sent, finish, seq),
                                "more_body": False})
                    return
                await send({"type": "http.response.body", "body": deltas, "more_body": True})
        finally:
            watcher.cancel()
            if run.remaining:
                self.app.sim.abort(run.seqs)

    # -- pooling --------------------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        return await self._answer(request, lambda body, _: self._pool(body, "embeddings"))

    async def pooling(self, request: Request) -> Response:
        return await self._answer(request, lambda body, _: self._pool(body, "pooling"))

    async def classify(self, request: Request) -> Response:
        return await self._answer(request, lambda body, _: self._pool(body, "classify"))

    async def score(self, request: Request) -> Response:
        return await self._answer(request, lambda body, _: self._score(body, rerank=False))

    async def rerank(self, request: Request) -> Response:
        return await self._answer(request, lambda body, _: self._score(body, rerank=True))

    async def _pool(self, body: dict[str, Any], kind: str) -> Response:
        messages = body.get("messages")
        raw = body.get("input")
        if messages is None and kind == "embeddings" and (_is_conversation(raw) or _is_batch(raw)):
            messages = raw
        if messages is not None:
            batch = messages if _is_batch(messages) else [messages]
            counts = [self._chat_tokens(body, conversation) for conversation in batch]
        elif isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw)):
            texts = [raw] if isinstance(raw, str) else raw
            add = body.get("add_special_tokens", True) is not False
            counts = [self._tokens(self.app.counter.encode, body, t, add) for t in texts]
        elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
            counts = [self._ids(body, raw)]
        elif isinstance(raw, list) and raw and all(isinstance(p, list) and p for p in raw):
            counts = [self._ids(body, p) for p in raw]
        else:
            raise Rejected("1 validation error:\n  {'type': 'missing', 'loc': ('body', 'input'), 'msg': 'Field "
                            "required'}", "input", "Bad Request")
        return JSONResponse(_pooling_body(kind, self.app.config.model, counts))

    async def _score(self, body: dict[str, Any], *, rerank: bool) -> Response:
        if rerank:
            first: Any = [body.get("query")]
            second = body.get("documents")
        else:
            name = next((n for n in (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                                     ("data_1", "data_2")) if n[0] in body), ("text_1", "text_2"))
            first, second = body.get(name[0]), body.get(name[1])
        firsts = first if isinstance(first, list) else [first]
        seconds = second if isinstance(second, list) else [second]
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise Rejected("Input lengths must be either 1:1, 1:N or N:N")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        counts = [self._pair_tokens(body, a, b) for a, b in zip(firsts, seconds, strict=True)]
        model, total = self.app.config.model, sum(counts)
        scores = [round(1.0 / (1 + i + len(b) % 7), 6) for i, b in enumerate(seconds)]
        if not rerank:
            return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                                 "model": model, "data": [{"index": i, "object": "score", "score": s}
                                                          for i, s in enumerate(scores)],
                                 "usage": _usage(total)})
        order = sorted(range(len(seconds)), key=lambda i: -scores[i])
        top_n = body.get("top_n") or len(order)
        results = [{"index": i, "document": {"text": seconds[i], "multi_modal": None},
                    "relevance_score": scores[i]} for i in order[:top_n]]
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": model,
                             "usage": {"prompt_tokens": total, "total_tokens": total}, "results": results})

    # -- counting as vLLM's TokenizeParams does ----------------------------------------------------------
    def _truncation(self, body: dict[str, Any]) -> int | None:
        limit: int = self.app.config.max_model_len
        truncate = body.get("truncate_prompt_tokens")
        if truncate is not None and truncate > limit:
            raise Rejected(f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = {limit}. "
                            "Please request a smaller truncation size.", "truncate_prompt_tokens")
        return limit if truncate == -1 else truncate

    def _checked(self, body: dict[str, Any], tokens: int) -> int:
        limit: int = self.app.config.max_model_len
        if body.get("padding") == "max_length":
            tokens = max(tokens, limit)
        if tokens > limit:
            qualifier = "at least " if tokens == limit + 1 else ""
            raise Rejected(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                            f"{qualifier}{tokens} input tokens, which exceeds this limit even without any output "
                            "tokens. Please reduce the length of the input prompt.", "input_tokens")
        return tokens

    def _tokens(self, encode: Any, body: dict[str, Any], text: str, add_special_tokens: bool) -> int:
        truncate = self._truncation(body)
        max_length = truncate if truncate is not None else self.app.config.max_model_len + 1
        return self._checked(body, len(encode(text, add_special_tokens, max_length=max_length)))

    def _ids(self, body: dict[str, Any], ids: list[int]) -> int:
        truncate = self._truncation(body)
        return self._checked(body, len(ids) if truncate is None else min(len(ids), truncate))

    def _chat_tokens(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> int:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.update(add_generation_prompt=bool(body.get("add_generation_prompt", False)),
                      continue_final_message=bool(body.get("continue_final_message", False)))
        text = self.app.counter.chat_text(conversation, None, kwargs)
        return self._tokens(self.app.counter.encode, body, text, bool(body.get("add_special_tokens", False)))

    def _pair_tokens(self, body: dict[str, Any], first: str, second: str) -> int:
        tokenizer = self.app.counter.tokenizer
        first = _cut(tokenizer, first, int(body.get("max_tokens_per_query") or 0))
        second = _cut(tokenizer, second, int(body.get("max_tokens_per_doc") or 0))
        truncate = self._truncation(body)
        max_length = truncate if truncate is not None else self.app.config.max_model_len + 1
        if tokenizer is None:
            ids = self.app.counter.encode(first, True) + self.app.counter.encode(second, False)
            return self._checked(body, min(len(ids), max_length))
        encoded = tokenizer(text=first, text_pair=second, truncation=True, max_length=max_length)
        return self._checked(body, len(encoded["input_ids"]))


def _cut(tokenizer: Any, text: str, max_tokens: int) -> str:
    """vLLM's ``truncate_text_to_tokens``: the text up to its ``max_tokens``-th token (0: all of it)."""
    if max_tokens <= 0 or tokenizer is None:
        return text
    while text:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        if len(encoding["input_ids"]) <= max_tokens:
            break
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[: min(end, len(text) - 1)]
    return text


# -- the Responses API's shapes ------------------------------------------------------------------------
def _messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``construct_input_messages`` without stored history."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    converted: list[dict[str, Any]] = []
    for item in items:
        prev = converted[-1] if converted and converted[-1].get("role") == "assistant" else None
        kind = item.get("type")
        message: dict[str, Any] | None
        if kind in ("function_call", "custom_tool_call"):
            name = item["name"] if not item.get("namespace") else f"{item['namespace']}__{item['name']}"
            arguments = item.get("arguments") if kind == "function_call" else \
                json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
            call = {"id": item["call_id"], "function": {"name": name, "arguments": arguments}, "type": "function"}
            if prev is not None:
                prev["tool_calls"] = [*(prev.get("tool_calls") or []), call]
                message = None
            else:
                message = {"role": "assistant", "tool_calls": [call]}
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or [{"text": ""}]
            message = {"role": "assistant", "reasoning": parts[0]["text"]}
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"], message = message["reasoning"], None
        elif kind in ("function_call_output", "custom_tool_call_output"):
            message = {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
        elif item.get("role") == "assistant":
            content = item["content"]
            message = {"role": "assistant", "content": content if isinstance(content, str) else content[0]["text"]}
            if prev is not None and prev.get("content") is None:
                prev["content"], message = message["content"], None
        else:
            message = item
        if message is not None:
            converted.append(message)
    return out + converted


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """vLLM's ``construct_tool_dicts`` as chat tools (the simulator's ``normalise_tool`` takes it from there)."""
    if not tools:
        return None
    out = []
    for tool in tools:
        members = [tool] if tool["type"] in ("function", "custom") else [
            {**m, "name": f"{tool['name']}__{m['name']}"} for m in tool.get("tools", []) if m.get("type") == "function"
        ] if tool["type"] == "namespace" else []
        for m in members:
            params = _CUSTOM_TOOL_PARAMETERS if m["type"] == "custom" else m.get("parameters")
            function = {"name": m["name"], "description": m.get("description"), "parameters": params}
            if m.get("strict") is not None and m["type"] == "function":
                function["strict"] = m["strict"]
            out.append({"type": "function", "function": function})
    return out


class _ResponseShape:
    """One response object and its stream events, as vLLM's ``ResponsesResponse`` serialises them."""

    def __init__(self, body: dict[str, Any], model: str, prompt: int, max_tokens: int) -> None:
        self.body, self.model, self.prompt, self.max_tokens = body, model, prompt, max_tokens
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    def response(self, generated: int | None, finish: str | None, seq: Sequence | None = None) -> dict[str, Any]:
        done = generated is not None
        status = "in_progress" if not done else "incomplete" if finish == "length" else "completed"
        output = [self.message(token_text(0, generated or 0), "completed")] if done else []
        usage = None
        if done:
            # vLLM reports the prefill stats here whether or not --enable-prompt-tokens-details is set.
            cached, written = (seq.cached_tokens or 0, seq.created_cache_tokens or 0) if seq else (0, 0)
            usage = {"input_tokens": self.prompt,
                     "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written,
                                              "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                     "output_tokens": generated,
                     "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                               "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                     "total_tokens": self.prompt + (generated or 0)}
        return {"id": self.id, "created_at": self.created,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": self.body.get("instructions"), "metadata": self.body.get("metadata"),
                "model": self.model, "object": "response", "output": output, "parallel_tool_calls": True,
                "temperature": 1.0, "tool_choice": self.body.get("tool_choice", "auto"),
                "tools": self.body.get("tools") or [], "top_p": 1.0, "background": False,
                "max_output_tokens": self.max_tokens, "max_tool_calls": None, "previous_response_id": None,
                "prompt": None, "reasoning": None, "service_tier": "auto", "status": status, "text": None,
                "top_logprobs": None, "truncation": "disabled", "usage": usage, "user": None}

    def message(self, text: str, status: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = (
            [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}] if text else [])
        return {"id": self.item_id, "content": content, "role": "assistant", "status": status, "type": "message"}

    def event(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def opening(self) -> bytes:
        initial = self.response(None, None)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self.event("response.created", response=initial) + self.event("response.in_progress",
                                                                                 response=initial)
                + self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
                + self.event("response.content_part.added", part=part, **self._at()))

    def delta(self, text: str) -> bytes:
        return self.event("response.output_text.delta", delta=text, logprobs=[], **self._at())

    def closing(self, generated: int, finish: str, seq: Sequence) -> bytes:
        text = token_text(0, generated)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return (self.event("response.output_text.done", text=text, logprobs=[], **self._at())
                + self.event("response.content_part.done", part=part, **self._at())
                + self.event("response.output_item.done", output_index=0, item=self.message(text, "completed"))
                + self.event("response.completed", response=self.response(generated, finish, seq)))


# -- the pooling routes' shapes --------------------------------------------------------------------------
def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _pooling_body(kind: str, model: str, counts: list[int]) -> dict[str, Any]:
    vectors = [[round((n % 97) / 97, 6), 0.5, -0.25, 0.125] for n in counts]
    data: list[dict[str, Any]]
    if kind == "embeddings":
        data = [{"index": i, "object": "embedding", "embedding": v} for i, v in enumerate(vectors)]
    elif kind == "pooling":
        data = [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(vectors)]
    else:
        data = [{"index": i, "label": "LABEL_0", "probs": [0.75, 0.25], "num_classes": 2} for i in range(len(counts))]
    prefix = {"embeddings": "embd", "pooling": "pool", "classify": "classify"}[kind]
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(sum(counts))}


def _is_conversation(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in v)


def _is_batch(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_conversation(c) for c in v)
