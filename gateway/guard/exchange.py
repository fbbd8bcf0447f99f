"""The exchange with the engine: send a guarded request, read its answer whole or as events, and teach the
reservation what was generated. Every opened upstream request is closed, and counted in and out of the
in-flight gauge, exactly once."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator

import orjson

from gateway.admission import Reservation
from gateway.engine.client import UpstreamStream
from gateway.engine.sse import counts_as_token, stream_events
from gateway.engine.vllm_api import upstream_error_from
from gateway.errors import BadUpstreamResponse
from gateway.guard.parts import Parts

log = logging.getLogger(__name__)


async def open_upstream(parts: Parts, path: str, body: bytes, rid: str) -> UpstreamStream:
    """The upstream's answer once its status is 200 (its error, normalised, otherwise); counted in flight
    until closed by the caller."""
    parts.metrics.in_flight.inc()
    try:
        stream = await parts.engine.client.open(
            "POST", path, body=body, headers={"content-type": "application/json", "x-request-id": rid}
        )
    except BaseException:
        parts.metrics.in_flight.dec()
        raise
    if stream.status != 200:
        try:
            payload = await stream.read_all()
        finally:
            close(parts, stream)
        raise upstream_error_from(stream.status, payload, stream.headers)
    return stream


def close(parts: Parts, stream: UpstreamStream) -> None:
    stream.close()
    parts.metrics.in_flight.dec()


async def read_answer(parts: Parts, route: str, stream: UpstreamStream, reservation: Reservation | None) -> bytes:
    """A whole JSON answer; its usage teaches the reservation how long outputs really are (``reservation``
    None: the route generates nothing, like the pooling routes)."""
    t0 = time.perf_counter()
    try:
        payload = await stream.read_all()
    finally:
        close(parts, stream)
    parts.metrics.record_upstream_latency(route, time.perf_counter() - t0)
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BadUpstreamResponse("The upstream answered 200 with a body that is not JSON.") from exc
    if not isinstance(data, dict):
        kind = "null" if data is None else type(data).__name__
        raise BadUpstreamResponse(f"The upstream answered 200 with a JSON {kind} where an object was expected.")
    generated = output_tokens(data.get("usage")) if reservation is not None else None
    if generated is not None and reservation is not None:
        parts.metrics.record_output_tokens(generated)
        reservation.observe_output_tokens(generated)
    parts.metrics.record_request(route, "ok")
    return payload


def output_tokens(usage: object) -> int | None:
    """Generated tokens from an answer's usage: ``completion_tokens`` (chat, completions) or ``output_tokens``
    (Responses)."""
    if not isinstance(usage, dict):
        return None
    value = usage.get("completion_tokens", usage.get("output_tokens"))
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value


async def progress_events(
    parts: Parts, route: str, stream: UpstreamStream, reservation: Reservation, t0: float
) -> AsyncGenerator[bytes, None]:
    """The stream's whole events, one at a time. Each data event is one generated token (vLLM streams each
    step): cheap progress for admission. A break raises ``GatewayError`` after the last whole event."""
    tokens = 0
    first = True
    async for event in stream_events(stream, parts.settings.max_stream_event_bytes):
        if first:
            parts.metrics.record_ttft(route, time.perf_counter() - t0)
            first = False
        if counts_as_token(event):
            tokens += 1
            reservation.observe_output_tokens(tokens)
        yield event


def finish_stream(
    parts: Parts, route: str, stream: UpstreamStream, reservation: Reservation, outcome: str, t0: float
) -> None:
    """Free what a stream held, whether it ended, broke, or never started (a client gone before the first
    event). Synchronous on purpose: this also runs in a task cancelled because its client went away. A cut
    stream's short output must not teach admission that outputs are short: only "ok" completes."""
    close(parts, stream)
    reservation.release(completed=outcome == "ok")
    parts.metrics.record_upstream_latency(route, time.perf_counter() - t0)
    parts.metrics.record_request(route, outcome)
