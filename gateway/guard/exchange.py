"""The exchange with the engine: send a guarded request, read its answer whole or as events, and teach the
reservation what was generated. Every opened upstream request is closed, and counted in and out of the
in-flight gauge, exactly once."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import orjson

from gateway.admission import Reservation
from gateway.engine.client import UpstreamStream, decoder_for
from gateway.engine.engine import Engine
from gateway.engine.sse import SSEFramer
from gateway.engine.usage import EVERYTHING, StreamUsage, UsageAsk, ask_engine_for_usage
from gateway.engine.vllm_api import upstream_error_from
from gateway.errors import BadUpstreamResponse, EngineQueueFull, GatewayError, UpstreamHung
from gateway.guard.models import Models
from gateway.guard.parts import Parts

log = logging.getLogger(__name__)

# vLLM's API server runs a request on this data-parallel engine instead of balancing it itself
# (vllm/entrypoints/generate/base/serving.py, vLLM 0.32).
DP_RANK_HEADER = "x-data-parallel-rank"


async def open_upstream(
    parts: Parts, engine: Engine[Models], path: str, body: bytes, rid: str, rank: int | None = None,
    trace: Mapping[str, str] | None = None,
) -> UpstreamStream:
    """The upstream's answer once its status is 200 (its error, normalised, otherwise); counted in flight
    until closed by the caller. ``rank``: the data-parallel engine behind ``engine``'s URL to run it on;
    ``trace``: the W3C trace headers that make the engine's spans children of the gateway's exchange."""
    parts.metrics.in_flight.inc()
    progress = engine.progress
    progress.opened()
    headers = {"content-type": "application/json", "x-request-id": rid, **(trace or {})}
    if rank is not None:
        headers[DP_RANK_HEADER] = str(rank)
    try:
        with progress.interruptible():  # refused while the engine is hung, cut if it hangs meanwhile
            stream = await engine.client.open("POST", path, body=body, headers=headers)
    except BaseException:
        parts.metrics.in_flight.dec()
        progress.closed()
        raise
    if stream.status != 200:
        try:
            payload = await stream.read_all()
        finally:
            close(parts, engine, stream)
        error = upstream_error_from(stream.status, payload, stream.headers)
        if isinstance(error, EngineQueueFull):
            engine.queue_cap.refused(error.retry_after or 0.0)  # nothing more placed on it for now
        raise error
    return stream


def engine_body(route: str, body: dict[str, Any], stream: bool) -> tuple[dict[str, Any], UsageAsk]:
    """The body sent to the engine, and what of the stream's usage the client asked for: a chat or completions
    stream asks the engine for its figures (``gateway.engine.usage``); the relay takes out what was not asked."""
    if stream and route in ("chat", "completions"):
        return ask_engine_for_usage(body)
    return body, EVERYTHING


def close(parts: Parts, engine: Engine[Models], stream: UpstreamStream) -> None:
    stream.close()
    parts.metrics.in_flight.dec()
    engine.progress.closed()
    engine.queue_cap.room()  # a request left the engine: its own queue cap has a place again


async def read_answer(
    parts: Parts, engine: Engine[Models], route: str, stream: UpstreamStream, reservation: Reservation | None
) -> bytes:
    """A whole JSON answer; its usage teaches the reservation how long outputs really are (``reservation``
    None: the route generates nothing, like the pooling routes)."""
    t0 = time.perf_counter()
    try:
        with engine.progress.interruptible():
            payload = await stream.read_all()
        engine.progress.answered()  # a whole answer is progress, even from an engine whose metrics never move
    finally:
        close(parts, engine, stream)
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


class EngineStream:
    """One upstream stream relayed one whole event at a time (``SSEFramer``: whatever the upstream's read
    boundaries). The output it generated is the engine's own count (``StreamUsage``: the usage vLLM was asked to
    send, taken out again where the client did not ask for it), fed to the reservation as it grows. A break
    raises ``GatewayError`` after the last whole event. ``finish`` frees everything exactly once, whether the
    stream ended, broke, or never started (a client gone before the first event)."""

    def __init__(
        self, parts: Parts, engine: Engine[Models], route: str, stream: UpstreamStream, reservation: Reservation,
        ask: UsageAsk = EVERYTHING,
    ) -> None:
        self.parts, self.route, self.stream, self.reservation = parts, route, stream, reservation
        self.engine = engine
        self.usage = StreamUsage(route, ask, engine.fingerprint)
        self.t0 = time.perf_counter()
        self.outcome = "cancelled"  # until the stream ends or breaks
        self._done = False
        # A hung engine sends nothing more: the detector closes the stream, and its break is told as the hang.
        self._hang: UpstreamHung | None = None
        self._watch = engine.progress.watch(self._cut)

    async def events(self) -> AsyncGenerator[bytes, None]:
        framer = SSEFramer(self.parts.settings.max_stream_event_bytes)
        decoder = decoder_for(self.stream.headers)  # an upstream that compressed though asked not to
        usage = self.usage
        first = True
        progress = self.engine.progress
        try:
            async for chunk in self.stream.chunks():
                progress.stream_moved()
                events = framer.feed(decoder.decode(chunk, framer.limit) if decoder is not None else chunk)
                if not events:
                    continue
                if first:
                    self.parts.metrics.record_ttft(self.route, time.perf_counter() - self.t0)
                    first = False
                events = usage.feed(events)
                self.reservation.observe_output_tokens(usage.generated)
                for event in events:
                    yield event
            tail = framer.feed(decoder.finish()) if decoder is not None else []
            for event in usage.feed(tail + framer.close()) + usage.close():
                yield event
            self.reservation.observe_output_tokens(usage.generated)
            self.outcome = "ok"
        except GatewayError as exc:
            self.outcome = "error"
            for event in usage.close():  # chunks held for a usage chunk that will not come
                yield event
            if self._hang is not None:
                raise self._hang from exc
            log.warning("stream cut by the upstream: %s", exc.message)
            raise
        finally:
            # The engine's request ended (or this stream was closed): its blocks go back now, with whether it
            # completed, before anything unwinds the pipeline around it (whose own exit would call it cut).
            self.finish()

    def _cut(self, hang: UpstreamHung) -> None:
        self._hang = hang
        self.stream.close()  # the read in progress ends with a break, told as the hang

    def finish(self) -> None:
        """Synchronous on purpose: this also runs in a task cancelled because its client went away. A cut
        stream's short output must not teach admission that outputs are short: only "ok" completes. Called when
        the events end, and again (a no-op then) when the pipeline closes."""
        if self._done:
            return
        self._done = True
        self.engine.progress.unwatch(self._watch)
        close(self.parts, self.engine, self.stream)
        self.reservation.release(completed=self.outcome == "ok")
        if self.outcome == "ok" and self.usage.reported:
            self.parts.metrics.record_output_tokens(self.usage.generated)
        self.parts.metrics.record_upstream_latency(self.route, time.perf_counter() - self.t0)
        self.parts.metrics.record_request(self.route, self.outcome)
