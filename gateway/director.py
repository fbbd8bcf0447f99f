"""The request path, stage by stage.

``guarded`` is the whole life of a chat or completion request:
read -> parse -> count -> prompt policy -> max_tokens policy -> KV fit -> admit (queue) -> forward or
stream -> release. Every stage raises ``GatewayError``; errors.py turns them into responses. The KV
reservation is released exactly once whatever happens: normal end, upstream failure, client disconnect
(while queued, waiting for the upstream, or mid-stream), timeout, cancellation.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from .admission import Admission, Reservation
from .config import PromptOverflowPolicy, Settings
from .engine import EngineView
from .errors import (
    AuthenticationFailed,
    BadUpstreamResponse,
    GatewayError,
    InvalidRequest,
    PayloadTooLarge,
    UpstreamError,
    UpstreamUnavailable,
    error_response,
    sse_error_event,
    upstream_error_from,
)
from .limits import Limits, decide_max_tokens, decide_prompt, effective_max_model_len
from .metrics import Metrics
from .models import Models, parse_models
from .protocol import (
    GuardedRequest,
    Prompt,
    decode_json,
    parse_chat,
    parse_completion,
    set_max_tokens,
    set_prompts,
)
from .upstream import Upstream, UpstreamStream, response_headers
from .vllm_log import engine_death_reply

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class EngineState(Protocol):
    """What the request path needs of a managed engine (the supervisor)."""

    state: str

    def retry_after(self) -> float: ...

    async def failure_noticed(self) -> bool: ...


@dataclass(slots=True)
class Parts:
    settings: Settings
    metrics: Metrics
    upstream: Upstream
    models: Models
    admission: Admission
    supervisor: EngineState | None = None
    engine: EngineView | None = None


@dataclass(slots=True)
class Outcome:
    """What the gateway did to a request, reported in x-guard-* headers."""

    request_id: str
    prompt_tokens: int = 0
    max_tokens: int = 0
    truncated_tokens: int = 0
    queue_ms: float = 0.0

    def headers(self) -> dict[str, str]:
        h = {
            "x-request-id": self.request_id,
            "x-guard-prompt-tokens": str(self.prompt_tokens),
            "x-guard-max-tokens": str(self.max_tokens),
            "x-guard-queue-ms": f"{self.queue_ms:.1f}",
        }
        if self.truncated_tokens:
            h["x-guard-truncated-tokens"] = str(self.truncated_tokens)
        return h


# -- the request path -----------------------------------------------------------------------------
async def guarded(parts: Parts, request: Request, route: str) -> Response:
    s, metrics = parts.settings, parts.metrics
    out = Outcome(request_id(request))
    watcher = DisconnectWatcher(request)
    try:
        key = authenticate(parts, request)
        raw = await read_body(request, s.max_body_bytes)
        req = parse_chat(decode_json(raw)) if route == "chat" else parse_completion(decode_json(raw))
        refuse_while_starting(parts)
        watcher.start()
        try:
            info = await parts.models.info()
            parts.models.check_model(req.model, info)
            limit = effective_max_model_len(info.max_model_len, s.max_model_len)
            if limit is None:
                raise UpstreamUnavailable("The upstream does not report max_model_len yet.", retry_after=5)
            limits = Limits(limit, s.max_prompt_tokens, s.max_output_tokens, s.min_output_tokens)

            counts = await count(parts, req)
            counts = await apply_prompt_policy(parts, req, counts, limits, prompt_policy(request, s), out)
            out.prompt_tokens = sum(counts)

            decision = decide_max_tokens(max(counts), req.max_tokens, limits, s.on_max_tokens_overflow)
            sequences = req.n * len(counts)
            # Each sequence is charged for the longest prompt: an upper bound that stays tight.
            max_tokens = parts.admission.fit(
                max(counts), decision.max_tokens, sequences, clamp=s.on_max_tokens_overflow == "clamp"
            )
            metrics.record_max_tokens(route, max_tokens, decision.clamped or max_tokens != decision.max_tokens)
            set_max_tokens(req, max_tokens)
            out.max_tokens = max_tokens
            body = orjson.dumps(req.body)

            prio = priority(parts, request, key)
            for attempt in (1, 2):
                reservation = parts.admission.reservation(
                    prompt_tokens=max(counts), max_tokens=max_tokens, n=sequences, priority=prio,
                    request_id=out.request_id,
                )
                await reservation.__aenter__()  # may wait in the queue, or shed with 429/503
                relay_owns_it = False
                try:
                    out.queue_ms += reservation.queue_ms
                    try:
                        if not req.stream:
                            return await forward(parts, route, body, out, reservation)
                        stream = await open_upstream(parts, route, body, out.request_id)
                    except (UpstreamUnavailable, UpstreamError) as exc:
                        if not engine_failed(parts, exc):
                            raise
                        reservation.release(completed=False)
                        if attempt == 2:
                            raise engine_failure(parts) from exc
                        # The managed engine died under this request before anything reached the client:
                        # wait for the restart in the queue (admission is paused) and send it once more.
                        log.warning("request %s: the engine failed under it; retrying after the restart",
                                    out.request_id)
                        if parts.supervisor is not None:
                            # Until the supervisor has seen the death, a retry would hit the dead engine.
                            await parts.supervisor.failure_noticed()
                        continue
                    # From here the relay owns the reservation and the stream, and the streaming response
                    # watches the client itself.
                    watcher.stop()
                    relay_owns_it = True
                    return relay_stream(parts, route, stream, reservation, out)
                finally:
                    if not relay_owns_it:
                        reservation.release()
            raise AssertionError("unreachable: the second attempt returns or raises")
        finally:
            watcher.stop()
    except GatewayError as exc:
        if exc.reason is not None and (exc.status < 500 or exc.reason == "queue_timeout"):
            metrics.record_rejection(exc.reason)
        metrics.record_request(route, "rejected" if exc.status < 500 else "error")
        headers = out.headers() if out.prompt_tokens else {"x-request-id": out.request_id}
        return error_response(exc, headers)
    except asyncio.CancelledError:
        if not watcher.fired:
            raise
        _uncancel()
        metrics.record_request(route, "cancelled")
        log.info("request %s: the client went away; its upstream request was cancelled", out.request_id)
        return Response(status_code=499)
    except ClientDisconnect:
        # Gone while sending its body: nothing was reserved or sent upstream, and it is no error of ours.
        metrics.record_request(route, "cancelled")
        return Response(status_code=499)


async def count(parts: Parts, req: GuardedRequest) -> list[int]:
    counter = await parts.models.counter()
    t0 = time.perf_counter()
    if req.route == "chat":
        counts = [await counter.count_chat(req.body)]
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


async def open_upstream(parts: Parts, route: str, body: bytes, rid: str) -> UpstreamStream:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    parts.metrics.in_flight.inc()
    try:
        stream = await parts.upstream.open(
            "POST", path, body=body, headers={"content-type": "application/json", "x-request-id": rid}
        )
    except BaseException:
        parts.metrics.in_flight.dec()
        raise
    if stream.status != 200:
        try:
            payload = await stream.read_all()
        finally:
            stream.close()
            parts.metrics.in_flight.dec()
        raise upstream_error_from(stream.status, payload)
    return stream


async def forward(parts: Parts, route: str, body: bytes, out: Outcome, reservation: Reservation) -> Response:
    t0 = time.perf_counter()
    stream = await open_upstream(parts, route, body, out.request_id)
    try:
        payload = await stream.read_all()
    finally:
        stream.close()
        parts.metrics.in_flight.dec()
    parts.metrics.record_upstream_latency(route, time.perf_counter() - t0)
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BadUpstreamResponse("The upstream answered 200 with a body that is not JSON.") from exc
    usage = data.get("usage") if isinstance(data, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        parts.metrics.record_output_tokens(usage["completion_tokens"])
        # Teaches the adaptive policy how long outputs really are.
        reservation.observe_output_tokens(usage["completion_tokens"])
    parts.metrics.record_request(route, "ok")
    headers = out.headers()
    return Response(payload, status_code=200, media_type="application/json", headers=headers)


def relay_stream(
    parts: Parts, route: str, stream: UpstreamStream, reservation: Reservation, out: Outcome
) -> StreamingResponse:
    relay = StreamRelay(parts, route, stream, reservation)
    ctype = stream.headers.get("content-type", "")
    if not ctype.startswith("text/event-stream"):
        relay.finish("error")
        raise BadUpstreamResponse(f"The upstream answered a stream request with content-type {ctype!r}.")
    return RelayResponse(
        relay, media_type="text/event-stream",
        headers={**out.headers(), "cache-control": "no-cache", "x-accel-buffering": "no"},
    )


class StreamRelay:
    """One upstream stream relayed to one client. ``finish`` frees everything exactly once, whether the
    stream ended, broke, or never started (a client gone before the first byte)."""

    def __init__(self, parts: Parts, route: str, stream: UpstreamStream, reservation: Reservation) -> None:
        self.parts, self.route, self.stream, self.reservation = parts, route, stream, reservation
        self.t0 = time.perf_counter()
        self.done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        metrics = self.parts.metrics
        events = 0
        outcome = "cancelled"
        try:
            async for chunk in self.stream.chunks():
                if events == 0:
                    metrics.record_ttft(self.route, time.perf_counter() - self.t0)
                # One SSE event per generated token (vLLM streams each step): cheap progress for admission.
                events += chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
                self.reservation.observe_output_tokens(events)
                yield chunk
            outcome = "ok"
        except GatewayError as exc:
            outcome = "error"
            log.warning("stream cut by the upstream: %s", exc.message)
            yield sse_error_event(exc)
        finally:
            self.finish(outcome)

    def finish(self, outcome: str) -> None:
        # Synchronous on purpose: this also runs inside a cancelled task when the client went away.
        if self.done:
            return
        self.done = True
        self.stream.close()
        # A cut stream's short output must not teach admission that outputs are short.
        self.reservation.release(completed=outcome == "ok")
        metrics = self.parts.metrics
        metrics.in_flight.dec()
        metrics.record_upstream_latency(self.route, time.perf_counter() - self.t0)
        metrics.record_request(self.route, outcome)


class RelayResponse(StreamingResponse):
    def __init__(self, relay: StreamRelay, **kwargs: Any) -> None:
        super().__init__(relay.chunks(), **kwargs)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.relay.finish("cancelled")


# -- small stages ---------------------------------------------------------------------------------
def engine_failed(parts: Parts, exc: GatewayError) -> bool:
    """An upstream failure that a managed engine's restart will mend (not a client mistake)."""
    sup = parts.supervisor
    if sup is None or exc.status < 500:
        return False
    return sup.state != "ready" or isinstance(exc, UpstreamUnavailable) or engine_death_reply(exc.message)


def engine_failure(parts: Parts) -> UpstreamUnavailable:
    sup = parts.supervisor
    return UpstreamUnavailable(
        "The engine failed while serving this request and is being restarted; retry shortly.",
        code="upstream_restarting", retry_after=sup.retry_after() if sup is not None else 5,
    )



# Request ids: one random prefix per process plus a counter. uuid4() reads os.urandom, which was measured
# at ~0.5 ms a call under load in sandboxed machines: more than the whole rest of the request path.
_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count(1)


def request_id(request: Request) -> str:
    rid = request.headers.get("x-request-id")
    if rid is None or not _REQUEST_ID.match(rid):
        rid = f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"
    request.state.request_id = rid
    return rid


def authenticate(parts: Parts, request: Request, *, admin: bool = False) -> str | None:
    """The client's API key when keys are configured; 401 when it is missing or wrong."""
    s = parts.settings
    accepted = s.admin_api_key if admin else [*parts_keys(s), *s.admin_api_key]
    if not accepted and not admin:
        return None
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    if not token:
        raise AuthenticationFailed(
            "Missing API key: send 'Authorization: Bearer <key>'." if accepted or not admin
            else "This endpoint needs an admin key (--admin-api-key), and none is configured."
        )
    if token not in accepted:
        raise AuthenticationFailed("Incorrect API key provided.")
    return token


def parts_keys(s: Settings) -> list[str]:
    return list(s.key_priorities())


def priority(parts: Parts, request: Request, key: str | None) -> int:
    raw = request.headers.get("x-guard-priority")
    if raw is None:
        return parts.settings.key_priorities().get(key, 0) if key else 0
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest(f"x-guard-priority must be an integer; got {raw!r}.", param="x-guard-priority") from None


def prompt_policy(request: Request, s: Settings) -> PromptOverflowPolicy:
    raw = request.headers.get("x-guard-on-overflow")
    if raw is None:
        return s.on_prompt_overflow
    if raw not in ("reject", "truncate"):
        raise InvalidRequest(
            f"x-guard-on-overflow must be 'reject' or 'truncate'; got {raw!r}.", param="x-guard-on-overflow"
        )
    return "truncate" if raw == "truncate" else "reject"


def refuse_while_starting(parts: Parts) -> None:
    """While a managed engine starts or is down, answer 503 at once; during a restart requests queue."""
    sup = parts.supervisor
    if sup is not None and sup.state in ("starting", "down"):
        raise UpstreamUnavailable(
            f"The engine is {sup.state}; retry shortly.", code=f"upstream_{sup.state}",
            retry_after=sup.retry_after(),
        )


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is {int(declared)} bytes; the limit is {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


class DisconnectWatcher:
    """Cancels the handling task when the client disconnects before the response starts, so that a queued
    request leaves the queue and an upstream request is aborted (not left generating for nobody).
    Started only once the body is read: from then on, receive() returns only on disconnect."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.fired = False

    # Most requests are answered before this: they never pay for a watching task. A client that leaves sooner
    # is noticed this much later, which frees nothing later than the upstream's own answer would.
    GRACE = 0.05

    def start(self) -> None:
        target = asyncio.current_task()
        if target is None:
            return
        self._timer = asyncio.get_running_loop().call_later(self.GRACE, self._watch, target)

    def _watch(self, target: asyncio.Task[Response]) -> None:
        self._timer = None

        async def wait() -> None:
            message = await self._request.receive()
            if message["type"] == "http.disconnect" and self._task is not None:
                self.fired = True
                target.cancel()

        self._task = asyncio.get_running_loop().create_task(wait())

    def stop(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()



# -- the other routes -----------------------------------------------------------------------------
async def list_models(parts: Parts, request: Request) -> Response:
    rid = request_id(request)
    authenticate(parts, request)
    reply = await parts.upstream.request("GET", "/v1/models", timeout=10.0)
    if reply.status != 200:
        raise upstream_error_from(reply.status, reply.body)
    info = parse_models(reply.body)
    parts.models.update(info)
    limit = effective_max_model_len(info.max_model_len, parts.settings.max_model_len)
    return Response(
        parts.models.rewrite_listing(reply.body, limit), media_type="application/json",
        headers={"x-request-id": rid},
    )


async def passthrough(parts: Parts, request: Request, path: str) -> Response:
    """Any other /v1/* route, /tokenize and /detokenize: forwarded with auth, streamed back as it comes."""
    rid = request_id(request)
    authenticate(parts, request)
    try:
        body = await read_body(request, parts.settings.max_body_bytes)
    except ClientDisconnect:
        return Response(status_code=499)
    headers = {k: v for k, v in request.headers.items()}
    headers["x-request-id"] = rid
    stream = await parts.upstream.open(
        request.method, path, body=body or None, headers=headers, params=dict(request.query_params)
    )
    if stream.status >= 400 and stream.headers.get("content-type", "").startswith("application/json"):
        try:
            payload = await stream.read_all()
        finally:
            stream.close()
        raise upstream_error_from(stream.status, payload)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in stream.chunks():
                yield chunk
        finally:
            stream.close()

    return StreamingResponse(
        relay(), status_code=stream.status,
        headers={**response_headers(stream.headers), "x-request-id": rid},
    )
