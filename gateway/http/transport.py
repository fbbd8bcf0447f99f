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
    unread bytes, and the client would often never read the answer: the protocol lingers instead.

    An answer's head is held for the write that follows it (``hold_head``): uvicorn writes a response's head and
    its body apart, two system calls where one does, and on loopback each write wakes the sleeping client inside
    the call (17 us of the head's write a chat, against 2.5 us for a body written right after it: docs/overhead.md).
    What is held goes out before any other byte, with the next write, at the close, to a stream's direct writer
    (``raw``), or at the end of the loop's turn, so nothing waits on it: a stream's head is not held back for its
    first event."""

    __slots__ = ("_held", "_hold", "_linger", "_transport")

    def __init__(self, transport: asyncio.Transport, linger: Callable[[], bool]) -> None:
        self._transport = transport
        self._linger = linger
        self._hold = False
        self._held: bytes | None = None

    @property
    def raw(self) -> asyncio.Transport:
        """The transport itself, for writes on the hottest path (a stream's events): no attribute forwarding."""
        self.flush()
        return self._transport

    def hold_head(self) -> None:
        """The next write is an answer's head: keep it for the write after it (the body, when it is whole)."""
        self._hold = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif self._hold and data:
            self._hold = False
            self._held = bytes(data)
            asyncio.get_running_loop().call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        if not self._linger():
            self._transport.close()

    def let_go(self) -> None:
        """The connection is lost: nothing lingers any more, and the protocol (whose method ``linger`` is, and which
        holds this transport) is not held from here. The pair was a reference cycle every connection, with its
        last request's cycle, that only the cyclic collector freed (~31 objects a closed connection)."""
        self._linger = _no_linger

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _no_linger() -> bool:
    return False


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
