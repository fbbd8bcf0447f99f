"""One connection between a worker and the admission authority: typed messages (``messages.py``) over a Unix socket.

Each frame is a 4-byte big-endian length and that many bytes of JSON (orjson). What one loop iteration sends
goes out in one write (``send`` queues, a ``call_soon`` flushes), so a busy worker's admits, progress and
releases share system calls. Both sides are the gateway's own code, so a frame that is not a well-formed message
is a bug, never a client's doing: a frame larger than ``MAX_MESSAGE``, not JSON, or not a message of a known kind
with fields of the right types is logged and ends the connection, which each side already handles whole (the
authority gives back everything the worker held, the worker refuses what waits and stops). Only a malformed
message that nothing waits on and nothing counts by (an access-log line, a rejection's tally) is dropped alone.
A handler never sees a malformed message, and no waiter is left hanging on one that was dropped.

What the peer does not read is bounded too: past ``MAX_BACKLOG`` bytes waiting to be written (a peer stopped, or
wedged) the connection ends the same way.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable

import orjson

from gateway.workers.codec import Malformed
from gateway.workers.messages import Message, decode, encode

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 * 1024 * 1024  # a prompt's ids travel with its admit; a metrics exposition too
MAX_BACKLOG = 256 * 1024 * 1024  # bytes written and not yet read by the peer
_HEADER = struct.Struct(">I")


class Channel(asyncio.Protocol):
    """Framed messages both ways; ``on_message`` gets each one, ``on_lost`` the connection's end (once)."""

    def __init__(self, on_message: Callable[[Message], None], on_lost: Callable[[], None],
                 before_flush: Callable[[], None] | None = None) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._before_flush = before_flush  # sends what its owner held back until the write (``wake``)
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self._flush_scheduled = False
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self.heard_at = self._loop.time()  # when the peer's last bytes arrived
        self.ready: asyncio.Future[None] = self._loop.create_future()

    # -- asyncio's side -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        self.heard_at = self._loop.time()
        if not self.ready.done():
            self.ready.set_result(None)
        self._flush()  # what was sent before the connection was made

    def data_received(self, data: bytes) -> None:
        self.heard_at = self._loop.time()
        buf = self._buf
        buf += data
        at = 0
        size = len(buf)
        while size - at >= 4:
            (length,) = _HEADER.unpack_from(buf, at)
            if length > MAX_MESSAGE:
                self._refuse(f"a message of {length} bytes (at most {MAX_MESSAGE})")
                return
            if size - at - 4 < length:
                break
            try:
                message = decode(orjson.loads(memoryview(buf)[at + 4 : at + 4 + length]))
            except (orjson.JSONDecodeError, Malformed) as exc:
                if not isinstance(exc, Malformed) or not exc.droppable:
                    self._refuse(f"a malformed message ({str(exc)[:200]})")
                    return
                log.error("a malformed message on the workers' channel, dropped: %.200s", exc)
                at += 4 + length
                continue
            at += 4 + length
            try:
                self._on_message(message)
            except Exception:  # one message gone wrong is a bug of ours: logged, the others still handled
                log.exception("handling a message on the workers' channel failed: %.200r", message)
            if self.closed:
                return
        del buf[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self._on_lost()

    # -- ours -----------------------------------------------------------------------------------------
    def send(self, message: Message) -> None:
        if self.closed:
            return
        body = orjson.dumps(encode(message), option=orjson.OPT_NON_STR_KEYS)  # engines and keys by number
        self._out.append(_HEADER.pack(len(body)))
        self._out.append(body)
        self.wake()

    def wake(self) -> None:
        """The next write is due (this loop iteration's, sent by a ``call_soon``), with or without a message sent
        meanwhile: ``before_flush`` then sends what its owner held back."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._before_flush is not None and not self.closed:
            self._before_flush()
        self._flush_scheduled = False
        if not self._out or self._transport is None or self.closed:
            return
        out, self._out = self._out, []
        self._transport.write(b"".join(out))
        if self._transport.get_write_buffer_size() > MAX_BACKLOG:
            self._refuse(f"more than {MAX_BACKLOG} bytes the peer did not read")

    def _refuse(self, what: str) -> None:
        log.error("%s on the workers' channel; closing it", what)
        self.close()

    def close(self) -> None:
        if self._transport is not None:
            self._flush()
            self._transport.close()
        if not self.closed:
            self.closed = True
            self._on_lost()
