"""The request path, stage by stage.

``guarded`` is the whole life of a request on a route where the engine counts tokens against the context:
read -> parse -> count -> prompt policy -> output policy -> KV fit -> admit (queue) -> forward or stream ->
release. Two families share it, each with its own parsing and counting (the tables below):

- generating (chat, completions, responses): prompts are counted as the engine renders them, truncated or
  rejected by the prompt policy, and ``max_tokens`` (``max_output_tokens``) is bounded and booked;
- pooling (embeddings, pooling, classify, score, rerank): each input is one engine prompt that must fit the
  context; only prompt blocks are booked, one sequence per prompt, and nothing is generated.

Every stage raises ``GatewayError``; errors.py turns them into responses. The KV reservation is released
exactly once whatever happens: normal end, upstream failure, client disconnect (while queued, waiting for
the upstream, or mid-stream), timeout, cancellation.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway import jsonio
from gateway.admission.controller import Admission
from gateway.config import PromptOverflowPolicy, Settings
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    KVBudgetExceeded,
    MaxTokensExceeded,
    UpstreamError,
    UpstreamUnavailable,
    error_response,
)
from gateway.guard import pooling, responses
from gateway.guard.parts import Outcome, Parts
from gateway.guard.policy import Limits, MaxTokensDecision, decide_max_tokens, decide_prompt, effective_max_model_len
from gateway.guard.pooling import PoolingRequest
from gateway.guard.protocol import (
    GuardedRequest,
    Prompt,
    decode_json,
    parse_chat,
    parse_completion,
    parse_responses,
    set_max_tokens,
    set_prompts,
)
from gateway.http.auth import authenticate
from gateway.http.body import BodyLimits, DisconnectWatcher, read_body
from gateway.http.relay import forward, open_upstream, relay_stream
from gateway.managed.vllm_log import engine_death_reply

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

# The routes' request parsers, by family (route names: routing.GUARDED_ROUTES).
GENERATING: dict[str, Callable[[dict[str, Any]], GuardedRequest]] = {
    "chat": parse_chat,
    "completions": parse_completion,
    "responses": parse_responses,
}
POOLING: dict[str, Callable[[dict[str, Any]], PoolingRequest]] = pooling.PARSERS


@dataclass(frozen=True, slots=True)
class Booking:
    """What a request reserves: ``n`` sequences of ``prompt_tokens`` + ``max_tokens`` tokens each.

    ``learns_output``: whether its output length teaches the adaptive policy (a pooling request has none).
    """

    prompt_tokens: int
    max_tokens: int
    n: int
    stream: bool = False
    learns_output: bool = True


# -- the request path -----------------------------------------------------------------------------
async def guarded(parts: Parts, request: Request, route: str, path: str) -> Response:
    """``route`` names the request's kind; ``path`` is the canonical upstream path it goes to."""
    s, metrics = parts.settings, parts.metrics
    out = Outcome(request_id(request))
    watcher = DisconnectWatcher(request)
    try:
        key = authenticate(s, request)
        raw = await read_body(request, BodyLimits.of(s))
        req = parse(route, decode_json(raw))
        refuse_while_starting(parts)
        watcher.start()
        try:
            info = await parts.models.info()
            parts.models.check_model(req.model, info)
            limit = effective_max_model_len(info.max_model_len, s.max_model_len)
            if limit is None or info.max_model_len is None:
                raise UpstreamUnavailable("The upstream does not report max_model_len yet.", retry_after=5)
            limits = Limits(limit, s.max_prompt_tokens, s.max_output_tokens, s.min_output_tokens)
            policy = prompt_policy(request, s)
            if isinstance(req, PoolingRequest):
                booking = await plan_pooling(parts, req, limits, policy, info.max_model_len, out)
            else:
                booking = await plan_generation(parts, req, limits, policy, out)
            body = jsonio.dumps(req.body)
            return await dispatch(parts, route, path, body, booking, priority(parts, request, key), out, watcher)
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


def parse(route: str, body: dict[str, Any]) -> GuardedRequest | PoolingRequest:
    generating = GENERATING.get(route)
    return generating(body) if generating is not None else POOLING[route](body)


async def dispatch(
    parts: Parts, route: str, path: str, body: bytes, booking: Booking, prio: int, out: Outcome,
    watcher: DisconnectWatcher,
) -> Response:
    """Admit (reserve, or queue, or shed), then forward or stream; release on every path but a live stream,
    whose relay releases it. A managed engine that dies under the request gets it once more after its restart."""
    for attempt in (1, 2):
        reservation = parts.admission.reservation(
            prompt_tokens=booking.prompt_tokens, max_tokens=booking.max_tokens, n=booking.n, priority=prio,
            request_id=out.request_id,
        )
        await reservation.__aenter__()  # may wait in the queue, or shed with 429/503
        relay_owns_it = False
        try:
            out.queue_ms += reservation.queue_ms
            try:
                if not booking.stream:
                    return await forward(parts, route, path, body, out, reservation)
                stream = await open_upstream(parts, path, body, out.request_id)
            except (UpstreamUnavailable, UpstreamError) as exc:
                if not engine_failed(parts, exc):
                    raise
                reservation.release(completed=False)
                if attempt == 2:
                    raise engine_failure(parts) from exc
                # The managed engine died under this request before anything reached the client:
                # wait for the restart in the queue (admission is paused) and send it once more.
                log.warning("request %s: the engine failed under it; retrying after the restart", out.request_id)
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
                reservation.release(completed=booking.learns_output)
    raise AssertionError("unreachable: the second attempt returns or raises")


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


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
