"""Serving a guarded route: build the request's context, run the guard's pipeline, and write its answer:
a JSON body, or server-sent events one whole event per write. While the request waits (in the queue, or for
the upstream) a disconnect watcher cancels it when its client goes away; once a stream has started, the
streaming response watches the client itself and closes the pipeline, which releases the reservation.
An error after a stream's head is written as error events of their own, only ever between events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.config_http import MAX_BUFFERED_BYTES
from gateway.errors import ClientTooSlow, GatewayError
from gateway.guard import pipeline
from gateway.guard.context import Reply
from gateway.guard.parts import Parts
from gateway.http.access import AccessEntry
from gateway.http.body import DisconnectWatcher
from gateway.http.context import read_context, request_id
from gateway.http.errors import error_response, sse_error_events
from gateway.http.spool import Spool

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
        entry.error = exc.with_traceback(None)  # kept by the entry: no traceback (see below)
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
    if head.events is None:
        await answer.aclose()
        return Response(head.body, status_code=200, media_type="application/json", headers=head.headers)
    return EventStreamResponse(answer, head.events, head.headers, parts.settings.max_buffered_bytes, entry=entry)


class EventStreamResponse(StreamingResponse):
    """A guarded stream: its events one per write, an error after the last whole event as error events of
    their own. A pump task owned by the response reads the engine's events into a spool bounded in bytes
    (``spool``) and closes the pipeline as soon as the engine's stream ends, which frees the reservation
    whatever the client has read; the response writes from the spool. A client that lets more than
    ``max_buffered`` bytes wait is cut: the engine's request is cancelled, what waited is dropped, and the
    client gets an error event (``client_too_slow``) and the stream's end.

    ``stream_response`` is Starlette's own loop with the error handling inside it, rather than a wrapping
    generator: one generator fewer per event on the hottest path of a stream."""

    def __init__(
        self, answer: AsyncGenerator[Reply, None], events: AsyncIterator[bytes], headers: dict[str, str],
        max_buffered: int = MAX_BUFFERED_BYTES, entry: AccessEntry | None = None,
    ) -> None:
        self.answer, self.events = answer, events
        self.entry = entry  # its access-log line, written once the pipeline is closed
        self.ended = "cancelled"  # until the writer sends the stream's end: ok, or error after an error event
        self.spool = Spool(max_buffered)
        self._max_buffered = max_buffered
        self._pump: asyncio.Task[None] | None = None
        self._closing = False  # the pump is closing the pipeline: it is let finish, never cancelled
        super().__init__(events, media_type="text/event-stream", headers=headers)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._pump = asyncio.create_task(self._read_engine(), name="stream-pump")
        spool = self.spool
        while True:
            item = await spool.get()
            if isinstance(item, bytes):
                if self.entry is not None:
                    self.entry.first_event()
                spool.sending = True  # the pump cuts the stream only while a write waits on the client
                await send({"type": "http.response.body", "body": item, "more_body": True})
                spool.sending = False
                continue
            self.ended = "ok" if item is None else "error"
            if item is not None:
                if self.entry is not None:
                    self.entry.error = item
                for event in sse_error_events(item):
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            break
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _read_engine(self) -> None:
        """The pump: the engine's events into the spool until the stream ends, breaks, or the client falls past
        the bound; then the pipeline is closed (the reservation freed) at once, not when the client has read."""
        spool = self.spool
        first = True
        try:
            async for event in self.events:
                wake = first and spool.writer_waiting
                first = False
                if spool.put(event) or await spool.room():
                    if wake:
                        # The woken writer sends the first event now. The engine's events that are already read
                        # wait on no I/O: without this the pump reads a fast engine's whole answer before the
                        # first write (seen: a 1,024-token stream's first token reached the client with its
                        # last). Only the first: a yield after every event cost a loaded gateway a third of the
                        # engine's tokens/s (24 chat streams/s on two cores: 2,000-2,540 against 3,640-4,160).
                        await asyncio.sleep(0)
                    continue
                error = ClientTooSlow(
                    f"The stream was cut: the client did not read its answer fast enough ({spool.buffered} "
                    f"bytes were waiting for it; the limit is {self._max_buffered} bytes)."
                )
                log.warning("stream cut: %s", error.message)
                spool.cut(error)
                break
            spool.finish()
        except GatewayError as exc:
            spool.finish(exc)
        finally:
            self._closing = True
            spool.finish()  # whatever ended the pump, the writer is not left waiting
            if isinstance(self.events, AsyncGenerator):
                await self.events.aclose()
            await self.answer.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Outside Starlette's cancel scope: the pump (reading, or closing the pipeline) is awaited here, and
            # only it closes the pipeline while it runs; then the pipeline is closed if the pump never started.
            pump = self._pump
            if pump is not None:
                if not self._closing:
                    pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
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
