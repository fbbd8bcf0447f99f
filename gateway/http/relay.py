"""Relaying one upstream answer to one client, releasing its reservation exactly once.

A stream is relayed one whole server-sent event per write (sse.py), whatever the upstream's read boundaries;
an error inside a started stream is written as events of its own, only ever between events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.admission.controller import Reservation
from gateway.engine.client import BodyDecoder, UpstreamStream, decoder_for
from gateway.errors import BadUpstreamResponse, GatewayError, sse_error_events, upstream_error_from
from gateway.guard import pooling
from gateway.guard.parts import Outcome, Parts
from gateway.http.sse import SSEFramer, counts_as_token

log = logging.getLogger(__name__)


async def open_upstream(parts: Parts, path: str, body: bytes, rid: str) -> UpstreamStream:
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
        raise upstream_error_from(stream.status, payload, stream.headers)
    return stream


async def forward(
    parts: Parts, route: str, path: str, body: bytes, out: Outcome, reservation: Reservation
) -> Response:
    t0 = time.perf_counter()
    stream = await open_upstream(parts, path, body, out.request_id)
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
    if not isinstance(data, dict):
        kind = "null" if data is None else type(data).__name__
        raise BadUpstreamResponse(f"The upstream answered 200 with a JSON {kind} where an object was expected.")
    # Pooling answers generate nothing (their usage says completion_tokens: 0): they teach no output length.
    generated = None if route in pooling.PARSERS else output_tokens(data.get("usage"))
    if generated is not None:
        parts.metrics.record_output_tokens(generated)
        # Teaches the adaptive policy how long outputs really are.
        reservation.observe_output_tokens(generated)
    parts.metrics.record_request(route, "ok")
    headers = out.headers()
    return Response(payload, status_code=200, media_type="application/json", headers=headers)


def output_tokens(usage: object) -> int | None:
    """Generated tokens from an answer's usage: ``completion_tokens`` (chat, completions) or ``output_tokens``
    (Responses)."""
    if not isinstance(usage, dict):
        return None
    value = usage.get("completion_tokens", usage.get("output_tokens"))
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value


def relay_stream(
    parts: Parts, route: str, stream: UpstreamStream, reservation: Reservation, out: Outcome
) -> StreamingResponse:
    relay = StreamRelay(parts, route, stream, reservation)
    ctype = stream.headers.get("content-type", "")
    try:
        if not ctype.startswith("text/event-stream"):
            raise BadUpstreamResponse(f"The upstream answered a stream request with content-type {ctype!r}.")
        relay.decoder = decoder_for(stream.headers)
    except GatewayError:
        relay.finish("error", record=False)  # the caller answers, and counts, the error
        raise
    return RelayResponse(
        relay, media_type="text/event-stream",
        headers={**out.headers(), "cache-control": "no-cache", "x-accel-buffering": "no"},
    )


class StreamRelay:
    """One upstream stream relayed to one client. ``finish`` frees everything exactly once, whether the
    stream ended, broke, or never started (a client gone before the first byte)."""

    def __init__(self, parts: Parts, route: str, stream: UpstreamStream, reservation: Reservation) -> None:
        self.parts, self.route, self.stream, self.reservation = parts, route, stream, reservation
        self.decoder: BodyDecoder | None = None  # an upstream that compressed though asked not to
        self.t0 = time.perf_counter()
        self.done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        framer = SSEFramer(self.parts.settings.max_stream_event_bytes)
        decoder = self.decoder
        tokens = 0
        first = True
        outcome = "cancelled"
        try:
            async for chunk in self.stream.chunks():
                events = framer.feed(decoder.decode(chunk, framer.limit) if decoder is not None else chunk)
                if not events:
                    continue
                if first:
                    self.parts.metrics.record_ttft(self.route, time.perf_counter() - self.t0)
                    first = False
                # One data event per generated token (vLLM streams each step): cheap progress for admission.
                tokens += sum(1 for event in events if counts_as_token(event))
                self.reservation.observe_output_tokens(tokens)
                for event in events:
                    yield event
            for event in framer.feed(decoder.finish()) if decoder is not None else ():
                yield event
            for event in framer.close():
                yield event
            outcome = "ok"
        except GatewayError as exc:
            outcome = "error"
            log.warning("stream cut by the upstream: %s", exc.message)
            for event in sse_error_events(exc):
                yield event
        finally:
            self.finish(outcome)

    def finish(self, outcome: str, *, record: bool = True) -> None:
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
        if record:
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
