"""What the server's protocol asks of a connection's transport beyond asyncio's: a close it may take over (to
linger), and whether the client's bytes wait in the socket, not read yet."""

from __future__ import annotations

import asyncio
import select
from collections.abc import Callable
from typing import Any


class LingeringTransport:
    """The connection's transport as uvicorn sees it: ``close`` is first offered to ``linger``, which takes it
    over (True) or not. When the app answers a request whose body is still arriving (a 413 or 408 from
    ``read_body``) and uvicorn closes the connection, closing at once would make the kernel reset it over the
    unread bytes, and the client would often never read the answer: the protocol lingers instead."""

    __slots__ = ("_linger", "_transport")

    def __init__(self, transport: asyncio.Transport, linger: Callable[[], bool]) -> None:
        self._transport = transport
        self._linger = linger

    @property
    def raw(self) -> asyncio.Transport:
        """The transport itself, for writes on the hottest path (a stream's events): no attribute forwarding."""
        return self._transport

    def close(self) -> None:
        if not self._linger():
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def unread(transport: asyncio.Transport) -> bool:
    """Whether the socket holds bytes, or the client's close, that the loop has not read yet: it reads them
    later in its turn than it runs the timers already due (uvloop's order), so a loop that ran late can see
    a deadline pass over a request that came in time. A system call, for the rare timer that would close."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))
