"""Reading a client's request: its body (bounded) and watching for it to go away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.config import Settings
from gateway.errors import PayloadTooLarge, RequestTimeout
from gateway.http.starved import STRETCH, Share, owed

# The connection cannot be reused once a body is refused part-way: the rest of it would be read as a request.


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """How large a request body may be and how fast it must arrive: within ``timeout`` seconds in all, and,
    after a head start of ``grace`` seconds, at ``min_rate`` bytes per second at least (0: no minimum)."""

    max_bytes: int
    timeout: float
    min_rate: float
    grace: float
    stretch: float = STRETCH  # --starved-stretch: the most a starved host stretches ``due``

    @classmethod
    def of(cls, settings: Settings) -> BodyLimits:
        return cls(settings.max_body_bytes, settings.body_timeout, settings.min_body_rate, settings.body_rate_grace,
                   settings.starved_stretch)

    def due(self, size: int) -> float:
        """Seconds from the start by which a body of which ``size`` bytes arrived must have grown or ended."""
        if self.min_rate <= 0:
            return self.timeout
        return min(self.timeout, self.grace + size / self.min_rate)


async def read_body(request: Request, limits: BodyLimits, clock: Callable[[], float] = time.monotonic,
                    share: Share | None = None) -> bytes:
    """The whole body, or ``PayloadTooLarge`` / ``RequestTimeout`` (both closing the connection), or
    ``ClientDisconnect``. Each chunk is checked against ``limits`` as it arrives; a client that sends nothing
    at all is cut by the server's connection timer with the same rule (``server.GuardProtocol``): a timer per
    request here would cost more than the rest of this function. A body late while the host starved work of a
    CPU is given the time its client may not have run (``starved.owed``; ``share`` for tests)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
        raise PayloadTooLarge(
            f"The request body is {int(declared)} bytes; the limit is {limits.max_bytes} bytes.", close_connection=True
        )
    receive = request.receive
    start = clock()
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if chunk:
            size += len(chunk)
            if size > limits.max_bytes:
                raise PayloadTooLarge(
                    f"The request body exceeds the limit of {limits.max_bytes} bytes.", close_connection=True
                )
            chunks.append(chunk)
        elapsed = clock() - start
        if elapsed > limits.due(size) and not owed(limits.due(size), elapsed, share, limits.stretch):
            raise body_too_slow(limits, size, elapsed)
    return b"".join(chunks)


def body_too_slow(limits: BodyLimits, size: int, elapsed: float) -> RequestTimeout:
    if elapsed >= limits.timeout:
        message = f"The request body did not arrive within {limits.timeout:g} seconds ({size} bytes came)."
    else:
        message = (
            f"The request body arrives slower than {limits.min_rate:g} bytes per second ({size} bytes in "
            f"{elapsed:.1f} seconds); the minimum applies after {limits.grace:g} seconds."
        )
    return RequestTimeout(message, close_connection=True)


class DisconnectWatcher:
    """Cancels the handling task when the client disconnects before the response starts, so that a queued
    request leaves the queue and an upstream request is aborted (not left generating for nobody).
    Started only once the body is read: from then on, receive() returns only on disconnect."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.fired = False

    # Most requests are answered before this: they never pay for a watching task. A client that leaves sooner
    # is noticed this much later, which frees nothing later than the upstream's own answer would.
    GRACE = 0.05

    def start(self) -> None:
        target = asyncio.current_task()
        if target is None:
            return
        self._timer = asyncio.get_running_loop().call_later(self.GRACE, self._watch, target)

    def _watch(self, target: asyncio.Task[Response]) -> None:
        self._timer = None

        async def wait() -> None:
            message = await self._request.receive()
            if message["type"] == "http.disconnect" and self._task is not None:
                self.fired = True
                target.cancel()

        self._task = asyncio.get_running_loop().create_task(wait())

    def stop(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

