"""The request path of a guarded route, stage by stage.

``handle`` is the whole life of one request after the HTTP layer has read it:

    parse -> refuse while the engine starts -> engine limits -> plan (count, prompt policy, output policy,
    KV fit) -> tenant limits -> admit (reserve, or queue, or shed) -> exchange (forward, or stream) -> release
    (and settle the tenant's charge)

It is an async generator that yields one ``Reply``: a whole JSON body, or the head of a stream with its events
to read. The reservation is held by an ``async with`` around the exchange, and the generator stays suspended
at its ``yield`` while the HTTP layer writes the answer; so the reservation is released exactly once on every
exit: the end of the answer (the HTTP layer closes the generator), an upstream failure, a client that goes
away (closed, or its task cancelled), a timeout. Every stage raises ``GatewayError``; only the HTTP layer
turns errors into answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from gateway.engine.usage import EVERYTHING, UsageAsk
from gateway.engine.vllm_api import ModelList
from gateway.errors import GatewayError, UpstreamError, UpstreamLost, UpstreamUnavailable
from gateway.guard import exchange, offload, planning
from gateway.guard.context import Booking, RequestContext
from gateway.guard.endpoints.base import GuardedRequest, engine_body
from gateway.guard.endpoints.pooling import PoolingRequest
from gateway.guard.endpoints.table import BY_NAME, parse
from gateway.guard.exchange import Reply
from gateway.guard.parts import Outcome, Parts
from gateway.guard.policy import Limits, effective_max_model_len
from gateway.guard.seams import Granted, Held
from gateway.managed.lifecycle import EngineLifecycle
from gateway.managed.logfacts import engine_death_reply
from gateway.observe.tracing import AttrValue
from gateway.tenants import Grant

log = logging.getLogger(__name__)


async def handle(parts: Parts, ctx: RequestContext) -> AsyncGenerator[Reply, None]:
    answered = False  # once the head is out, a failure is the stream's own and was counted by it
    ctx.trace = trace = parts.tracing.start(ctx.route, ctx.trace_carrier, BY_NAME[ctx.route].operation)
    try:
        with trace.stage("parse"):
            req = await offload.run(parse, ctx.route, ctx.body)  # validation walks the whole body
            refuse_while_starting(parts)
            refuse_while_unready(parts)  # 503 at once while /health says no engine is ready
            limits, engine_max_model_len = await engine_limits(parts, req)
        trace.set_attributes(request_attributes(req))
        with trace.stage("count"):
            if isinstance(req, PoolingRequest):
                plan = await planning.plan_pooling(
                    parts, req, limits, ctx.prompt_policy, engine_max_model_len, ctx.outcome
                )
            else:
                plan = await planning.plan_generation(parts, req, limits, ctx.prompt_policy, ctx.outcome)
        trace.set_attributes(plan_attributes(req, ctx.outcome))
        booking = plan.booking
        with trace.stage("tenant"):
            grant = await check_tenant_limits(parts, ctx, booking)
        sent, ask = engine_body(req, plan)  # the one place the engine's body is written
        body = await offload.dumps(sent)
        try:
            # Closed here, not left to the loop's finalizer hook: an async generator dropped unclosed has its
            # close scheduled as a task of its own (a thread-safe wake-up of the loop, a task, a loop turn per
            # request), and its reservation would be freed only then.
            async with contextlib.aclosing(admit_and_exchange(parts, ctx, body, booking, grant, ask)) as pieces:
                async for piece in pieces:
                    answered = True
                    yield piece
        finally:
            grant.settle(ctx.outcome.queue_ms)  # the tenant is charged what the request really used
    except GatewayError as exc:
        trace.fail(exc)
        if not answered:
            record_refusal(parts, ctx.route, exc)
            if parts.tenants is not None and exc.reason is not None:
                parts.tenants.usage.rejected(ctx.tenant, exc.reason)
        raise
    except (Exception, asyncio.CancelledError) as exc:  # a fault of ours, or the client gone meanwhile
        trace.fail(exc)
        raise
    finally:
        finish_trace(ctx)


async def engine_limits(parts: Parts, req: GuardedRequest | PoolingRequest) -> tuple[Limits, int]:
    """The limits in force for this request's model, and the engine's own context length."""
    s = parts.settings
    info = await served_listing(parts)
    parts.models.check_model(req.model, info)
    limit = effective_max_model_len(info.max_model_len, s.max_model_len)
    if limit is None or info.max_model_len is None:
        raise UpstreamUnavailable("The upstream does not report max_model_len yet.", retry_after=5)
    return Limits(limit, s.max_prompt_tokens, s.max_output_tokens, s.min_output_tokens), info.max_model_len


async def served_listing(parts: Parts) -> ModelList:
    """The first engine's model listing; while it has none to give (it has not come up yet), another engine's:
    every engine serves the first one's model (checked as each comes up). Managed engines install that stand-in
    once the second is ready; until then a request would otherwise fail on the first engine's absence."""
    try:
        return await parts.models.info()
    except (UpstreamUnavailable, UpstreamError):
        for engine in parts.every_engine()[1:]:
            with contextlib.suppress(UpstreamUnavailable, UpstreamError):
                return await engine.models.info()
        raise


async def check_tenant_limits(parts: Parts, ctx: RequestContext, booking: Booking) -> Granted:
    """Charge the request to its tenant's windows (its prompt tokens as counted + the max_tokens booked for
    each sequence; 429 over a limit), and report where the tenant stands in OpenAI's x-ratelimit-* headers."""
    if parts.tenants is None:
        return Grant.unlimited()
    grant = await parts.tenants.check(
        ctx.tenant, prompt_tokens=ctx.outcome.prompt_tokens, output_tokens=booking.max_tokens * booking.n
    )
    ctx.outcome.ratelimit = grant.headers
    grant.raise_if_refused()
    return grant


async def admit_and_exchange(
    parts: Parts, ctx: RequestContext, body: bytes, booking: Booking, grant: Granted, ask: UsageAsk = EVERYTHING
) -> AsyncGenerator[Reply, None]:
    """Hold a reservation (waiting in the queue if need be) for the exchange with the engine it was placed on.
    A request that engine failed before anything reached the client is sent once more: to another engine when
    there are several (failover), else, in managed mode, to the engine after its restart. Once at most, the
    client's own resend included: a request its client sent twice is never sent again, and the second attempt
    is never resent by the client."""
    answered = False  # a stream that breaks after its head is never sent again
    avoid: frozenset[str] = frozenset()
    for attempt in (1, 2):
        reservation = parts.admission.reservation(
            prompt_tokens=booking.prompt_tokens, max_tokens=booking.max_tokens, n=booking.n,
            priority=ctx.priority, request_id=ctx.request_id, tenant=ctx.tenant, weight=ctx.tenant_weight,
            prefix=booking.prefix, avoid=avoid, family=f"{ctx.body.get('model')}/{ctx.route}",
            deadline=ctx.deadline, min_output=booking.min_output, objective=ctx.objective,
        )
        try:
            # May wait for the tenant's KV share and in the queue, or shed with QueueFull / QueueTimeout.
            ctx.trace.admitting()
            async with grant.admit(reservation, parts.admission.budget_blocks) as waited_ms:
                ctx.outcome.ratelimit = grant.headers or ctx.outcome.ratelimit  # a worker's: told with the admission
                ctx.outcome.queue_ms += waited_ms
                ctx.trace.admitted(waited_ms)
                with ctx.trace.stage("exchange", engine_attributes(reservation)):
                    # The engine joins the trace: under this exchange span, or (tracing off) the client's own.
                    trace = ctx.trace.headers() or ctx.trace_carrier
                    async with contextlib.aclosing(exchange.exchange_with_engine(
                        parts, ctx, body, booking, reservation, ask, trace=trace, resend=attempt == 1
                    )) as pieces:
                        async for piece in pieces:
                            answered = True
                            yield piece
                return
        except GatewayError as exc:
            ctx.outcome.ratelimit = grant.headers or ctx.outcome.ratelimit  # a refusal's, told by the authority
            if not isinstance(exc, UpstreamUnavailable | UpstreamError):
                raise
            if isinstance(exc, UpstreamLost) and exc.resent:
                raise  # sent twice already (the upstream could not have read the first): never a third time
            target = reservation.target
            if not answered and attempt == 1 and target is not None and failover(parts, exc):
                log.warning("request %s: engine %s failed under it (%s); sending it to another", ctx.request_id,
                            target.name, exc.message)
                parts.metrics.record_failover()
                avoid = frozenset({target.name})
                continue
            if answered or not engine_failed(parts, exc):
                raise
            if attempt == 2:
                raise engine_failure(parts) from exc
            log.warning("request %s: the engine failed under it; retrying after the restart", ctx.request_id)
            if parts.supervisor is not None:
                # Until the supervisor has seen the death, a retry would hit the dead engine.
                await parts.supervisor.failure_noticed()
    raise AssertionError("unreachable: the second attempt returns or raises")


# -- small stages ---------------------------------------------------------------------------------
def request_attributes(req: GuardedRequest | PoolingRequest) -> dict[str, AttrValue | None]:
    """What the client asked, for the request's span (GenAI semantic conventions)."""
    if isinstance(req, PoolingRequest):
        return {"gen_ai.request.model": req.model}
    return {
        "gen_ai.request.model": req.model, "gen_ai.request.max_tokens": req.max_tokens, "vllm_guard.stream": req.stream,
    }


def plan_attributes(req: GuardedRequest | PoolingRequest, out: Outcome) -> dict[str, AttrValue | None]:
    """What the guard made of it: the prompt as counted, the max_tokens sent, whether it was clamped."""
    asked = req.max_tokens if isinstance(req, GuardedRequest) else None
    return {
        "gen_ai.usage.input_tokens": out.prompt_tokens,
        "vllm_guard.prompt_tokens": out.prompt_tokens,
        "vllm_guard.max_tokens": out.max_tokens,
        "vllm_guard.truncated_tokens": out.truncated_tokens,
        "vllm_guard.clamped": asked is not None and out.max_tokens < asked,
    }


def engine_attributes(reservation: Held) -> dict[str, AttrValue]:
    target = reservation.target
    return {"vllm_guard.engine": target.name} if target is not None else {}


def finish_trace(ctx: RequestContext) -> None:
    """The request's span ends with what it cost: queued, placed, generated (the engine's own count)."""
    out = ctx.outcome
    ctx.trace.set_attributes({
        "vllm_guard.queue_ms": round(out.queue_ms, 1), "vllm_guard.engine": out.engine,
        "gen_ai.usage.output_tokens": out.completion_tokens,
    })
    ctx.trace.end()


def record_refusal(parts: Parts, route: str, exc: GatewayError) -> None:
    if exc.reason is not None and (exc.client_fault or exc.reason in (
        "queue_timeout", "queue_timeout_expected", "deadline", "engine_queue_full",
    )):
        parts.metrics.record_rejection(exc.reason)
    parts.metrics.record_request(route, "rejected" if exc.client_fault else "error")


def refuse_while_starting(parts: Parts) -> None:
    """While the managed engines (every one of them) start or are down, answer 503 at once; during a restart
    requests queue."""
    sups = parts.every_supervisor()
    if sups and all(s.state in (EngineLifecycle.STARTING, EngineLifecycle.DOWN) for s in sups):
        sup = sups[0]
        raise UpstreamUnavailable(
            f"The engine is {sup.state}; retry shortly." if len(sups) == 1 else
            f"Every engine is starting or down ({', '.join(str(s.state) for s in sups)}); retry shortly.",
            code=f"upstream_{sup.state}", retry_after=min(s.retry_after() for s in sups),
        )


def refuse_while_unready(parts: Parts) -> None:
    """Proxy mode: refuse at once (503 with Retry-After) while no engine takes requests, by the judgement that
    ``/health`` reports (``Engine.refusal``: down, its own /health failing, or hung); managed engines are their
    supervisors' (``refuse_while_starting``)."""
    if parts.every_supervisor():
        return
    first, *_ = engines = parts.every_engine()
    if not any(e.usable() and e.serves_like(first) for e in engines):
        refusal = first.refusal()  # never None here: the first serves like itself
        if refusal is not None:
            raise refusal


def failover(parts: Parts, exc: GatewayError) -> bool:
    """Another engine can take a request its engine failed (down, hung, or an engine-side error), not a
    client's mistake."""
    return len(parts.every_engine()) > 1 and not exc.client_fault


def engine_failed(parts: Parts, exc: GatewayError) -> bool:
    """An upstream failure that a managed engine's restart will mend (not a client mistake)."""
    sup = parts.supervisor
    if sup is None or exc.client_fault:
        return False
    if sup.state is not EngineLifecycle.READY or isinstance(exc, UpstreamUnavailable):
        return True
    return engine_death_reply(exc.message)


def engine_failure(parts: Parts) -> UpstreamUnavailable:
    sup = parts.supervisor
    return UpstreamUnavailable(
        "The engine failed while serving this request and is being restarted; retry shortly.",
        code="upstream_restarting", retry_after=sup.retry_after() if sup is not None else 5,
    )
