"""A serving process freezes its start-up heap once it has started; a test's gateway never does (what is frozen
is never collected)."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref
from collections.abc import Iterator

import pytest
from starlette.types import Receive, Scope, Send

from gateway.config import Settings
from gateway.http.serving import build_server
from gateway.observe import heap


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


@pytest.mark.parametrize(("serving", "frozen"), [(True, True), (False, False)],
                         ids=["a serving process freezes it", "a test's server does not"])
async def test_the_start_up_heap_is_frozen_once_started(serving: bool, frozen: bool) -> None:
    server = build_server(app, Settings(port=free_port()), serving=serving, log_level="warning")  # type: ignore[arg-type]
    serving_task = asyncio.create_task(server.serve())
    try:
        while not server.started:  # noqa: ASYNC110 - uvicorn says it started only as a flag
            await asyncio.sleep(0.01)
        assert (gc.get_freeze_count() > 0) is frozen
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving_task, 10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_settle_collects_the_garbage_before_it_freezes() -> None:
    gone = weakref.ref(Cycle())  # unreachable, held only by its own cycle: collected, not frozen for good
    kept = Cycle()
    frozen = heap.settle()
    assert gone() is None
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects()), "what lives is out of every generation the collector walks"
