"""What the admission authority holds for one worker's request: its tenant grant and its admission in progress."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.guard.seams import Granted, Held
from gateway.workers.messages import Booking


class Attempt:
    """One admission of a request (a request its engine failed under is admitted again, elsewhere). Admitted as it
    arrived, it is held by nothing but this; a task holds it only while it waits (``WorkerLink._admit_now``)."""

    __slots__ = ("completed", "done", "generated", "reservation", "task")

    def __init__(self) -> None:
        self.reservation: Held | None = None  # while admitted
        self.task: asyncio.Task[None] | None = None
        self.done: asyncio.Event | None = None  # ``WorkerLink._serve``'s: released by the worker, or it is gone
        self.completed = False
        self.generated = 0

    def drop(self) -> None:
        """Give back what it holds, not completed: its task is cancelled, its reservation released (idempotent)."""
        if self.task is not None:
            self.task.cancel()
        if self.reservation is not None:
            self.reservation.release(completed=False)


class HeldRequest:
    """One worker's request as the authority holds it: its tenant grant and its admission in progress."""

    __slots__ = ("attempt", "grant")

    def __init__(self, attempt: Attempt) -> None:
        self.grant: Granted | None = None
        self.attempt = attempt


def booked(b: Booking) -> dict[str, Any]:
    """``Admitting.reservation``'s arguments for what a worker booked."""
    return {
        "prompt_tokens": b.prompt_tokens, "max_tokens": b.max_tokens, "n": b.n, "priority": b.priority,
        "request_id": b.request_id, "tenant": b.tenant, "weight": b.weight, "prefix": b.prefix,
        "avoid": frozenset(b.avoid), "family": b.family, "deadline": b.deadline, "min_output": b.min_output,
        "objective": b.objective,
    }
