"""Pipeline pieces that are hard to reach over HTTP: a stream whose client is gone before its first byte; the model
listing while the first engine has not come up."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import Settings
from gateway.engine.engine import Engine
from gateway.engine.vllm_api import ModelList, ServedModel
from gateway.errors import UpstreamUnavailable
from gateway.guard import exchange, pipeline
from gateway.guard.context import Booking, RequestContext
from gateway.guard.exchange import Reply
from gateway.guard.parts import Parts
from gateway.http.relay import StreamAnswer
from gateway.http.stream_out import HeldBytes
from gateway.metrics import Metrics
from gateway.observe.tracing import OFF
from tests.support.fake_stream import FakeReservation, FakeStream, FakeUpstream


async def started_stream() -> tuple[StreamAnswer, FakeStream, FakeReservation, Parts]:
    stream, reservation = FakeStream([b"data: {}\n\n"]), FakeReservation()
    parts = Parts(Settings(), Metrics(), Engine(FakeUpstream(stream), None, None), None)  # type: ignore[arg-type]
    ctx = RequestContext("r1", "chat", "/v1/chat/completions", {})
    answer = exchange.exchange_with_engine(
        parts, ctx, b"{}", Booking(1, 1, 1, stream=True), reservation  # type: ignore[arg-type]
    )
    head = await anext(answer)
    assert isinstance(head, Reply) and head.stream is not None
    return StreamAnswer(answer, head.stream, head.headers, HeldBytes(1 << 30), OFF), stream, reservation, parts


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


class FakeModels:
    def __init__(self, listing: ModelList | None) -> None:
        self.listing = listing
        self.asked = 0

    async def info(self) -> ModelList:
        self.asked += 1
        if self.listing is None:
            raise UpstreamUnavailable("The upstream is unreachable.", retry_after=5)
        return self.listing


class FakeEngine:
    def __init__(self, listing: ModelList | None) -> None:
        self.models = FakeModels(listing)


def parts_with(*listings: ModelList | None) -> Parts:
    engines = [FakeEngine(listing) for listing in listings]
    return Parts(Settings(), Metrics(), engines[0], None, engines=engines)  # type: ignore[arg-type]


LISTING = ModelList((ServedModel("tiny", "tiny", 2048),))


@pytest.mark.parametrize(
    ("listings", "served"),
    [
        ((LISTING, None), LISTING),  # the first engine's own
        ((None, LISTING), LISTING),  # the first has not come up: the second's stands in
        ((None, None, LISTING), LISTING),
    ],
)
async def test_the_model_listing_comes_from_the_first_engine_that_can_give_one(
    listings: tuple[ModelList | None, ...], served: ModelList
) -> None:
    assert await pipeline.served_listing(parts_with(*listings)) == served


async def test_with_no_engine_up_the_first_engines_failure_is_told() -> None:
    parts = parts_with(None, None)
    with pytest.raises(UpstreamUnavailable, match="unreachable"):
        await pipeline.served_listing(parts)
    assert [e.models.asked for e in parts.engines] == [1, 1]  # type: ignore[attr-defined]
