"""A vLLM 0.32 (V1) simulator: its OpenAI API, error texts, metrics and KV-block behaviour, without a model.

Integration tests and benchmarks put it where a real vLLM would be:

    with run_sim_server(SimConfig(num_blocks=64, token_delay=0.01)) as server:
        ...  # server.url, server.sim.preemptions_total, server.sim.config.fault = Fault.HANG

``async with run_sim_server(...)`` serves on the running loop instead of a thread, and
``create_sim_app(config)`` gives the bare ASGI app (``app.state.sim`` is the engine) for
``httpx.ASGITransport``. The engine is in engine.py, prompt rendering in text.py, and
``SimConfig.data_parallel_size`` engines behind one server (``X-data-parallel-rank``) in dp.py.
Texts and shapes follow vLLM's own source (entrypoints/openai, renderers/params.py, v1/metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

import orjson
import uvicorn
from pydantic import TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .dp import RANK_HEADER, DataParallelSimulator, RankOutOfRange, requested_rank
from .engine import VLLM_VERSION, Fault, SimConfig, Simulator
from .handling import Rejected, Run, asgi, until_disconnect
from .metrics import admission_rejections
from .routes import SimRoutes
from .text import ChatTemplateError, PromptCounter, chat_template_kwargs
from .types import lognormal_lengths
from .wire import (
    ChatBody,
    CompletionBody,
    Plan,
    SseWriter,
    StreamOptions,
    clean_loc,
    format_error,
    full_body,
)

__all__ = ["DataParallelSimulator", "Fault", "SimConfig", "SimServer", "Simulator", "create_sim_app",
           "lognormal_lengths", "run_sim_server"]

AUTH_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
MAX_N = 1024  # envs.VLLM_MAX_N_SEQUENCES
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
_INT: TypeAdapter[int] = TypeAdapter(int)  # how vLLM's request models read an int field



def _drop_connection(scope: Scope) -> None:
    """Close the client's TCP connection with a reset, as a crashed or unplugged server would."""
    transport = getattr(getattr(scope.get("sim.raw_send"), "__self__", None), "transport", None)
    if transport is None:
        # No socket (in-process transport): the closest thing is a transport-level exception.
        raise ConnectionResetError("simulated connection reset")
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _SimApp:
    """The HTTP side: routes, validation, responses, faults."""

    def __init__(self, sim: Simulator | DataParallelSimulator) -> None:
        self.sim = sim
        self.config = sim.config
        self.counter = PromptCounter(sim.config.tokenizer)
        self.admission_rejections = admission_rejections(sim._registry, sim.config.model)

    # -- errors ---------------------------------------------------------------------------------------

    def error(self, message: str, err_type: str = "BadRequestError", status: int = 400,
              param: str | None = None) -> JSONResponse:
        if self.config.error_style == "flat":
            body: dict[str, Any] = {"object": "error", "message": message, "type": err_type, "param": param,
                                    "code": status}
        else:
            body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
        return JSONResponse(body, status_code=status)

    def validation_error(self, errors: list[Any], param: str | None = None) -> JSONResponse:
        """FastAPI's RequestValidationError as vLLM's handler words it (400, type "Bad Request")."""
        if param is None and errors and isinstance(errors[0], dict) and errors[0].get("loc"):
            param = clean_loc(errors[0]["loc"])
        label = "error" if len(errors) == 1 else "errors"
        message = f"{len(errors)} validation {label}:\n" + "".join(f"  {format_error(e)}\n" for e in errors[:10])
        if len(errors) > 10:
            message += f"  ...and {len(errors) - 10} more {label}\n"
        return self.error(message.rstrip(), "Bad Request", 400, param)

    async def read_json(self, request: Request) -> dict[str, Any] | JSONResponse:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return self.validation_error(["Unsupported Media Type: Only 'application/json' is allowed"])
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            try:
                json.loads(raw)
                position, reason = 0, "Invalid JSON"
            except json.JSONDecodeError as exc:
                position, reason = exc.pos, exc.msg
            return self.validation_error([{"type": "json_invalid", "loc": ("body", position),
                                           "msg": "JSON decode error", "input": {}, "ctx": {"error": reason}}])
        if not isinstance(body, dict):
            return self.validation_error([{"type": "model_attributes_type", "loc": ("body",),
                                           "msg": "Input should be a valid dictionary or object to extract "
                                                  "fields from", "input": body}])
        return body

    # -- generation -----------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        body = await self.read_json(request)
        if isinstance(body, JSONResponse):
            return body
        request_index = self.sim.record_request(body, request.headers.get(RANK_HEADER))
        fault = self.config.fault
        if fault is not None and fault is not Fault.DIE_MID_STREAM:
            faulted = await self._fault(request, fault, bool(body.get("stream")))
            if faulted is not None:
                return faulted
        try:
            plan = self._plan_chat(body, request) if chat else self._plan_completion(body, request)
        except ValidationError as exc:
            errors = [dict(e, loc=("body", *e["loc"])) for e in exc.errors(include_url=False)]
            return self.validation_error(errors)
        except Rejected as exc:
            if exc.in_validator:
                return self.validation_error([{"type": "value_error", "loc": ("body",),
                                               "msg": f"Value error, {exc.message}", "input": body,
                                               "ctx": {"error": exc.message}}], exc.param)
            return self.error(exc.message, exc.err_type, exc.status, exc.param)
        try:
            # The input processor checks the rank last, once the request was rendered and validated.
            rank = requested_rank(request.headers.get(RANK_HEADER), self.config.data_parallel_size)
        except RankOutOfRange as exc:
            return self._engine_refusal(str(exc), plan.stream)
        if (refused := self._queue_cap(len(plan.prompts) * plan.n)) is not None:
            return refused
        run = Run(len(plan.prompts) * plan.n, plan.stream)
        if max(plan.prompts) >= self.sim.capacity_tokens:
            # Only reachable with a cache smaller than max_model_len, which vLLM refuses at start-up.
            return self.error(f"The prompt ({max(plan.prompts)} tokens) does not fit into the KV cache "
                              f"({self.sim.capacity_tokens} tokens).", param="input_tokens")
        for i, (ids, max_tokens) in enumerate(zip(plan.prompt_ids, plan.max_tokens, strict=True)):
            targets = [self.sim.output_length(request_index, max_tokens, plan.ignore_eos, plan.min_tokens,
                                              plan.eos_bias, choice) for choice in range(plan.n)]
            run.seqs += self.sim.submit(ids, plan.n, max_tokens, targets, run.on_token, first_index=i * plan.n,
                                        lora=plan.lora, cache_salt=plan.cache_salt, rank=rank)
        scope = request.scope
        if plan.stream:
            return asgi(lambda receive, send: self._stream(scope, receive, send, plan, run))
        if run.remaining == 0:
            # orjson rather than JSONResponse's json.dumps: this is the benchmark's hot path.
            return Response(orjson.dumps(full_body(plan, run.seqs, plan.model)), media_type="application/json")
        return asgi(lambda receive, send: self._respond_when_done(receive, send, plan, run))

    def _queue_cap(self, n: int) -> Response | None:
        """vLLM's --max-num-queued-reqs (AsyncLLM.check_admission, before a stream starts): 503 when the
        unfinished requests and these ``n`` would pass it, counted in vllm:admission_rejections_total."""
        cap = self.config.max_num_queued_reqs
        if cap is None or self.sim.running + self.sim.waiting + n <= cap:
            return None
        if self.admission_rejections is not None:
            self.admission_rejections.labels(self.config.model, "max_num_queued_reqs").inc()
        return self.error("The engine is currently busy and cannot accept new requests. Please try again later "
                          "or on a different instance.", "Service Unavailable", 503)

    def _engine_refusal(self, message: str, stream: bool) -> Response:
        """An error the engine client raises while the response is produced: a 400, or once vLLM has begun a
        stream, one error event and ``[DONE]`` after a 200."""
        if not stream:
            return self.error(message)
        event = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})
        return Response(f"data: {event}\n\ndata: [DONE]\n\n".encode(), media_type="text/event-stream")

    def check_model(self, model: str | None) -> None:
        if model and model != self.config.model and model not in self.config.lora_modules:
            raise Rejected(f"The model `{model}` does not exist. Valid aliases: {self.config.model}.",
                            "model", "NotFoundError", 404)

    @staticmethod
    def _check_cache_salt(body: dict[str, Any]) -> None:
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise Rejected("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt",
                            in_validator=True)
        if salt is not None and (len(salt) > 128 or any(c in "@/\\\x00" for c in salt)):
            raise Rejected("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', "
                            "'/', '\\\\', or NUL.", "cache_salt", in_validator=True)

    def kv_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        """``Plan`` fields beyond the prompts: what keys its KV blocks (its LoRA adapter and cache salt), the
        model name responses carry, whether usage has details, the stream's interval and the fingerprint. Call
        after the checks."""
        salt = body.get("cache_salt")
        model = body.get("model")
        lora = (model, self.config.lora_modules[model]) if model in self.config.lora_modules else None
        interval = body.get("stream_interval")  # validated by the request's model
        return {"lora": lora, "cache_salt": salt, "model": model if lora else self.config.model,
                "prompt_details": self.config.enable_prompt_tokens_details,
                "stream_interval": max(interval if isinstance(interval, int) else 1, self.config.stream_interval),
                "fingerprint": self.config.system_fingerprint}

    def _length_asks(self, body: dict[str, Any], max_tokens: list[int]) -> dict[str, Any]:
        """``Plan`` fields for the sampler's say on the length: ``min_tokens`` (checked as vLLM's
        SamplingParams does, against the clamped max_tokens) and the ``logit_bias`` on EOS (clamped to
        +-100 as vLLM does). Values of other types are left to the gateway's tests of pass-through."""
        try:  # vLLM's model reads it as pydantic's int does ("12" and 12.0 are 12)
            min_tokens = _INT.validate_python(body.get("min_tokens") or 0)
        except ValidationError:
            min_tokens = 0
        if min_tokens < 0:
            raise Rejected(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
        if min_tokens > min(max_tokens):
            raise Rejected(f"min_tokens must be less than or equal to max_tokens={min(max_tokens)}, "
                            f"got {min_tokens}.")
        bias = body.get("logit_bias")
        eos = self.counter.eos_token_id
        value = bias.get(str(eos)) if isinstance(bias, dict) else None
        eos_bias = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
        return {"min_tokens": min_tokens, "eos_bias": min(100.0, max(-100.0, eos_bias))}

    def _check_n(self, n: int) -> None:
        if n < 1:
            raise Rejected(f"n must be at least 1, got {n}.")
        if n > MAX_N:
            raise Rejected(f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
                            "VLLM_MAX_N_SEQUENCES environment variable.")

    def _check_output_limit(self, requested: int | None, param: str) -> None:
        limit = self.config.max_model_len
        if requested is not None and requested > limit and not self.config.reject_prompt_plus_max_tokens:
            raise Rejected(f"{param}={requested} cannot be greater than max_model_len={limit}. "
                            "Please request fewer output tokens.", param)

    def prompt_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        limit = self.config.max_model_len
        per_token = self.counter.max_chars_per_token
        if per_token is not None and len(text) > limit * per_token:
            raise Rejected(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(text)} characters (more than {limit * per_token} characters, which is the upper bound "
                f"for {limit} input tokens). Please reduce the length of the input prompt.", "input_text")
        # vLLM stops tokenizing one token past the limit, so an over-long prompt reads "at least L+1".
        return self.counter.encode(text, add_special_tokens, max_length=limit + 1)

    def _max_tokens(self, prompt: int, requested: int | None) -> int:
        limit = self.config.max_model_len
        if self.config.reject_prompt_plus_max_tokens:
            # vLLM 0.10-0.31 (serving_engine._validate_input): rejected, never clamped.
            if requested is None and prompt >= limit:
                raise Rejected(f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt} tokens in the messages, Please reduce the length of the messages.")
            if requested is not None and prompt + requested > limit:
                raise Rejected(f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt + requested} tokens ({prompt} in the messages, {requested} in the "
                                "completion). Please reduce the length of the messages or completion.")
        elif prompt > limit:
            qualifier = "at least " if prompt == limit + 1 else ""
            raise Rejected(f"This model's maximum context length is {limit} tokens. However, your prompt "
                            f"contains {qualifier}{prompt} input tokens, which exceeds this limit even without "
                            "any output tokens. Please reduce the length of the input prompt.", "input_tokens")
        max_tokens = limit - prompt if requested is None else min(limit - prompt, requested)
        if max_tokens < 1:
            raise Rejected(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        return max_tokens

    @staticmethod
    def _check_stream_options(body: dict[str, Any]) -> None:
        if body.get("stream_options") and not body.get("stream"):
            raise Rejected("Stream options can only be defined when `stream=True`.", "stream_options",
                            in_validator=True)

    @staticmethod
    def _usage_flags(options: StreamOptions | None) -> tuple[bool, bool]:
        if options is None:
            return False, False
        include = bool(options.include_usage)
        return include, include and bool(options.continuous_usage_stats)

    def _request_id(self, request: Request, prefix: str) -> str:
        return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"

    def _plan_chat(self, body: dict[str, Any], request: Request) -> Plan:
        if body.get("tools") == []:
            raise Rejected("`tools` must not be an empty array. Either provide at least one tool or omit the "
                            "field entirely.", "tools", in_validator=True)
        tool_choice = body.get("tool_choice", "auto" if body.get("tools") else "none")
        if tool_choice not in (None, "none") and body.get("tools") is None:
            raise Rejected("When using `tool_choice`, `tools` must be set.", "tool_choice", in_validator=True)
        self._check_stream_options(body)
        self._check_cache_salt(body)
        # vLLM reads the raw body here: an omitted add_generation_prompt does not conflict (yet).
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise Rejected("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                            in_validator=True)
        req = ChatBody.model_validate(body)
        for i, message in enumerate(req.messages):
            if not isinstance(message.get("role"), str):
                raise ValidationError.from_exception_data("ChatCompletionRequest", [
                    {"type": "missing", "loc": ("messages", i, "role"), "input": message}])
        include_usage, continuous = self._usage_flags(req.stream_options)
        self.check_model(req.model)
        n = 1 if req.n is None else req.n
        self._check_n(n)
        if tool_choice not in (None, "none") and not self.config.enable_auto_tool_choice:
            if tool_choice == "auto":
                raise Rejected('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                "to be set")
            described = (f'function "{tool_choice.get("function", {}).get("name")}"'
                         if isinstance(tool_choice, dict) else f'"{tool_choice}"')
            raise Rejected(f"tool_choice={described} requires --tool-call-parser to be set")
        param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        requested = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        self._check_output_limit(requested, param)
        try:
            text = self.counter.chat_text(req.messages, req.tools, chat_template_kwargs(body))
        except ChatTemplateError as exc:
            raise Rejected(str(exc)) from exc
        ids = self.prompt_ids(text, req.add_special_tokens)
        role = "assistant" if req.add_generation_prompt else str(req.messages[-1]["role"])
        max_tokens = [self._max_tokens(len(ids), requested)]
        return Plan(True, self._request_id(request, "chatcmpl"), [len(ids)], max_tokens, n, bool(req.stream),
                    include_usage, continuous, req.ignore_eos, role, [ids], **self.kv_keys(body),
                    **self._length_asks(body, max_tokens))

    def _plan_completion(self, body: dict[str, Any], request: Request) -> Plan:
        if body.get("prompt") in (None, ""):
            raise Rejected("Either prompt or prompt_embeds must be provided and non-empty.", "prompt",
                            in_validator=True)
        self._check_stream_options(body)
        self._check_cache_salt(body)
        req = CompletionBody.model_validate(body)
        include_usage, continuous = self._usage_flags(req.stream_options)
        self.check_model(req.model)
        self._check_n(req.n)
        prompt = req.prompt
        if prompt is None or len(prompt) == 0:
            raise Rejected("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        self._check_output_limit(req.max_tokens, "max_tokens")
        prompts: list[list[int]] = []
        if isinstance(prompt, str):
            prompts.append(self.prompt_ids(prompt, req.add_special_tokens))
        else:
            for item in prompt:
                if isinstance(item, str):
                    prompts.append(self.prompt_ids(item, req.add_special_tokens))
                elif isinstance(item, int):
                    prompts = [cast(list[int], prompt)]
                    break
                else:
                    prompts.append(item)
        counts = [len(ids) for ids in prompts]
        limits = [self._max_tokens(count, req.max_tokens) for count in counts]
        return Plan(False, self._request_id(request, "cmpl"), counts, limits, req.n, bool(req.stream),
                    include_usage, continuous, req.ignore_eos, prompt_ids=prompts, **self.kv_keys(body),
                    **self._length_asks(body, limits))

    # -- answering ------------------------------------------------------------------------------------

    async def _respond_when_done(self, receive: Receive, send: Send, plan: Plan, run: Run) -> None:
        gone = asyncio.ensure_future(until_disconnect(receive))
        done = asyncio.ensure_future(run.finished.wait())
        try:
            await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            done.cancel()
        if not run.finished.is_set():
            self.sim.abort(run.seqs)
            return
        body = orjson.dumps(full_body(plan, run.seqs, plan.model))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, scope: Scope, receive: Receive, send: Send, plan: Plan, run: Run) -> None:
        assert run.events is not None
        events = run.events
        die_after = self.config.fault_after_chunks if self.config.fault is Fault.DIE_MID_STREAM else None

        async def watch() -> None:
            await until_disconnect(receive)
            events.put_nowait((None, 0, None))

        watcher = asyncio.ensure_future(watch())
        writer = SseWriter(plan, plan.model, int(time.time()), len(plan.prompts) * plan.n)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            pending = len(run.seqs)
            while pending:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                chunks: list[bytes] = []
                for seq, generated, finish in batch:
                    if seq is None:
                        return  # the client went away; finally aborts what still runs
                    chunks += writer.token_chunks(seq.index, generated, finish)
                    pending -= finish is not None
                if die_after is not None and writer.sent + len(chunks) > die_after:
                    for chunk in chunks[: max(0, die_after - writer.sent)]:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    _drop_connection(scope)
                    return
                writer.sent += len(chunks)
                await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
            tail = writer.usage_chunk(run.first) if plan.include_usage else b""
            await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
        finally:
            watcher.cancel()
            if run.remaining:
                self.sim.abort(run.seqs)

    # -- faults ---------------------------------------------------------------------------------------

    async def _fault(self, request: Request, fault: Fault, stream: bool) -> Response | None:
        if fault is Fault.SLOW_FIRST_BYTE:
            await asyncio.sleep(self.config.fault_delay)
            return None
        if fault is Fault.ERROR_500:
            return self.error("Simulated internal server error.", "InternalServerError", 500)
        if fault is Fault.ENGINE_DEAD:
            return self.error(ENGINE_DEAD_MESSAGE, "InternalServerError", 500)
        if fault is Fault.GARBAGE:
            if stream:
                return Response(b"data: {\"id\": \"chatcmpl-garbage\", \"choices\": [{\n\n",
                                media_type="text/event-stream")
            return Response(b"<html>upstream garbage {{{", media_type="application/json")
        scope = request.scope

        async def hang_or_reset(receive: Receive, send: Send) -> None:
            if fault is Fault.RESET:
                _drop_connection(scope)
                return
            await until_disconnect(receive)

        return asgi(hang_or_reset)

    # -- the other endpoints --------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": now,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        card = {"id": self.config.model, "object": "model", "created": now, "owned_by": "vllm",
                "root": self.config.root or self.config.model, "parent": None,
                "max_model_len": self.config.max_model_len, "permission": [permission]}
        adapters = [{**card, "id": name, "root": path, "parent": self.config.model, "max_model_len": None}
                    for name, path in self.config.lora_modules.items()]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    async def tokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            self.check_model(body.get("model"))
            if "messages" in body:
                if body.get("continue_final_message") and body.get("add_generation_prompt"):
                    raise Rejected("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
                text = self.counter.chat_text(body["messages"], body.get("tools"), chat_template_kwargs(body))
                ids = self.counter.encode(text, bool(body.get("add_special_tokens", False)))
            elif isinstance(body.get("prompt"), str):
                ids = self.counter.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                raise Rejected("Either `prompt` (a string) or `messages` must be given.", "prompt")
        except ChatTemplateError as exc:
            return self.error(str(exc))
        except Rejected as exc:
            return self.error(exc.message, exc.err_type, exc.status, exc.param)
        return JSONResponse({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                             "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        if isinstance(body, JSONResponse):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            return self.validation_error([{"type": "list_type", "loc": ("body", "tokens"),
                                           "msg": "Input should be a valid list of non-negative integers",
                                           "input": tokens}])
        return JSONResponse({"prompt": self.counter.decode(tokens)})

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.config.fault is Fault.ENGINE_DEAD else 200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def metrics(self, request: Request) -> Response:
        if self.config.metrics_delay:
            await asyncio.sleep(self.config.metrics_delay)
        if self.config.metrics_status is not None:
            return Response(status_code=self.config.metrics_status)
        return Response(self.sim.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")


class _Guard:
    """Outermost ASGI layer: vLLM's --api-key check, and the raw ``send`` kept for connection faults."""

    def __init__(self, app: Starlette, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope["sim.raw_send"] = send
            if (self.api_key is not None and scope.get("method") != "OPTIONS"
                    and scope["path"].startswith(AUTH_PREFIXES) and not self._authorized(scope)):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return bool(scheme.lower() == "bearer" and token == self.api_key)
        return False


def create_sim_app(config: SimConfig) -> Any:
    """The simulator's ASGI app; ``app.state.sim`` is its :class:`Simulator`, or with ``data_parallel_size`` over
    1 its :class:`DataParallelSimulator`."""
    sim = Simulator(config) if config.data_parallel_size == 1 else DataParallelSimulator(config)
    handlers = _SimApp(sim)
    more = SimRoutes(handlers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return handlers.error(exc.detail, _phrase(exc.status_code), exc.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await sim.aclose()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", handlers.chat, methods=["POST"]),
            Route("/v1/completions", handlers.completions, methods=["POST"]),
            Route("/v1/responses", more.responses, methods=["POST"]),
            Route("/v1/embeddings", more.embeddings, methods=["POST"]),
            Route("/pooling", more.pooling, methods=["POST"]),
            Route("/classify", more.classify, methods=["POST"]),
            *(Route(path, more.score, methods=["POST"]) for path in ("/score", "/v1/score")),
            *(Route(path, more.rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
            Route("/v1/models", handlers.models, methods=["GET"]),
            Route("/tokenize", handlers.tokenize, methods=["POST"]),
            Route("/detokenize", handlers.detokenize, methods=["POST"]),
            Route("/health", handlers.health, methods=["GET"]),
            Route("/version", handlers.version, methods=["GET"]),
            Route("/metrics", handlers.metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.sim = sim
    return _Guard(app, config.api_key)


def _phrase(status: int) -> str:
    from http import HTTPStatus

    return HTTPStatus(status).phrase


@dataclass
class SimServer:
    url: str
    sim: Simulator | DataParallelSimulator


class run_sim_server:
    """Serve a simulator on 127.0.0.1:<free port> with uvicorn.

    ``with run_sim_server(config) as server`` runs it in a background thread (its own event loop);
    ``async with run_sim_server(config) as server`` runs it on the caller's loop. Both shut down cleanly.
    """

    def __init__(self, config: SimConfig, *, start_timeout: float = 10.0) -> None:
        self.config = config
        self.start_timeout = start_timeout
        self.app = create_sim_app(config)
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without
        # it every response waits ~40 ms for a delayed ACK.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                                     loop="asyncio", timeout_graceful_shutdown=1))
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """Where it will answer, known before it starts (its port is bound at once; connections are refused
        until it serves)."""
        return self._handle().url

    def _handle(self) -> SimServer:
        port = self._sock.getsockname()[1]
        return SimServer(url=f"http://127.0.0.1:{port}", sim=self.app.state.sim)

    def __enter__(self) -> SimServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])),
                                        name="vllm-sim", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._sock.close()
                raise RuntimeError("the vLLM simulator did not start")
            time.sleep(0.002)
        return self._handle()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(self.start_timeout)
        self._sock.close()

    async def __aenter__(self) -> SimServer:
        self._task = asyncio.ensure_future(self._server._serve(sockets=[self._sock]))
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if self._task.done() or time.monotonic() > deadline:
                self._sock.close()
                raise RuntimeError("the vLLM simulator did not start")
            await asyncio.sleep(0.002)
        return self._handle()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._sock.close()

