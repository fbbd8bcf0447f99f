"""New connections taken all at once: the gateway's port accepted in bursts, not one connection a loop turn.

libuv accepts one connection per event-loop iteration since 1.45 (libuv commit 6c692ad, "unix: don't accept()
connections in a loop"), relying on the listening socket being reported ready again on the next iteration. A
compiled server's iteration takes microseconds; the gateway's, under load, takes milliseconds (every ready
request's Python work runs in it), so a burst of new connections waited in the kernel's accept queue one
iteration each: 64 clients connecting while 64 others were served waited up to ~650 ms for their first byte to be
read (wrk's maximum; the access log's durations, which start once a request is read, stayed under 110 ms), a
queue drained over ~600 ms (``ss``: 65 pending, then 59, 52, 47... every 16 ms).

``BurstAcceptor`` watches the same listening socket (a duplicate of its descriptor) and, each time it is ready,
accepts what is pending up to ``BURST`` connections, handing each to the loop as the server would
(``connect_accepted_socket`` with the server's protocol factory). uvloop's own server keeps watching too and takes
its one; whichever comes first, each connection is accepted once (the kernel's queue decides). What a client may
open stays bounded where it was: the protocol's connection cap refuses past ``--max-connections``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

# Connections accepted per readiness of the socket: enough for any burst a turn of the loop meets, few enough that
# a flood of connections cannot keep the loop accepting (the rest wait for the next turn, as before).
BURST = 128
# Out of descriptors: what the acceptor stops for, until the next readiness (the server's own accept reports it).
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class BurstAcceptor:
    """Accepts ``listener``'s pending connections in bursts for ``protocol_factory``, from ``start`` to ``stop``."""

    def __init__(self, listener: socket.socket, protocol_factory: Callable[[], asyncio.Protocol],
                 burst: int = BURST) -> None:
        self._listener = listener.dup()  # its own descriptor: the server's close and this one's stay apart
        self._listener.setblocking(False)
        self._factory = protocol_factory
        self._burst = burst
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: set[asyncio.Task[object]] = set()  # connections being handed to the loop
        self.accepted = 0  # connections this acceptor took (the server takes the others)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._listener.fileno(), self.accept_pending)

    def accept_pending(self) -> None:
        """Take up to ``burst`` pending connections (called when the socket is ready)."""
        loop = self._loop
        if loop is None:
            return
        for _ in range(self._burst):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return  # none left: the server's watcher or an earlier burst took them
            except ConnectionAbortedError:
                continue  # the client gave up before it was taken
            except OSError as exc:
                if exc.errno not in _EXHAUSTED:
                    log.warning("accepting a connection failed: %s", exc)
                return
            conn.setblocking(False)
            self.accepted += 1
            task: asyncio.Task[object] = loop.create_task(self._open(loop, conn))
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)

    async def _open(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> object:
        # The loop it was taken on, passed in: ``stop`` may come before the task runs, and the connection is served.
        try:
            return await loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:  # reset before the loop took it: nothing of it to serve
            log.debug("an accepted connection closed before it was served: %s", exc)
            conn.close()
            return None

    def stop(self) -> None:
        """Stop accepting (before the server's shutdown closes the port). Connections taken are served on, those
        being handed to the loop included (their tasks end within a turn; the server's shutdown then waits for
        their requests)."""
        if self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._loop = None
        self._listener.close()
