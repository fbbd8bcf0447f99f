"""What the supervisor's tests share: a vLLM-like child (testing/fake_vllm.py) to run, fakes of the
parts the supervisor talks to, and ways to read what the child was started with."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import Settings
from gateway.managed.supervisor import Supervisor
from gateway.metrics import Metrics
from tests.support.paths import FAKE_VLLM

FAKE = FAKE_VLLM


class FakeAdmission:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.in_flight = 0

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    async def wait_idle(self, timeout: float) -> bool:
        self.calls.append(f"wait_idle({timeout:g})")
        return True


class FakeGpu:
    def memory_mib(self, pids: Collection[int]) -> float | None:
        return None

    def holders(self) -> list[str]:
        return ["pid 4242 VLLM::EngineCore on GPU 0: 60000 MiB"]


@dataclass(frozen=True)
class Snapshot:
    ok: bool
    running: int | None
    generation_tokens_total: float | None
    preemptions_total: float | None


class FakeEngine:
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self.reads = 0  # how many times the watchdog looked

    @property
    def snapshot(self) -> Snapshot:
        self.reads += 1
        return self._snapshot


def settings(state: Path, scenario: str = "ok", *fake: str, **kw: Any) -> Settings:
    command = [sys.executable, str(FAKE), "--fake-scenario", scenario, "--fake-state-dir", str(state), *fake]
    values: dict[str, Any] = {
        # Generous bounds: a start returns as soon as the engine is ready, however long the bound, and a machine
        # busy with other work (load average 20 seen) must not turn a slow start or a slow /health into a failure
        # or a hang. The tests of hangs set their own, short --hang-timeout.
        "managed": True, "model": "fake-model", "vllm_command": " ".join(command), "startup_timeout": 120.0,
        "hang_timeout": 120.0, "drain_timeout": 2.0, "max_restarts": 3, "restart_window": 600.0,
        "autofit_attempts": 3,
    } | kw
    return Settings.model_validate(values)


def make(
    made: list[Supervisor], s: Settings, admission: FakeAdmission | None = None, **kw: Any
) -> tuple[Supervisor, Metrics]:
    metrics = Metrics()
    kw.setdefault("gpu", FakeGpu())
    sup = Supervisor(s, metrics, admission=admission, stop_grace=2.0, backoff_base=0.05, **kw)
    made.append(sup)
    return sup, metrics


async def eventually(cond: Callable[[], bool], timeout: float = 120.0) -> None:
    """Wait for ``cond``, polling; the bound only ends a test that would otherwise hang, so it is generous."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def launches(state: Path) -> int:
    return int((state / "launches").read_text())


def argv(state: Path, launch: int) -> list[str]:
    return list(json.loads((state / f"argv-{launch}.json").read_text()))


def restarts(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("vllm_guard_restarts_total", {"reason": reason})
    return value or 0.0


async def running(sup: Supervisor) -> tuple[asyncio.Task[None], Callable[[], Awaitable[None]]]:
    task = asyncio.create_task(sup.run())

    async def finish() -> None:
        await sup.stop()
        await asyncio.wait_for(task, 60)

    return task, finish
