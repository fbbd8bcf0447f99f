"""The write timeout of one client connection, and what a starved host owes a connection's other timeouts.

A client that stops reading fills its connection's send buffer, and the transport pauses writing; a stream's
writer then waits for it. While writing is paused, a timer of ``--write-timeout`` seconds runs: when it fires
and the client has taken no byte since it was armed, the connection is aborted (what it did not read is
dropped) and the writer's wait ends. A client that took some bytes is slow, not stalled: the timer is armed
again. Only paused connections have a timer, so a client that reads costs nothing.

A client that cannot read is not one that will not. On a busy host (a CPU hog beside the engine and the client)
the client's process may not run for seconds at a time, and the gateway's own loop runs late too; vLLM alone
has no write timeout and waits for it. So the timer judges only what the client could have done:

- bytes the client took that the late loop has not yet moved from the transport's buffer to the socket count as
  taken: a socket with room to write means the client read (``writable``);
- seconds in which the host starved runnable work of a CPU are not counted against the client
  (``starved.owed``), up to ``starved.STRETCH`` times the timeout in all: a client that stops reading on a busy
  host is still cut, later; on an idle host nothing changes.
"""

from __future__ import annotations

import asyncio
import logging
import select
from collections.abc import Callable
from typing import Any

from gateway.http.starved import STRETCH, Share, owed

log = logging.getLogger(__name__)


def due(since: float, deadline: float, now: float, stretch: float = STRETCH) -> float:
    """When a connection's wait that began at ``since`` (a fresh connection's or a head's, from
    ``--header-timeout``; a body's) ends, given that its ``deadline`` passed at ``now``: later by what a starved
    host owes its client (``starved.owed``). A deadline still ahead stays. (The server's idle wait after an answer
    is judged as if it had lasted --header-timeout: a starved host adds a few seconds to the keep-alive at most.)"""
    return deadline if deadline > now else now + owed(deadline - since, now - since, stretch=stretch)


def writable(transport: Any) -> bool:
    """Whether the connection's socket has room for more bytes: the client took some, and a loop that runs late
    has not yet written more (uvloop runs the timers due before it polls for writes)."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    return bool(poller.poll(0))


class WriteStall:
    """``share`` (the host's starved share of a window) and ``ready`` (the socket has room) are injectable for
    tests; by default (None) the host's CPU pressure and a poll of the socket."""

    __slots__ = ("_handle", "_left", "_loop", "_ready", "_seconds", "_share", "_since", "_stretch", "_transport")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float, *, share: Share | None = None,
                 ready: Callable[[Any], bool] = writable, stretch: float = STRETCH) -> None:
        self._loop = loop
        self._seconds = seconds
        self._share = share
        self._stretch = stretch
        self._ready = ready
        self._transport: Any = None  # asyncio.Transport, or the server's wrapper of one
        self._handle: asyncio.TimerHandle | None = None
        self._left = 0  # bytes the transport held for the client when the timer was armed
        self._since = 0.0  # loop time the timer was armed: the client's last progress seen

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
        self._since = self._loop.time()
        self._handle = self._loop.call_later(self._seconds, self._fire)

    def _fire(self) -> None:
        self._handle = None
        left = self._transport.get_write_buffer_size()
        if left < self._left or self._ready(self._transport):
            self._arm()  # the client took some bytes since: slow, not stalled
            return
        elapsed = self._loop.time() - self._since
        more = owed(self._seconds, elapsed, self._share, self._stretch)
        if more > 0:
            # The host kept work from running for part of the wait: the client gets that time back, still
            # judged from its last progress.
            self._handle = self._loop.call_later(more, self._fire)
            return
        log.info("closed a connection from %s: it accepted no byte of its answer for %.0f seconds",
                 self._transport.get_extra_info("peername"), elapsed)
        self._transport.abort()
