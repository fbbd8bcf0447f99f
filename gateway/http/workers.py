"""``--workers N``: N processes accept and relay requests on the gateway's port; the first is the admission
authority (``gateway/workers/authority.py``).

Every process binds the port with ``SO_REUSEPORT``, so the kernel spreads connections across them and none
hands bytes to another. The authority (the process ``vllm-guard serve`` started) also listens on two Unix
sockets in a private folder: the workers' channel, and its own HTTP app, to which a worker forwards every route
that is not a guarded one (``/metrics``, ``/health``, ``/guard/*``, the models listing and the pass-through
routes): those answer from the authority's view, as one process would. The authority starts the workers once its
parts are up, restarts one that dies (its requests were released when its channel closed), and stops them on
shutdown after their requests in flight end (uvicorn's graceful shutdown in each).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gateway.config import Settings

log = logging.getLogger(__name__)

RESTART_BACKOFF = (0.5, 1.0, 2.0, 5.0, 10.0)  # seconds before restarting a worker that died, again and again


@dataclass(frozen=True)
class WorkerPlan:
    """Where the authority and its workers meet: a private folder with the channel and the authority's app."""

    count: int
    folder: Path

    @property
    def channel(self) -> Path:
        return self.folder / "authority.sock"

    @property
    def private(self) -> Path:
        return self.folder / "app.sock"

    @classmethod
    def for_settings(cls, settings: Settings) -> WorkerPlan | None:
        count = settings.worker_count()
        if count <= 1:
            return None
        # Only this user may connect: the channel admits requests, the app answers admin routes to anyone on it.
        return cls(count, Path(tempfile.mkdtemp(prefix="vllm-guard-")))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class WorkerPool:
    """The worker processes, each restarted when it dies, all stopped on shutdown."""

    def __init__(self, settings: Settings, plan: WorkerPlan) -> None:
        self._settings = settings
        self._plan = plan
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self) -> None:
        for index in range(1, self._plan.count):
            self._tasks.append(asyncio.create_task(self._keep(index), name=f"worker-{index}"))

    async def _keep(self, index: int) -> None:
        failures = 0
        while not self._stopping:
            proc = await self._spawn(index)
            self._procs[index] = proc
            code = await proc.wait()
            self._procs.pop(index, None)
            if self._stopping:
                return
            delay = RESTART_BACKOFF[min(failures, len(RESTART_BACKOFF) - 1)]
            failures += 1
            log.warning("gateway worker %d exited with %s; restarting it in %g s", index, code, delay)
            await asyncio.sleep(delay)

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        plan = self._plan
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.http.worker_main", "--index", str(index),
            "--channel", str(plan.channel), "--private", str(plan.private),
            stdin=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None
        # The settings go through a pipe: never on a command line or in the environment, where keys would show.
        proc.stdin.write(self._settings.model_dump_json().encode())
        await proc.stdin.drain()
        proc.stdin.close()
        return proc

    async def stop(self, timeout: float = 15.0) -> None:
        """Ask every worker to finish what it serves and exit; kill what is left after ``timeout``."""
        self._stopping = True
        procs = list(self._procs.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout)
        except TimeoutError:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
