"""The managed engine's lifecycle: its states, the current one and since when, and what clients are told meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import StrEnum
from typing import TypedDict

from gateway.metrics import Metrics

# Down waits for an operator (POST /guard/restart); the OpenAI SDKs wait at most 60 s anyway.
DOWN_RETRY_AFTER = 60.0


class EngineLifecycle(StrEnum):
    """Where the managed engine is; a str, so that its value is what status output and metrics show."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    RESTARTING = "restarting"
    DOWN = "down"


class Phase:
    """The current lifecycle state, when it began, and an event that is set whenever the engine is not ready."""

    def __init__(self, metrics: Metrics | None, clock: Callable[[], float]) -> None:
        """``metrics``: None for every managed engine but the first (the state gauge is one engine's)."""
        self.metrics = metrics
        self.clock = clock
        self.state = EngineLifecycle.STARTING
        self.since = clock()
        self.unready = asyncio.Event()
        self.on_change: Callable[[], None] | None = None  # with --workers: the authority tells its workers at once
        self.set(EngineLifecycle.STARTING)

    def set(self, state: EngineLifecycle) -> None:
        # Every start-up attempt restarts the clock that Retry-After counts down from.
        if state != self.state or state is EngineLifecycle.STARTING:
            self.since = self.clock()
        self.state = state
        if state is EngineLifecycle.READY:
            self.unready.clear()
        else:
            self.unready.set()
        if self.metrics is not None:
            self.metrics.set_upstream_state(state)
        if self.on_change is not None:
            self.on_change()

    def retry_after(self, expected_startup: float, drain_timeout: float) -> float:
        """Seconds a client should wait before retrying, given how long a start-up is expected to take."""
        elapsed = self.clock() - self.since
        match self.state:
            case EngineLifecycle.DRAINING:
                return max(1.0, drain_timeout - elapsed + expected_startup)
            case EngineLifecycle.STARTING | EngineLifecycle.RESTARTING:
                return max(1.0, expected_startup - elapsed)
            case EngineLifecycle.DOWN:
                return DOWN_RETRY_AFTER
        return 1.0


class EngineStatus(TypedDict):
    """The supervisor's part of /guard/status."""

    state: EngineLifecycle
    url: str
    pid: int | None
    pgid: int | None
    command: list[str] | None
    restarts: int
    restarts_by_reason: dict[str, int]
    last_restart_reason: str | None
    last_restart_detail: str | None
    last_error: str | None
    last_exit_code: int | None
    max_model_len: int | None
    capacity_from_log: dict[str, int] | None
    autofit: list[str]
    overrides: dict[str, str]
    startup_seconds: float | None
    uptime_seconds: float | None
