"""One connection between a worker and the admission authority: messages (JSON objects) over a Unix socket.

Each message is a 4-byte big-endian length and that many bytes of JSON (orjson). What one loop iteration
sends goes out in one write (``send`` queues, a ``call_soon`` flushes), so a busy worker's admits, progress and
releases share system calls. A message larger than ``MAX_MESSAGE`` or a frame that is not JSON ends the
connection: both sides are the gateway's own code, so that is a bug, never a client's doing.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import Any

import orjson

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 * 1024 * 1024  # a prompt's block keys travel with its admit; a metrics exposition too
_HEADER = struct.Struct(">I")

Message = dict[str, Any]


class Channel(asyncio.Protocol):
    """Framed JSON messages both ways; ``on_message`` gets each one, ``on_lost`` the connection's end (once)."""

    def __init__(self, on_message: Callable[[Message], None], on_lost: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self._flush_scheduled = False
        self.closed = False
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio's side -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        if not self.ready.done():
            self.ready.set_result(None)
        self._flush()  # what was sent before the connection was made

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        at = 0
        size = len(buf)
        while size - at >= 4:
            (length,) = _HEADER.unpack_from(buf, at)
            if length > MAX_MESSAGE:
                log.error("a message of %d bytes on the workers' channel; closing it", length)
                self.close()
                return
            if size - at - 4 < length:
                break
            try:
                message = orjson.loads(memoryview(buf)[at + 4 : at + 4 + length])
            except orjson.JSONDecodeError:
                log.error("a message that is not JSON on the workers' channel; closing it")
                self.close()
                return
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
        body = orjson.dumps(message, option=orjson.OPT_NON_STR_KEYS)  # engines by index
        self._out.append(_HEADER.pack(len(body)))
        self._out.append(body)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._out or self._transport is None or self.closed:
            return
        out, self._out = self._out, []
        self._transport.write(b"".join(out))

    def close(self) -> None:
        if self._transport is not None:
            self._flush()
            self._transport.close()
        if not self.closed:
            self.closed = True
            self._on_lost()
