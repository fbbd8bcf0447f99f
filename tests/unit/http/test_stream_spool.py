"""A guarded stream follows the engine, not its client: the engine's events are read ahead of a slow client
into a spool bounded in bytes, the pipeline (and with it the reservation) is closed when the engine's stream
ends, and a client that lets more than the bound wait is cut with an error event."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from gateway.errors import UpstreamUnavailable
from gateway.guard.context import Reply
from gateway.http.relay import EventStreamResponse
from gateway.http.spool import Spool

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}}


class Engine:
    """The engine's side of one stream: its events, and whether the pipeline holding its reservation closed."""

    def __init__(self, events: list[bytes], fail: Exception | None = None, *, one_read: bool = False) -> None:
        self.events, self.fail = events, fail
        self.one_read = one_read  # every event at once, as from one large read of the upstream
        self.read = 0
        self.reading = asyncio.Event()  # set once ten events were read
        self.ended = asyncio.Event()  # the pipeline closed: the reservation was given back
        self.stream_closed = False

    async def stream(self) -> AsyncGenerator[bytes, None]:
        try:
            for event in self.events:
                self.read += 1
                if self.read == 10:
                    self.reading.set()
                yield event
                if not self.one_read:
                    await asyncio.sleep(0)
            if self.fail is not None:
                raise self.fail
        finally:
            self.stream_closed = True

    async def answer(self) -> AsyncGenerator[Reply, None]:
        try:
            yield Reply({}, events=None)
        finally:
            self.ended.set()


class Client:
    """A client whose reading is held until ``reading`` is set."""

    def __init__(self, reads: bool) -> None:
        self.reading = asyncio.Event()
        if reads:
            self.reading.set()
        self.got: list[bytes] = []
        self.ended = False

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            return
        await self.reading.wait()
        if message.get("body"):
            self.got.append(message["body"])
        if not message.get("more_body", False):
            self.ended = True

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # the client stays
        return {}


async def started(engine: Engine, client: Client, limit: int) -> asyncio.Task[None]:
    answer = engine.answer()
    await anext(answer)
    response = EventStreamResponse(answer, engine.stream(), {}, limit)
    return asyncio.create_task(response(SCOPE, client.receive, client.send))


EVENTS = [b"data: " + b"%04d" % i + b"x" * 88 + b"\n\n" for i in range(50)]  # 100 bytes each


async def test_the_reservation_is_given_back_when_the_engine_is_done_though_the_client_reads_nothing() -> None:
    engine, client = Engine(EVENTS), Client(reads=False)
    task = await started(engine, client, limit=64 * 1024)
    await asyncio.wait_for(engine.ended.wait(), 2)
    assert engine.read == len(EVENTS) and client.got == []
    client.reading.set()  # the client reads at last: it gets the whole answer
    await asyncio.wait_for(task, 2)
    assert client.got == EVENTS and client.ended


async def test_a_client_that_lets_more_than_the_bound_wait_is_cut_with_an_error_event() -> None:
    engine, client = Engine(EVENTS), Client(reads=False)
    task = await started(engine, client, limit=1000)
    await asyncio.wait_for(engine.ended.wait(), 2)
    assert engine.read < len(EVENTS) and engine.stream_closed  # the engine's request was cancelled
    client.reading.set()
    await asyncio.wait_for(task, 2)
    *events, error, done = client.got
    assert len(events) <= 1 and done == b"data: [DONE]\n\n"
    err = orjson.loads(error[6:])["error"]
    assert err["code"] == "client_too_slow" and "1000 bytes" in err["message"]


async def test_many_events_from_one_read_past_the_bound_reach_a_client_that_reads() -> None:
    engine, client = Engine(EVENTS, one_read=True), Client(reads=True)
    await asyncio.wait_for(await started(engine, client, limit=1000), 2)
    assert client.got == EVENTS  # the writer took them before anything was cut


async def test_a_fast_engines_events_reach_a_reading_client_as_they_are_read() -> None:
    # Events already read from the upstream wait on no I/O: the writer must still get each one before the pump
    # reads the rest, or the first token reaches the client with the last.
    engine, client = Engine(EVENTS, one_read=True), Client(reads=True)
    read_at_each_write: list[int] = []
    send = client.send

    async def recording(message: dict[str, Any]) -> None:
        if message.get("body"):
            read_at_each_write.append(engine.read)
        await send(message)

    client.send = recording  # type: ignore[method-assign]
    await asyncio.wait_for(await started(engine, client, limit=64 * 1024), 2)
    assert client.got == EVENTS
    assert read_at_each_write[0] <= 2, read_at_each_write


async def test_one_event_larger_than_the_bound_reaches_a_client_that_reads() -> None:
    big = b"data: " + b"y" * 5000 + b"\n\n"
    engine, client = Engine([big, *EVENTS[:3]]), Client(reads=True)
    await asyncio.wait_for(await started(engine, client, limit=1000), 2)
    assert client.got == [big, *EVENTS[:3]]


async def test_an_engine_break_is_told_after_the_events_it_sent() -> None:
    engine = Engine(EVENTS[:2], fail=UpstreamUnavailable("The upstream dropped the stream: reset"))
    client = Client(reads=True)
    await asyncio.wait_for(await started(engine, client, limit=64 * 1024), 2)
    assert client.got[:2] == EVENTS[:2]
    assert orjson.loads(client.got[2][6:])["error"]["code"] == "upstream_unavailable"
    assert engine.ended.is_set()


async def test_a_client_gone_mid_stream_cancels_the_pump_and_frees_everything() -> None:
    engine, client = Engine([*EVENTS] * 100), Client(reads=False)
    task = await started(engine, client, limit=10**9)
    await asyncio.wait_for(engine.reading.wait(), 2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert engine.ended.is_set() and engine.stream_closed and engine.read < len(EVENTS) * 100


async def test_the_spool_counts_what_waits_and_drops_it_when_cut() -> None:
    spool = Spool(250)
    assert spool.put(EVENTS[0]) and spool.put(EVENTS[1])
    assert not spool.put(EVENTS[2])  # 300 bytes wait
    assert await spool.get() == EVENTS[0] and spool.buffered == 200
    err = UpstreamUnavailable("cut")
    assert spool.cut(err) == 200 and spool.buffered == 0
    assert await spool.get() is err
