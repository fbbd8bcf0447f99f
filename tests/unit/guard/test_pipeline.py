"""Director pieces that are hard to reach over HTTP: a stream whose client is gone before its first byte."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.config import Settings
from gateway.guard.parts import Parts
from gateway.http.relay import RelayResponse, StreamRelay
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


class FakeReservation:
    def __init__(self) -> None:
        self.released: list[bool] = []

    def observe_output_tokens(self, generated: int) -> None:
        pass

    def release(self, *, completed: bool = True) -> None:
        self.released.append(completed)


def parts() -> Parts:
    metrics = Metrics()
    metrics.in_flight.inc()
    return Parts(Settings(), metrics, None, None, None)  # type: ignore[arg-type]


async def test_a_client_gone_before_the_first_byte_still_frees_everything_once() -> None:
    p, stream, reservation = parts(), FakeStream(), FakeReservation()
    response = RelayResponse(StreamRelay(p, "chat", stream, reservation), media_type="text/event-stream")  # type: ignore[arg-type]

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("client gone")

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(Exception):  # noqa: B017 - Starlette turns the OSError into ClientDisconnect
        await response(scope, receive, send)
    assert stream.closed == 1 and reservation.released == [False]
    assert p.metrics.in_flight._value.get() == 0


async def test_a_finished_stream_is_freed_once_as_completed() -> None:
    p, stream, reservation = parts(), FakeStream(), FakeReservation()
    sent: list[dict[str, Any]] = []
    response = RelayResponse(StreamRelay(p, "chat", stream, reservation), media_type="text/event-stream")  # type: ignore[arg-type]

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert stream.closed == 1 and reservation.released == [True]
    assert sent[1]["body"] == b"data: {}\n\n"
