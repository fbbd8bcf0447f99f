"""An engine's stream without a network, for the relay's tests: its pieces handed to the sink the relay attaches,
one per turn of the loop, each a read of its own (or all at once, as from one large read), then its end or its
break."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.engine.wire import Sink
from gateway.errors import GatewayError


class FakeStream:
    status = 200

    def __init__(
        self, pieces: list[bytes], fail: GatewayError | None = None, encoding: str | None = None, *,
        one_read: bool = False, content_type: str = "text/event-stream",
    ) -> None:
        self.pieces, self.fail = pieces, fail
        self.one_read = one_read
        self.headers = {"content-type": content_type}
        if encoding is not None:
            self.headers["content-encoding"] = encoding
        self.closed = 0
        self.read = 0  # pieces handed over
        self.reading = asyncio.Event()  # set once ten pieces were handed over
        self.ended = asyncio.Event()  # the engine's side is over: ended, broke or was closed
        self._task: asyncio.Task[None] | None = None

    def attach(self, sink: Sink) -> None:
        self._task = asyncio.get_running_loop().create_task(self._feed(sink))

    async def _feed(self, sink: Sink) -> None:
        for piece in self.pieces:
            if self.closed:
                return
            self.read += 1
            if self.read == 10:
                self.reading.set()
            sink.body(piece)
            if not self.one_read:
                sink.flush()  # a read of its own, parsed: as the connection does after each read
                await asyncio.sleep(0)
        if self.one_read and not self.closed:
            sink.flush()
        if not self.closed:
            sink.end(self.fail)
        self.ended.set()

    async def chunks(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece
        if self.fail is not None:
            raise self.fail

    def close(self) -> None:
        self.closed += 1
        self.ended.set()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()


class FakeReservation:
    """What the relay teaches and frees: the counts it observed, each release and whether it completed."""

    def __init__(self) -> None:
        self.observed: list[int] = []
        self.released: list[bool] = []
        self.sends = 0  # times the exchange said it was writing the request to the engine
        self.target = None  # not placed: the gateway's one engine

    @property
    def generated(self) -> int:
        return self.observed[-1] if self.observed else 0

    def observe_output_tokens(self, generated: int, first_token_s: float | None = None) -> None:
        self.observed.append(generated)

    def sent(self) -> None:
        self.sends += 1

    def release(self, *, completed: bool = True) -> None:
        self.released.append(completed)


class FakeUpstream:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream

    async def open(self, method: str, path: str, **kw: object) -> FakeStream:
        return self.stream
