"""Serving a guarded route: build the request's context, run the guard's pipeline, and write its answer:
a JSON body, or server-sent events, one whole event per HTTP chunk. While the request waits (in the queue, or for
the upstream) a disconnect watcher cancels it when its client goes away; once a stream has started, the
client's connection tells its stream when it is lost, which aborts the engine's request and frees the
reservation. An error after a stream's head is written as error events of their own, only ever between events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.config_http import MAX_BUFFERED_BYTES
from gateway.errors import GatewayError
from gateway.guard import pipeline
from gateway.guard.exchange import EngineStream, Reply
from gateway.guard.parts import Parts
from gateway.http.access import AccessEntry
from gateway.http.body import DisconnectWatcher
from gateway.http.context import read_context, request_id
from gateway.http.errors import error_response, sse_error_events
from gateway.http.stream_out import CONNECTION, DirectOut, HeldBytes, QueueOut
from gateway.observe.tracing import RequestTrace

log = logging.getLogger(__name__)


async def serve_guarded(parts: Parts, request: Request, route: str, path: str, held: HeldBytes) -> Response:
    """``route`` names the request's kind; ``path`` is the canonical upstream path it goes to. Its access-log
    line is written once on every exit: here for a whole answer or a refusal, by the stream at its end."""
    entry = AccessEntry(parts.access_log, route, request_id(request), request.headers)
    try:
        response = await _serve(parts, request, route, path, entry, held)
    except asyncio.CancelledError:
        entry.finish(499, "cancelled")
        raise
    except BaseException:
        entry.finish(500, "error")  # a bug of ours, answered by the app's last-resort handler
        raise
    if not isinstance(response, StreamAnswer):
        entry.finish(response.status_code)
    return response


async def _serve(
    parts: Parts, request: Request, route: str, path: str, entry: AccessEntry, held: HeldBytes
) -> Response:
    rid = entry.request_id
    try:
        ctx = await read_context(parts.settings, request, rid, route, path)
    except GatewayError as exc:
        pipeline.record_refusal(parts, route, exc)
        entry.error = exc.with_traceback(None)  # kept by the entry: no traceback (see below)
        return error_response(exc, {"x-request-id": rid})
    except ClientDisconnect:
        # Gone while sending its body: nothing was reserved or sent upstream, and it is no error of ours.
        parts.metrics.record_request(route, "cancelled")
        return Response(status_code=499)
    entry.ctx = ctx
    answer = pipeline.handle(parts, ctx)
    watcher = DisconnectWatcher(request)
    watcher.start()
    try:
        head = await anext(answer)
    except GatewayError as exc:
        headers = ctx.outcome.headers() if ctx.outcome.prompt_tokens else {"x-request-id": rid}
        # Without its traceback: through it this frame would hold the entry, and the entry the error, a cycle
        # only a full collection frees, keeping every frame's locals meanwhile (a refused 8 MB prompt's 8M ids).
        entry.error = exc.with_traceback(None)
        return error_response(exc, headers)
    except asyncio.CancelledError:
        if not watcher.fired:
            raise
        _uncancel()
        parts.metrics.record_request(route, "cancelled")
        log.info("request %s: the client went away; its upstream request was cancelled", rid)
        return Response(status_code=499)
    finally:
        watcher.stop()
    if head.stream is None:
        await answer.aclose()
        return Response(head.body, status_code=200, media_type="application/json", headers=head.headers)
    return StreamAnswer(
        answer, head.stream, head.headers, held, ctx.trace, parts.settings.max_buffered_bytes, entry=entry
    )


class StreamAnswer(Response):
    """A guarded stream's answer: its head, then its events as the engine sends them (``guard/exchange.py``), an
    error after the last whole event as error events of their own, then the stream's end. The events go
    straight to the client's transport (``stream_out.DirectOut``) under the gateway's own server, else through
    ASGI's ``send`` from a writer task. The pipeline is closed (the reservation was freed at the engine's end
    already) and the access-log line written once the answer is over, however it ends."""

    def __init__(
        self, answer: AsyncGenerator[Reply, None], stream: EngineStream, headers: dict[str, str],
        held: HeldBytes, trace: RequestTrace, max_buffered: int = MAX_BUFFERED_BYTES,
        entry: AccessEntry | None = None,
    ) -> None:
        self.answer, self.stream, self.trace = answer, stream, trace
        self.held = held
        self.entry = entry
        self.ended = "cancelled"  # until the end is written: ok, or error after an error event
        self._max_buffered = max_buffered
        # As Starlette's StreamingResponse: no body, so no Content-Length, so the answer is chunked.
        self.status_code, self.media_type, self.background = 200, "text/event-stream", None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = self.stream
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            connection = scope.get("extensions", {}).get(CONNECTION)
            if connection is not None:
                await self._direct(connection, send)
            else:
                await self._queued(send)
        finally:
            stream.cancel()  # a no-op once the stream is over; else (cancelled meanwhile) it aborts the engine's
            try:
                await self.answer.aclose()
            finally:
                if self.entry is not None:  # after the close: the completion tokens are known
                    self.entry.finish(self.status_code, self.ended)

    async def _direct(self, connection: Any, send: Send) -> None:
        protocol, cycle = connection
        out = DirectOut(cycle, self._max_buffered, self.held)
        out.on_cut = self.stream.end
        protocol.on_lost(self.stream.cancel)  # the client gone: the engine's request is aborted at once
        try:
            error = await self.stream.relay(out, self.trace)
        finally:
            protocol.on_lost(None)
            out.close()
        self._first_event(out.first_at)
        await self._end(error, send)

    async def _queued(self, send: Send) -> None:
        out = QueueOut(send, self._max_buffered, self.held)
        out.on_cut = self.stream.end
        try:
            error = await self.stream.relay(out, self.trace)
            await out.drain()
        finally:
            await out.stop()
        self._first_event(out.first_at)
        await self._end(error, send)

    def _first_event(self, at: float | None) -> None:
        if at is not None and self.entry is not None:
            self.entry.first_event(at)

    async def _end(self, error: GatewayError | None, send: Send) -> None:
        if error is not None:
            if self.entry is not None:
                self.entry.error = error
            for event in sse_error_events(error):
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        # A stream cancelled without an error was its client's leaving (its connection was lost).
        self.ended = "error" if error is not None else "cancelled" if self.stream.outcome == "cancelled" else "ok"


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
