"""The write timeout of one client connection.

A client that stops reading fills its connection's send buffer, and the transport pauses writing; a stream's
writer then waits for it. While writing is paused, a timer of ``--write-timeout`` seconds runs: when it fires
and the client has taken no byte since it was armed, the connection is aborted (what it did not read is
dropped) and the writer's wait ends. A client that took some bytes is slow, not stalled: the timer is armed
again. Only paused connections have a timer, so a client that reads costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


class WriteStall:
    __slots__ = ("_handle", "_left", "_loop", "_seconds", "_transport")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self._loop = loop
        self._seconds = seconds
        self._transport: Any = None  # asyncio.Transport, or the server's wrapper of one
        self._handle: asyncio.TimerHandle | None = None
        self._left = 0  # bytes the transport held for the client when the timer was armed

    def paused(self, transport: Any) -> None:
        self._transport = transport
        if self._handle is None:
            self._arm()

    def resumed(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self) -> None:
        self._left = self._transport.get_write_buffer_size()
        self._handle = self._loop.call_later(self._seconds, self._fire)

    def _fire(self) -> None:
        self._handle = None
        left = self._transport.get_write_buffer_size()
        if left < self._left:
            self._arm()  # the client took some bytes since: slow, not stalled
            return
        log.info("closed a connection from %s: it accepted no byte of its answer for %g seconds",
                 self._transport.get_extra_info("peername"), self._seconds)
        self._transport.abort()
