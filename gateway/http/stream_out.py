"""Writing a guarded stream's events to its client, and bounding what waits for slow readers.

``DirectOut`` writes each batch of events straight to the client's transport, one HTTP chunk per event (clients
that parse one event per read, as vLLM writes them, see whole events) and one write for the batch, from the
engine's read callback: no ASGI message, task or queue per event. What the client has not read yet waits in its
transport's buffer; a client that lets more than ``--max-buffered-bytes`` wait is cut (``ClientTooSlow``), and
so are the largest holders first when all clients together hold more than ``--max-total-buffered-bytes``
(``HeldBytes``): the gateway's memory for slow readers stays bounded however many there are.

Under a server other than the gateway's own (``server.GuardProtocol`` puts its connection in the scope), events
go through ASGI's ``send`` from a writer task instead (``QueueOut``), under the same bounds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from starlette.types import Send

from gateway.errors import ClientTooSlow, GatewayError

log = logging.getLogger(__name__)

# The scope's extension through which the gateway's server hands a request's connection to its stream.
CONNECTION = "vllm_guard.connection"


class ConnectionLink:
    """``scope["extensions"][CONNECTION]``: the request's protocol and its request-response cycle, unpacked as a
    pair (``protocol, cycle = link``), both held weakly. The cycle holds the scope, so a pair held strongly made
    every request a reference cycle that only the cyclic collector freed (11 objects a short chat, most of what a
    request left it). While the app runs, its task holds the cycle, and the cycle its protocol's callbacks."""

    __slots__ = ("_cycle", "_protocol")

    def __init__(self, protocol: object, cycle: object) -> None:
        self._protocol, self._cycle = weakref.ref(protocol), weakref.ref(cycle)

    def __iter__(self) -> Iterator[Any]:
        return iter((self._protocol(), self._cycle()))


def too_slow(waiting: int, limit: int, what: str = "the limit") -> ClientTooSlow:
    return ClientTooSlow(
        f"The stream was cut: the client did not read its answer fast enough ({waiting} bytes were waiting for "
        f"it; {what} is {limit} bytes)."
    )


class HeldBytes:
    """Bytes waiting for slow readers, summed over every stream of the process, and the bound on them. Each
    stream's share is what its transport held after its last write (it only shrinks as the client reads, so the
    sum is an upper bound); past the bound the largest holders are cut and their connections closed, which drops
    what they held. A stream cut by its own bound (``--max-buffered-bytes``) writes nothing more, but its
    transport keeps what it held until the client reads it (the error event comes after) or the connection
    closes: it stays in the sum until then, so the bound is on memory, not only on the streams still running."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._held: dict[Held, int] = {}

    def note(self, holder: Held, size: int) -> None:
        if not size and holder not in self._held:
            return  # the usual case: a client that keeps up holds nothing
        self.total += size - self._held.get(holder, 0)
        self._held[holder] = size
        if self.total > self.limit:
            self._cut_largest()

    def forget(self, holder: Held) -> None:
        self.total -= self._held.pop(holder, 0)

    def __len__(self) -> int:
        return len(self._held)

    def sweep(self) -> None:
        """Forget the holders that hold nothing any more (cut streams whose clients read, or whose connections
        closed): run as a cut stream ends, so that the sum never keeps a closed connection for long."""
        for holder in [h for h in self._held if h.waiting() <= 0]:
            self.forget(holder)

    def _cut_largest(self) -> None:
        for holder, size in sorted(self._held.items(), key=lambda item: -item[1]):
            if self.total <= self.limit:
                break
            actual = holder.waiting()  # what it really holds now: it may have read since, or be gone
            self.total += actual - size
            self._held[holder] = actual
            if actual <= 0:
                self.forget(holder)
            elif self.total > self.limit:
                # Cut (its engine request cancelled, its end recorded), then closed: only closing the connection
                # lets go of what its transport holds.
                self.forget(holder)
                if not holder.is_cut():
                    holder.cut(too_slow(actual, self.limit, "the limit for all streams together"))
                holder.drop()


class Held:
    """A stream that holds bytes for its client (the ``HeldBytes`` side of a writer)."""

    __slots__ = ()

    def waiting(self) -> int:
        raise NotImplementedError

    def is_cut(self) -> bool:
        raise NotImplementedError

    def cut(self, error: GatewayError) -> None:
        raise NotImplementedError

    def drop(self) -> None:
        """Let go of what is held now: the connection closes (a cut stream still held the most)."""
        raise NotImplementedError


class DirectOut(Held):
    """A stream's events written straight to its client's transport."""

    __slots__ = ("_buffered", "_chunked", "_cut", "_cycle", "_held", "_limit", "_noted", "_transport", "_write",
                 "first_at", "on_cut")

    def __init__(self, cycle: Any, limit: int, held: HeldBytes) -> None:
        self._cycle = cycle  # uvicorn's request-response cycle: its transport, its framing, its disconnect
        self._transport = transport = getattr(cycle.transport, "raw", cycle.transport)  # unwrapped
        self._write, self._buffered = transport.write, transport.get_write_buffer_size
        self._chunked = bool(cycle.chunked_encoding)
        self._limit = limit
        self._held = held
        self._cut = False
        self._noted = False  # told to the sum once: from then on every write tells it what waits
        self.first_at: float | None = None  # when the first event was written (perf_counter)
        self.on_cut: Callable[[GatewayError], None] | None = None  # the stream's end, when the bound cuts it

    def send(self, events: list[bytes]) -> None:
        if self._cut or self._cycle.disconnected:
            return
        if self.first_at is None:
            self.first_at = time.perf_counter()
        if len(events) == 1:
            data = b"%x\r\n%s\r\n" % (len(events[0]), events[0]) if self._chunked else events[0]
        elif self._chunked:
            data = b"".join([b"%x\r\n%s\r\n" % (len(e), e) for e in events])
        else:
            data = b"".join(events)
        self._write(data)
        waiting = self._buffered()
        if waiting > self._limit:
            self._cut = True
            self._held.note(self, waiting)  # still held by the transport: counted until it is read or dropped
            raise too_slow(waiting, self._limit)
        if waiting or self._noted:  # a client that keeps up holds nothing, and is never in the sum
            self._noted = True
            self._held.note(self, waiting)

    def waiting(self) -> int:
        return 0 if self._transport.is_closing() else int(self._transport.get_write_buffer_size())

    def is_cut(self) -> bool:
        return self._cut

    def cut(self, error: GatewayError) -> None:
        self._cut = True
        if self.on_cut is not None:
            self.on_cut(error)

    def drop(self) -> None:
        self._cut = True
        self._transport.abort()

    def close(self) -> None:
        """The stream is over: what its transport still holds for a cut stream stays counted (until the client
        reads it, the connection closes, or the bound drops it); anything else leaves the sum."""
        if self._cut and self.waiting() > 0:
            self._held.note(self, self.waiting())
            self._held.sweep()
        else:
            self._held.forget(self)


class QueueOut(Held):
    """A stream's events through ASGI's ``send``, from a writer task (a server without direct writes)."""

    def __init__(self, send: Send, limit: int, held: HeldBytes) -> None:
        self._send = send
        self._limit = limit
        self._held = held
        self._queue: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._wake = asyncio.Event()
        self._cut = False
        self._closing = False
        self._sending = False  # the writer is in a send: held there only while its client does not read
        self._writer = asyncio.get_running_loop().create_task(self._write(), name="stream-writer")
        self.first_at: float | None = None
        self.on_cut: Callable[[GatewayError], None] | None = None

    def send(self, events: list[bytes]) -> None:
        if self._cut:
            return
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self._queue.extend(events)
        self._size += sum(len(e) for e in events)
        self._wake.set()
        # Cut only while the client holds the writer (events from one large read may pass a reading client's
        # bound for a moment), and never for one event alone: one event of any size may always wait.
        if self._sending and self._queue and self._size > self._limit:
            self._cut = True
            self._queue.clear()
            self._held.forget(self)
            raise too_slow(self._size, self._limit)
        self._held.note(self, self._size)

    async def _write(self) -> None:
        while True:
            while self._queue:
                event = self._queue.popleft()
                self._sending = True
                await self._send({"type": "http.response.body", "body": event, "more_body": True})
                self._sending = False
                self._size -= len(event)
                self._held.note(self, self._size)
            if self._closing:
                return
            await self._wake.wait()
            self._wake.clear()

    async def drain(self) -> None:
        """Write what waits (the stream is over), then stop the writer."""
        self._closing = True
        self._wake.set()
        try:
            await self._writer
        finally:
            self._held.forget(self)

    async def stop(self) -> None:
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer
        self._held.forget(self)

    def waiting(self) -> int:
        return self._size

    def is_cut(self) -> bool:
        return self._cut

    def cut(self, error: GatewayError) -> None:
        self._cut = True
        self._queue.clear()
        if self.on_cut is not None:
            self.on_cut(error)

    def drop(self) -> None:
        self.cut(too_slow(0, self._limit))

    def close(self) -> None:
        self._held.forget(self)
