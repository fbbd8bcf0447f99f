"""Serving a guarded route: build the request's context, run the guard's pipeline, and write its answer:
a JSON body, or server-sent events one whole event per write. While the request waits (in the queue, or for
the upstream) a disconnect watcher cancels it when its client goes away; once a stream has started, the
streaming response watches the client itself and closes the pipeline, which releases the reservation.
An error after a stream's head is written as error events of their own, only ever between events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.guard import pipeline
from gateway.guard.context import Reply
from gateway.guard.parts import Parts
from gateway.http.access import AccessEntry
from gateway.http.body import DisconnectWatcher
from gateway.http.context import read_context, request_id
from gateway.http.errors import error_response, sse_error_events

log = logging.getLogger(__name__)


async def serve_guarded(parts: Parts, request: Request, route: str, path: str) -> Response:
    """``route`` names the request's kind; ``path`` is the canonical upstream path it goes to. Its access-log
    line is written once on every exit: here for a whole answer or a refusal, by the stream at its end."""
    entry = AccessEntry(parts.access_log, route, request_id(request), request.headers)
    try:
        response = await _serve(parts, request, route, path, entry)
    except asyncio.CancelledError:
        entry.finish(499, "cancelled")
        raise
    except BaseException:
        entry.finish(500, "error")  # a bug of ours, answered by the app's last-resort handler
        raise
    if not isinstance(response, EventStreamResponse):
        entry.finish(response.status_code)
    return response


async def _serve(parts: Parts, request: Request, route: str, path: str, entry: AccessEntry) -> Response:
    rid = entry.request_id
    try:
        ctx = await read_context(parts.settings, request, rid, route, path)
    except GatewayError as exc:
        pipeline.record_refusal(parts, route, exc)
        entry.error = exc
        return error_response(exc, {"x-request-id": rid})
    except ClientDisconnect:
        # Gone while sending its body: nothing was reserved or sent upstream, and it is no error of ours.
        parts.metrics.record_request(route, "cancelled")
        return Response(status_code=499)
    entry.context(ctx)
    answer = pipeline.handle(parts, ctx)
    watcher = DisconnectWatcher(request)
    watcher.start()
    try:
        head = await anext(answer)
    except GatewayError as exc:
        headers = ctx.outcome.headers() if ctx.outcome.prompt_tokens else {"x-request-id": rid}
        entry.error = exc
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
    if head.events is None:
        await answer.aclose()
        return Response(head.body, status_code=200, media_type="application/json", headers=head.headers)
    return EventStreamResponse(answer, head.events, head.headers, entry=entry)


class EventStreamResponse(StreamingResponse):
    """A guarded stream: its events one per write, an error after the last whole event as error events of
    their own; then the pipeline is closed, which frees the reservation, whatever happened to the client.

    ``stream_response`` is Starlette's own loop with the error handling inside it, rather than a wrapping
    generator: one generator fewer per event on the hottest path of a stream."""

    def __init__(
        self, answer: AsyncGenerator[Reply, None], events: AsyncIterator[bytes], headers: dict[str, str],
        entry: AccessEntry | None = None,
    ) -> None:
        self.answer, self.events = answer, events
        self.entry = entry  # its access-log line, written once the pipeline is closed
        self.ended = "cancelled"  # until the last event is written, or the stream breaks
        super().__init__(events, media_type="text/event-stream", headers=headers)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for event in self.events:
                if self.entry is not None:
                    self.entry.first_event()
                await send({"type": "http.response.body", "body": event, "more_body": True})
            self.ended = "ok"
        except GatewayError as exc:
            self.ended = "error"
            if self.entry is not None:
                self.entry.error = exc
            for event in sse_error_events(exc):
                await send({"type": "http.response.body", "body": event, "more_body": True})
        # Free the reservation as soon as the last event is written, before the response's end is sent.
        await self.answer.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                if isinstance(self.events, AsyncGenerator):
                    await self.events.aclose()
                await self.answer.aclose()
            finally:
                if self.entry is not None:  # after the close: the completion tokens are known
                    self.entry.finish(self.status_code, self.ended)


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
