"""An engine on loopback that answers each request with exactly the bytes, pauses, closes and resets a test
scripted for it, and counts what it read: which requests it read whole, on how many connections.

A request names its script in the ``x-script`` header (so that requests sent at once each get their own); one
without a script, or with an unknown one, gets ``answer(rid)``, a well-framed answer whose body names the request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import socket
import struct
import sys
import termios
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config import Settings


@dataclass(frozen=True)
class Write:
    data: bytes


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class Close:
    reset: bool = False  # an RST (SO_LINGER 0) rather than a FIN


@dataclass(frozen=True)
class HalfClose:
    """A FIN, the connection still read: a request sent on it after is read (and then the connection closed)."""


@dataclass(frozen=True)
class Hang:
    """Nothing more is written; the connection is read until the client goes away."""


@dataclass(frozen=True)
class Endless:
    """``head`` then ``piece`` again and again, up to ``limit`` bytes or until the client goes away."""

    head: bytes
    piece: bytes
    limit: int


Step = Write | Pause | Close | HalfClose | Hang | Endless


@dataclass
class Script:
    steps: list[Step]
    read_body: bool = True  # false: the body is never read (the connection is reset after the head)


def body_of(rid: str) -> bytes:
    return b'{"id": "' + rid.encode() + b'"}'


def answer(rid: str, *, chunked: bool = False, informational: bool = False, body: bytes | None = None) -> bytes:
    data = body_of(rid) if body is None else body
    first = b"HTTP/1.1 100 Continue\r\n\r\n" if informational else b""
    if chunked:
        return first + (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            + f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n"
        )
    return first + b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(data), data,
    )


def settings(url: str, **overrides: object) -> Settings:
    return Settings(upstream=[url]).model_copy(update=overrides)


@dataclass
class ScriptedEngine:
    scripts: dict[str, Script | list[Script]] = field(default_factory=dict)  # a list: one per request, in turn
    received: collections.Counter[str] = field(default_factory=collections.Counter)  # read whole, by request id
    connections: int = 0
    written: int = 0  # bytes an ``Endless`` step wrote before it stopped
    idle: set[asyncio.StreamWriter] = field(default_factory=set)  # waiting for a next request
    running: int = 0  # scripts being played
    half_closed: set[asyncio.StreamWriter] = field(default_factory=set)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)  # every open connection
    url: str = ""
    _moved: asyncio.Event = field(default_factory=asyncio.Event)  # a request read, or a script ended
    _server: asyncio.Server | None = None
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> ScriptedEngine:
        sock = socket.socket()
        # A small receive window (set before listening, so that accepted connections keep it): a large request
        # the engine does not read stays, in part, in the client's own buffer.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._handle, sock=sock)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self.writers):
            writer.transport.abort()  # each handler then ends by itself
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        await self._server.wait_closed()

    async def quiet(self, within: float = 5.0) -> None:
        """Until every script started has been played to its end (or to its hang), and every byte written has
        reached the client's side (its socket holds them: it can tell them from what comes next)."""
        await self._until(lambda: not self.running, within)
        async with asyncio.timeout(within):
            while not all(_delivered(w) for w in self.writers):  # noqa: ASYNC110  # the kernel's: no event to wait on
                await asyncio.sleep(0.001)

    async def heard(self, rid: str, within: float = 5.0) -> None:
        """Until the request ``rid`` was read whole."""
        await self._until(lambda: self.received[rid] > 0, within)

    async def _until(self, done: Callable[[], bool], within: float) -> None:
        async with asyncio.timeout(within):
            while not done():
                self._moved.clear()
                await self._moved.wait()

    def poke_idle(self, data: bytes | None) -> None:
        """Write ``data`` to every connection waiting for its next request (None: close them)."""
        for writer in list(self.idle):
            if data is None:
                writer.transport.abort()
            else:
                writer.write(data)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.writers.add(writer)
        self.connections += 1
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                while await self._one(reader, writer):
                    pass
        finally:
            self.idle.discard(writer)
            self.half_closed.discard(writer)
            self.writers.discard(writer)
            writer.transport.abort()
            self._handlers.discard(task)

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        self.idle.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        finally:
            self.idle.discard(writer)
        headers = dict(
            (k.strip().lower(), v.strip()) for k, _, v in
            (line.decode("latin-1").partition(":") for line in head.split(b"\r\n")[1:] if line)
        )
        rid = headers.get("x-request-id", "")
        script = self._script(headers.get("x-script", ""), rid)
        if not script.read_body:
            reset(writer)
            return False
        await reader.readexactly(int(headers.get("content-length", "0")))
        self.received[rid] += 1
        self._moved.set()
        if writer in self.half_closed:  # read whole, and closed unanswered
            return False
        self.running += 1
        try:
            return await self._play(script, reader, writer)
        finally:
            self.running -= 1
            self._moved.set()

    def _script(self, name: str, rid: str) -> Script:
        script = self.scripts.get(name, Script([Write(answer(rid))]))
        if isinstance(script, list):
            return script.pop(0) if len(script) > 1 else script[0]
        return script

    async def _play(self, script: Script, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        for step in script.steps:
            if isinstance(step, Write):
                writer.write(step.data)
            elif isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
            elif isinstance(step, Close):
                if step.reset:
                    reset(writer)
                else:
                    writer.close()
                return False
            elif isinstance(step, HalfClose):
                writer.write_eof()
                self.half_closed.add(writer)
            elif isinstance(step, Hang):
                self.running -= 1  # a hang is played out: what follows is the client's doing
                self._moved.set()
                try:
                    await reader.read()
                finally:
                    self.running += 1
                return False
            else:
                await self._endless(step, writer)
                return False
        return True

    async def _endless(self, step: Endless, writer: asyncio.StreamWriter) -> None:
        writer.write(step.head)
        self.written = len(step.head)
        while self.written < step.limit and not writer.transport.is_closing():
            writer.write(step.piece)
            self.written += len(step.piece)
            await writer.drain()


def _delivered(writer: asyncio.StreamWriter) -> bool:
    """Nothing written waits in the transport, nor unacknowledged in the kernel (on loopback: the peer's socket
    has it)."""
    sock = writer.get_extra_info("socket")
    if writer.transport.is_closing() or sock is None:
        return True
    if writer.transport.get_write_buffer_size():
        return False
    try:
        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return True
    return int.from_bytes(out, sys.byteorder) == 0


def reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
