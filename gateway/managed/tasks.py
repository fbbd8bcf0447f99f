"""Background tasks with an owner: each is kept until it ends, and the owner cancels and awaits the rest."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class OwnedTasks:
    """The loop keeps only weak references to tasks, and nothing else would end them on shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        # A task nobody awaits would otherwise fail in silence.
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task %s failed", task.get_name(), exc_info=exc)

    async def close(self) -> None:
        """Cancel every task still running (but the caller's own) and wait until each has ended."""
        current = asyncio.current_task()
        # A task may start another while it unwinds: repeat until none is left.
        while pending := [t for t in self._tasks if t is not current and not t.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending)

    def __len__(self) -> int:
        return len(self._tasks)
