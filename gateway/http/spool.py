"""The events of one stream read from the engine ahead of its client, bounded in bytes.

A stream's reservation follows the engine's request, not the client's reading: the engine's events are read
as they come (``relay.EventStreamResponse``'s pump) and wait here for the client, so that the blocks are given
back when the engine's stream ends, however slowly the client reads. What waits is bounded per connection
(``--max-buffered-bytes``): one event of any size may always wait (the engine's events are bounded by
``--max-stream-event-bytes``), and more beyond the bound cut the stream only when the writer is held by its
client (``sending``): a reader that got many events in one read lets the writer take them first.
"""

from __future__ import annotations

import asyncio
from collections import deque

from gateway.errors import GatewayError

# What ends a spool: None (the stream's end) or the error to tell the client.
End = GatewayError | None
_OPEN = object()


class Spool:
    """A queue of whole events between one reader (the engine's side) and one writer (the client's side)."""

    __slots__ = ("_bytes", "_end", "_events", "_limit", "_ready", "_waiting", "sending")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._events: deque[bytes] = deque()
        self._bytes = 0
        self._end: object = _OPEN
        self._ready = asyncio.Event()
        self._waiting = False  # the writer waits for an event: a set() is needed to wake it
        self.sending = False  # the writer is in a write (suspended there only while its client holds it)

    @property
    def writer_waiting(self) -> bool:
        """The writer waits for the next event (it has written everything queued so far)."""
        return self._waiting

    @property
    def buffered(self) -> int:
        """Bytes of the events waiting for the writer."""
        return self._bytes

    def put(self, event: bytes) -> bool:
        """Queue ``event``; False when what waits is past the bound (then ``room`` says whether to cut)."""
        self._events.append(event)
        self._bytes += len(event)
        if self._waiting:
            self._ready.set()
        return self._bytes <= self._limit or len(self._events) == 1

    async def room(self) -> bool:
        """Past the bound: let the writer take what it can; False when it cannot, its client holding it."""
        while self._bytes > self._limit and len(self._events) > 1:
            if self.sending:
                return False
            await asyncio.sleep(0)  # the writer, woken, runs: it empties the spool or blocks on its client
        return True

    def finish(self, end: End = None) -> None:
        """The stream ended (``end`` None) or broke (the error the client is told after the events queued)."""
        if self._end is _OPEN:
            self._end = end
        self._ready.set()

    def cut(self, error: GatewayError) -> int:
        """Drop what waits and end with ``error``, told to the client next; returns the bytes dropped."""
        dropped = self._bytes
        self._events.clear()
        self._bytes = 0
        self._end = error
        self._ready.set()
        return dropped

    async def get(self) -> bytes | End:
        """The next event, or once none is left how the stream ended."""
        while not self._events and self._end is _OPEN:
            self._ready.clear()
            self._waiting = True
            try:
                await self._ready.wait()
            finally:
                self._waiting = False
        if self._events:
            event = self._events.popleft()
            self._bytes -= len(event)
            return event
        end = self._end
        assert end is None or isinstance(end, GatewayError)
        return end
