"""The exchange with the engine: send a guarded request, read its answer whole or as events, and teach the
reservation what was generated. Every opened upstream request is closed, and counted in and out of the
in-flight gauge, exactly once."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import orjson

from gateway.engine.client import UpstreamStream
from gateway.engine.engine import Engine
from gateway.engine.vllm_api import upstream_error_from
from gateway.errors import BadUpstreamResponse, EngineQueueFull
from gateway.guard.models import Models
from gateway.guard.parts import Parts
from gateway.guard.seams import Held

log = logging.getLogger(__name__)

# vLLM's API server runs a request on this data-parallel engine instead of balancing it itself
# (vllm/entrypoints/generate/base/serving.py, vLLM 0.32).
DP_RANK_HEADER = "x-data-parallel-rank"


async def open_upstream(
    parts: Parts, engine: Engine[Models], path: str, body: bytes, rid: str, rank: int | None = None,
    trace: Mapping[str, str] | None = None, patience: float | None = None, *, resend: bool = True,
) -> UpstreamStream:
    """The upstream's answer once its status is 200 (its error, normalised, otherwise); counted in flight
    until closed by the caller. ``patience``: seconds the request may wait for a connection (an engine whose
    API server accepts late is waited on within the request's own time, not failed at --connect-timeout);
    ``rank``: the data-parallel engine behind ``engine``'s URL to run it on;
    ``trace``: the W3C trace headers that make the engine's spans children of the gateway's exchange;
    ``resend``: whether the client may send it once more when the engine cannot have read it (``Upstream.open``)."""
    parts.metrics.in_flight.inc()
    progress = engine.progress
    progress.opened()
    headers = {"content-type": "application/json", "x-request-id": rid, **(trace or {})}
    if rank is not None:
        headers[DP_RANK_HEADER] = str(rank)
    try:
        with progress.interruptible():  # refused while the engine is hung, cut if it hangs meanwhile
            stream = await engine.client.open(
                "POST", path, body=body, headers=headers, connect_within=patience, resend=resend
            )
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


def close(parts: Parts, engine: Engine[Models], stream: UpstreamStream) -> None:
    stream.close()
    parts.metrics.in_flight.dec()
    engine.progress.closed()
    engine.queue_cap.room()  # a request left the engine: its own queue cap has a place again


async def read_answer(
    parts: Parts, engine: Engine[Models], route: str, stream: UpstreamStream, reservation: Held | None
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
