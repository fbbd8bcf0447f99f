"""A guarded stream follows the engine, not its client: the engine's events are read as they come and wait for
a slow client bounded in bytes, the reservation is given back when the engine's stream ends, a client that
lets more than the bound wait is cut with an error event, and past the bound for all streams together the
largest holders are cut first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import orjson
import pytest

from gateway.config import Settings
from gateway.engine.engine import Engine
from gateway.engine.wire import Sink
from gateway.errors import GatewayError, UpstreamUnavailable
from gateway.guard import exchange
from gateway.guard.context import Booking, RequestContext
from gateway.guard.exchange import Reply
from gateway.guard.parts import Parts
from gateway.http.relay import StreamAnswer
from gateway.http.stream_out import CONNECTION, Held, HeldBytes
from gateway.metrics import Metrics
from gateway.observe.tracing import OFF
from tests.support.fake_stream import FakeReservation, FakeStream, FakeUpstream

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}}
EVENTS = [b"data: " + b"%04d" % i + b"x" * 88 + b"\n\n" for i in range(50)]  # 100 bytes each


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


async def started(
    stream: FakeStream, client: Client, limit: int, held: HeldBytes | None = None
) -> tuple[asyncio.Task[None], FakeReservation]:
    reservation = FakeReservation()
    parts = Parts(Settings(), Metrics(), Engine(FakeUpstream(stream), None, None), None)  # type: ignore[arg-type]
    ctx = RequestContext("r1", "chat", "/v1/chat/completions", {})
    answer: AsyncGenerator[Reply, None] = exchange.exchange_with_engine(
        parts, ctx, b"{}", Booking(1, 1, 1, stream=True), reservation  # type: ignore[arg-type]
    )
    head = await anext(answer)
    assert head.stream is not None
    response = StreamAnswer(answer, head.stream, {}, held or HeldBytes(1 << 30), OFF, limit)
    return asyncio.create_task(response(SCOPE, client.receive, client.send)), reservation


async def test_the_reservation_is_given_back_when_the_engine_is_done_though_the_client_reads_nothing() -> None:
    stream, client = FakeStream(EVENTS), Client(reads=False)
    task, reservation = await started(stream, client, limit=64 * 1024)
    await asyncio.wait_for(stream.ended.wait(), 2)
    await asyncio.sleep(0)
    assert stream.read == len(EVENTS) and client.got == [] and reservation.released == [True]
    client.reading.set()  # the client reads at last: it gets the whole answer
    await asyncio.wait_for(task, 2)
    assert client.got == EVENTS and client.ended


async def test_a_client_that_lets_more_than_the_bound_wait_is_cut_with_an_error_event() -> None:
    stream, client = FakeStream(EVENTS), Client(reads=False)
    task, reservation = await started(stream, client, limit=1000)
    await asyncio.wait_for(stream.ended.wait(), 2)
    assert stream.read < len(EVENTS) and stream.closed  # the engine's request was cancelled
    assert reservation.released == [False]
    client.reading.set()
    await asyncio.wait_for(task, 2)
    *events, error, done = client.got
    assert len(events) <= 1 and done == b"data: [DONE]\n\n"
    err = orjson.loads(error[6:])["error"]
    assert err["code"] == "client_too_slow" and "1000 bytes" in err["message"]


async def test_many_events_from_one_read_past_the_bound_reach_a_client_that_reads() -> None:
    stream, client = FakeStream(EVENTS, one_read=True), Client(reads=True)
    task, _ = await started(stream, client, limit=1000)
    await asyncio.wait_for(task, 2)
    assert client.got == EVENTS  # the writer took them before anything was cut


class DirectClient:
    """The gateway's own server's side of a stream: the client's transport, written to straight from the engine's
    reads (``stream_out.DirectOut``), recording each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.transport = self
        self.chunked_encoding = False
        self.disconnected = False

    # the transport
    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    # the protocol
    def on_lost(self, callback: object) -> None:
        pass


@pytest.mark.parametrize(("one_read", "writes"), [
    pytest.param(True, 1, id="the events of one read: one write"),
    pytest.param(False, 6, id="each event a read of its own: a write each"),
])  # fmt: skip
async def test_a_direct_stream_writes_the_events_of_one_read_in_one_write(one_read: bool, writes: int) -> None:
    stream, client = FakeStream(EVENTS[:6], one_read=one_read), DirectClient()
    parts = Parts(Settings(), Metrics(), Engine(FakeUpstream(stream), None, None), None)  # type: ignore[arg-type]
    answer: AsyncGenerator[Reply, None] = exchange.exchange_with_engine(
        parts, RequestContext("r1", "chat", "/v1/chat/completions", {}), b"{}", Booking(1, 1, 1, stream=True),
        FakeReservation(),  # type: ignore[arg-type]
    )
    head = await anext(answer)
    assert head.stream is not None
    scope = {**SCOPE, "extensions": {CONNECTION: (client, client)}}
    await asyncio.wait_for(StreamAnswer(answer, head.stream, {}, HeldBytes(1 << 30), OFF)(scope, Client(True).receive,
                                                                                             Client(True).send), 2)
    assert len(client.writes) == writes and b"".join(client.writes) == b"".join(EVENTS[:6])


class HeldUntilRead(FakeStream):
    """An engine stream whose head came before any of its bytes (vLLM sends the head before the first token):
    attached, it has nothing to hand over yet, as the connection's exchange flushes then; ``read`` delivers one
    read."""

    def attach(self, sink: Sink) -> None:
        self.sink = sink
        sink.flush()

    def deliver(self, *events: bytes) -> None:
        for event in events:
            self.sink.body(event)
        self.sink.flush()


async def test_a_stream_attached_before_its_first_bytes_is_neither_movement_nor_progress() -> None:
    stream, client, reservation = HeldUntilRead([]), DirectClient(), FakeReservation()
    engine = Engine(FakeUpstream(stream), None, None)  # type: ignore[arg-type]
    parts = Parts(Settings(), Metrics(), engine, None)
    answer: AsyncGenerator[Reply, None] = exchange.exchange_with_engine(
        parts, RequestContext("r1", "chat", "/v1/chat/completions", {}), b"{}", Booking(1, 1, 1, stream=True),
        reservation,  # type: ignore[arg-type]
    )
    head = await anext(answer)
    assert head.stream is not None
    scope = {**SCOPE, "extensions": {CONNECTION: (client, client)}}
    before = engine.progress._events
    task = asyncio.create_task(StreamAnswer(answer, head.stream, {}, HeldBytes(1 << 30), OFF)(
        scope, Client(True).receive, Client(True).send))
    await asyncio.sleep(0)
    # A frozen engine's API server still sends heads: they never say it moved.
    assert (engine.progress._events, reservation.observed, client.writes) == (before, [], [])
    stream.deliver(EVENTS[0])
    assert (engine.progress._events, reservation.observed, client.writes) == (before + 1, [0], [EVENTS[0]])
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_one_event_larger_than_the_bound_reaches_a_client_that_reads() -> None:
    big = b"data: " + b"y" * 5000 + b"\n\n"
    stream, client = FakeStream([big, *EVENTS[:3]]), Client(reads=True)
    task, _ = await started(stream, client, limit=1000)
    await asyncio.wait_for(task, 2)
    assert client.got == [big, *EVENTS[:3]]


async def test_an_engine_break_is_told_after_the_events_it_sent() -> None:
    stream = FakeStream(EVENTS[:2], fail=UpstreamUnavailable("The upstream dropped the stream: reset"))
    client = Client(reads=True)
    task, reservation = await started(stream, client, limit=64 * 1024)
    await asyncio.wait_for(task, 2)
    assert client.got[:2] == EVENTS[:2]
    assert orjson.loads(client.got[2][6:])["error"]["code"] == "upstream_unavailable"
    assert reservation.released == [False]


async def test_a_client_gone_mid_stream_aborts_the_engines_request_and_frees_everything() -> None:
    stream, client = FakeStream([*EVENTS] * 100), Client(reads=False)
    task, reservation = await started(stream, client, limit=10**9)
    await asyncio.wait_for(stream.reading.wait(), 2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert stream.closed and stream.read < len(EVENTS) * 100 and reservation.released == [False]


class Holder(Held):
    def __init__(self, name: str, size: int, cuts: list[str]) -> None:
        self.name, self.size, self.cuts = name, size, cuts
        self.was_cut = self.dropped = False

    def waiting(self) -> int:
        return 0 if self.dropped else self.size

    def is_cut(self) -> bool:
        return self.was_cut

    def cut(self, error: GatewayError) -> None:
        assert error.code == "client_too_slow"
        self.was_cut = True
        self.cuts.append(self.name)

    def drop(self) -> None:
        self.dropped = True


def test_past_the_bound_for_all_streams_the_largest_holders_are_cut_first() -> None:
    held, cuts = HeldBytes(1000), []
    small, middle, large = (Holder(n, s, cuts) for n, s in (("small", 200), ("middle", 300), ("large", 450)))
    for holder in (small, middle, large):
        held.note(holder, holder.size)
    assert cuts == [] and held.total == 950
    middle.size = 400
    held.note(middle, 400)  # 1,050: the largest goes
    assert cuts == ["large"] and held.total == 600
    assert large.dropped and not (middle.dropped or small.dropped)


def test_a_stream_cut_by_its_own_bound_counts_until_its_bytes_are_read_or_dropped() -> None:
    held, cuts = HeldBytes(1000), []
    stuck, other = Holder("stuck", 700, cuts), Holder("other", 200, cuts)
    stuck.was_cut = True  # cut by --max-buffered-bytes: it writes no more, but its transport still holds 700
    held.note(stuck, 700)
    held.note(other, 200)
    assert held.total == 900 and cuts == []
    other.size = 400
    held.note(other, 400)  # 1,100: the stuck stream holds the most; its connection is closed, its bytes dropped
    assert stuck.dropped and cuts == [] and held.total == 400


def test_holders_whose_bytes_are_gone_are_swept_from_the_sum() -> None:
    held, cuts = HeldBytes(1000), []
    gone, live = Holder("gone", 300, cuts), Holder("live", 100, cuts)
    held.note(gone, 300)
    held.note(live, 100)
    gone.size = 0  # its client read it all, or its connection closed
    held.sweep()
    assert held.total == 100 and len(held) == 1


def test_a_holder_that_read_since_its_last_write_is_counted_as_it_is_now() -> None:
    held, cuts = HeldBytes(1000), []
    reader, writer = Holder("reader", 900, cuts), Holder("writer", 200, cuts)
    held.note(reader, 900)
    reader.size = 0  # it read everything since
    held.note(writer, 200)
    assert cuts == [] and held.total == 200


def test_a_client_that_keeps_up_holds_nothing() -> None:
    held, cuts = HeldBytes(1000), []
    held.note(Holder("quick", 0, cuts), 0)
    assert held.total == 0 and cuts == []


def test_the_connections_link_unpacks_as_the_pair_and_keeps_neither_alive() -> None:
    """The link sits in the cycle's own scope: held strongly, the pair made every request a reference cycle."""
    import gc
    import weakref

    from gateway.http.stream_out import ConnectionLink

    class Cycle:
        def __init__(self) -> None:
            self.scope: dict[str, object] = {}

    class Protocol:
        pass

    protocol, cycle = Protocol(), Cycle()
    cycle.scope["link"] = link = ConnectionLink(protocol, cycle)
    got_protocol, got_cycle = link
    assert (got_protocol, got_cycle) == (protocol, cycle)
    gone = weakref.ref(cycle)
    del got_cycle, cycle, link
    gc.disable()
    try:
        assert gone() is None, "freed by reference counting alone"
    finally:
        gc.enable()
