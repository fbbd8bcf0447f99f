"""Run the real gateway app on a real socket (uvicorn in a thread) for integration tests and benchmarks."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gateway.config import Settings
from gateway.guard.parts import Parts
from gateway.http.app import create_app
from gateway.http.serving import build_server, sockets_for
from gateway.http.workers import WorkerPlan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class GatewayServer:
    url: str
    app: Any
    loop: asyncio.AbstractEventLoop

    @property
    def parts(self) -> Parts:
        parts: Parts = self.app.state.parts
        return parts

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a coroutine function on the gateway's own loop (its parts belong to that loop)."""
        return asyncio.run_coroutine_threadsafe(fn(*args), self.loop).result(10)

    def status(self) -> dict[str, Any]:
        async def get() -> dict[str, Any]:
            status: dict[str, Any] = self.parts.local_admission().status()
            return status

        result: dict[str, Any] = self.call(get)
        return result

    def wait_workers(self, count: int, timeout: float = 60.0) -> None:
        """Until ``count`` worker processes are connected to this gateway's authority (and so serving)."""
        deadline = time.monotonic() + timeout
        while True:
            authority = getattr(self.parts, "authority", None)
            if authority is not None and authority.serving() >= count:
                return
            assert time.monotonic() < deadline, "the gateway's workers did not start"
            time.sleep(0.05)

    def ledger_is_empty(self) -> bool:
        """Nothing booked, in flight or queued: every reservation was given back."""
        status = self.status()
        return bool(status["committed_blocks"] == 0 and status["in_flight"] == 0 and status["queued"] == 0)

    def wait_ledger_empty(self, timeout: float = 5.0) -> None:
        """Wait for the requests still finishing on the gateway's loop to give their reservations back."""
        deadline = time.monotonic() + timeout
        while not self.ledger_is_empty():
            assert time.monotonic() < deadline, f"the ledger did not return to zero: {self.status()}"
            time.sleep(0.01)


# Every suite can run with the gateway split into processes: VLLM_GUARD_TEST_WORKERS=2 makes each gateway the tests
# start an admission authority (in this process, whose parts the tests inspect) with one worker process beside it.
TEST_WORKERS = os.environ.get("VLLM_GUARD_TEST_WORKERS")


@contextmanager
def run_gateway(
    settings: Settings, *, loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
    **overrides: Any,
) -> Iterator[GatewayServer]:
    """``loop_factory``: the gateway's event loop (``uvloop.new_event_loop``: the loop ``vllm-guard serve`` runs on)."""
    port = free_port()
    if TEST_WORKERS and "workers" not in overrides:
        overrides["workers"] = TEST_WORKERS
    settings = settings.model_copy(update={"host": "127.0.0.1", "port": port, **overrides})
    if settings.worker_count() > 1 and "starved_stretch" not in overrides:
        # The suite judges timeouts as on an idle host (``tests/conftest.py``'s ``idle_host`` sets the starved share
        # to 0 in this process); worker processes read the host's real CPU pressure, which on a busy test machine
        # stretched a slow client's timeouts past the bounds the suite checks: they count by the clock alone.
        settings = settings.model_copy(update={"starved_stretch": 0.0})
    if isinstance(settings.upstream, str):  # a copy is not validated: one URL given as the flag's value is
        settings = settings.model_copy(update={"upstream": [settings.upstream]})
    plan = WorkerPlan.for_settings(settings)
    app = create_app(settings, plan)
    # The production server and its connection limits; only the log level differs.
    server = build_server(app, settings, log_level="warning")
    loop_box: list[asyncio.AbstractEventLoop] = []

    def run() -> None:
        loop = loop_factory()
        loop_box.append(loop)
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.serve(sockets=sockets_for(settings, plan)))
        loop.close()

    thread = threading.Thread(target=run, name=f"gateway-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.01)
    gw = GatewayServer(f"http://127.0.0.1:{port}", app, loop_box[0])
    if plan is not None:
        gw.wait_workers(plan.workers)
    try:
        yield gw
    finally:
        server.should_exit = True
        thread.join(30)
        if plan is not None:
            plan.remove()
