"""Pipeline pieces that are hard to reach over HTTP: a stream whose client is gone before its first byte."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.config import Settings
from gateway.engine.engine import Engine
from gateway.guard import pipeline
from gateway.guard.context import Booking, Reply, RequestContext
from gateway.guard.parts import Parts
from gateway.http.relay import EventStreamResponse
from gateway.metrics import Metrics


class FakeStream:
    headers = {"content-type": "text/event-stream"}
    status = 200

    def __init__(self) -> None:
        self.closed = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"

    def close(self) -> None:
        self.closed += 1


class FakeUpstream:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream

    async def open(self, method: str, path: str, **kw: Any) -> FakeStream:
        return self.stream


class FakeReservation:
    def __init__(self) -> None:
        self.released: list[bool] = []
        self.target = None  # not placed: the gateway's one engine

    def observe_output_tokens(self, generated: int) -> None:
        pass

    def release(self, *, completed: bool = True) -> None:
        self.released.append(completed)


async def started_stream() -> tuple[EventStreamResponse, FakeStream, FakeReservation, Parts]:
    stream, reservation = FakeStream(), FakeReservation()
    parts = Parts(Settings(), Metrics(), Engine(FakeUpstream(stream), None, None), None)  # type: ignore[arg-type]
    ctx = RequestContext("r1", "chat", "/v1/chat/completions", {})
    answer = pipeline.exchange_with_engine(
        parts, ctx, b"{}", Booking(1, 1, 1, stream=True), reservation  # type: ignore[arg-type]
    )
    head = await anext(answer)
    assert isinstance(head, Reply) and head.events is not None
    return EventStreamResponse(answer, head.events, head.headers), stream, reservation, parts


async def test_a_client_gone_before_the_first_byte_still_frees_everything_once() -> None:
    response, stream, reservation, parts = await started_stream()

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("client gone")

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(Exception):  # noqa: B017 - Starlette turns the OSError into ClientDisconnect
        await response(scope, receive, send)
    assert stream.closed == 1 and reservation.released == [False]
    assert parts.metrics.in_flight._value.get() == 0


async def test_a_stream_whose_response_never_runs_is_freed_when_closed() -> None:
    response, stream, reservation, parts = await started_stream()
    await response.answer.aclose()
    assert stream.closed == 1 and reservation.released == [False]
    assert parts.metrics.in_flight._value.get() == 0


async def test_a_finished_stream_is_freed_once_as_completed() -> None:
    response, stream, reservation, _ = await started_stream()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert stream.closed == 1 and reservation.released == [True]
    assert sent[1]["body"] == b"data: {}\n\n"
