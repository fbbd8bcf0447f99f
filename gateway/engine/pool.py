"""The engine's connections: at most ``limit`` open, the idle ones reused newest first, each checked alive before
it carries a request; a request waits for room no longer than it may wait to connect (its own deadline)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import Callable

from gateway.engine.connection import Connection, State
from gateway.engine.wire import UNREACHABLE_RETRY_AFTER, Exchange
from gateway.errors import GatewayError, UpstreamUnavailable


class Pool:
    def __init__(
        self, host: str, port: int, tls: ssl.SSLContext | None, limit: int, keepalive: float,
        describe: Callable[[], str],
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.host, self.port, self.tls = host, port, tls
        self.limit, self.keepalive = limit, keepalive
        self.describe = describe  # the engine's URL, redacted, for messages
        self.idle: list[Connection] = []
        self.conns: set[Connection] = set()
        self.connecting = 0
        self.active: set[Exchange] = set()
        # Requests waiting for room: each future resolves True when told of room, False at its deadline.
        self._waiters: collections.deque[asyncio.Future[bool]] = collections.deque()

    async def connection(self, reuse: bool, within: float) -> tuple[Connection, bool]:
        """An idle connection for one exchange, and whether it was pooled: a pooled one still alive (unless
        ``reuse`` is false), else a new one once there is room, all within ``within`` seconds. Raises
        ``TimeoutError`` (connecting took too long), ``OSError`` (it failed) or ``UpstreamUnavailable`` (no
        room in time, or the upstream closed the new connection at once)."""
        deadline = self.loop.time() + within
        while True:
            if reuse:
                conn = self._pooled()
                if conn is not None:
                    return conn, True
            if len(self.conns) + self.connecting < self.limit:
                return await self._open(deadline), False
            if not reuse and self.idle:
                self.idle[0].close()  # the oldest idle one makes room for the new connection asked for
                continue
            await self._wait(deadline, within)

    def _pooled(self) -> Connection | None:
        now = self.loop.time()
        while self.idle:
            conn = self.idle.pop()
            if now - conn.idle_since < self.keepalive and conn.usable():
                return conn
            conn.close()
        return None

    async def _open(self, deadline: float) -> Connection:
        self.connecting += 1
        opened = False
        try:
            if self.host.startswith("/"):  # a Unix socket's path (a worker's way to the authority)
                opening = self.loop.create_unix_connection(lambda: Connection(self), self.host)
            else:
                opening = self.loop.create_connection(lambda: Connection(self), self.host, self.port, ssl=self.tls)
            _, conn = await asyncio.wait_for(opening, max(0.0, deadline - self.loop.time()))
            opened = True
        finally:
            self.connecting -= 1
            if not opened:
                self._wake()  # its room goes to a request that waits
        if not conn.is_open():  # closed as soon as it was opened: never handed out
            conn.close()
            self._wake()
            raise UpstreamUnavailable(
                f"The upstream at {self.describe()} closed the connection as soon as it was opened.",
                retry_after=UNREACHABLE_RETRY_AFTER,
            )
        self.conns.add(conn)
        return conn

    async def _wait(self, deadline: float, within: float) -> None:
        waiter: asyncio.Future[bool] = self.loop.create_future()
        self._waiters.append(waiter)
        timer = self.loop.call_at(deadline, _expire, waiter)
        try:
            told = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self._wake()  # told of room, but gone: the room goes to the next one
            raise
        finally:
            timer.cancel()
        if not told:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            raise UpstreamUnavailable(
                f"All {self.limit} connections to the upstream at {self.describe()} stayed busy for {within:g} s "
                "(--upstream-connections); retry shortly.",
                retry_after=UNREACHABLE_RETRY_AFTER,
            )

    def release(self, conn: Connection) -> None:
        """An exchange's answer ended whole: its connection (IDLE now) may carry the next one."""
        assert conn.state is State.IDLE and conn in self.conns, conn.state
        self.idle.append(conn)
        self._wake()

    def forget(self, conn: Connection) -> None:
        """A connection closed (by either side): its place is free."""
        if conn in self.idle:
            self.idle.remove(conn)
        self.conns.discard(conn)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return

    def sweep(self, timeout_error: Callable[[Exchange], GatewayError]) -> None:
        """Fail exchanges past their deadline or silent too long; close connections idle past the keep-alive."""
        now = self.loop.time()
        for exchange in [e for e in self.active if e.done or now > e.deadline or now - e.read_at > e.silence]:
            self.active.discard(exchange)
            if not exchange.done:
                exchange.fail(timeout_error(exchange))
        for conn in [c for c in self.idle if now - c.idle_since >= self.keepalive]:
            conn.close()

    def close(self) -> None:
        for conn in list(self.idle):
            conn.close()
        for exchange in list(self.active):
            exchange.close()
        self.active.clear()


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
