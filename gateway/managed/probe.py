"""Probing the engine: readiness and health over its private port, progress counters, and GPU memory.

The answers go to the watchdog (gateway/managed/watchdog.py), which decides; this module only asks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Protocol, runtime_checkable

import aiohttp

from gateway import gpu as gpu_facts
from gateway.managed import guardian
from gateway.managed.watchdog import Progress, Trouble, Watchdog, parse_progress

log = logging.getLogger(__name__)


class EngineSnapshotLike(Protocol):
    @property
    def ok(self) -> bool: ...
    @property
    def running(self) -> float | None: ...
    @property
    def generation_tokens_total(self) -> float | None: ...
    @property
    def preemptions_total(self) -> float | None: ...


class EngineWatch(Protocol):
    @property
    def snapshot(self) -> EngineSnapshotLike | None: ...


@runtime_checkable
class CountsAnswers(Protocol):
    """An engine that also says how many answers completed through the gateway (``gateway.engine.Engine``)."""

    @property
    def answers(self) -> int: ...


class GpuProbe(Protocol):
    def memory_mib(self, pids: Collection[int]) -> float | None:
        """GPU memory held by these processes together; None where unknown (no GPU)."""
        ...

    def holders(self) -> list[str]:
        """Processes holding GPU memory, one readable line each ("pid 123 python: 20480 MiB")."""
        ...


class NvmlProbe:
    """GpuProbe over gateway.gpu (NVML); reports nothing on a machine without an NVIDIA GPU."""

    def __init__(self) -> None:
        self.available = gpu_facts.query_gpus(name_of=lambda _pid: "").available

    def memory_mib(self, pids: Collection[int]) -> float | None:
        held = gpu_facts.memory_of_pids(pids) if self.available else None
        return None if held is None else held / gpu_facts.MIB

    def holders(self) -> list[str]:
        report = gpu_facts.query_gpus()
        return [
            f"pid {p.pid} {p.name or '?'} on GPU {p.gpu_index}: "
            + (f"{p.used_mib} MiB" if p.used_mib is not None else "memory not reported")
            for d in report.devices
            for p in d.processes
        ]


class EngineProbe:
    """HTTP requests to the engine's private address, each bounded by a timeout; a failure reads as no answer."""

    def __init__(self, url: str, api_key: str | None, clock: Callable[[], float]) -> None:
        self.url = url
        self.clock = clock
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_text(self, path: str, timeout: float = 2.0) -> str | None:
        if self._session is None:
            return None
        try:
            async with self._session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    return None
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def get_ok(self, path: str, timeout: float = 2.0) -> bool:
        return await self.get_text(path, timeout) is not None

    async def wait_ready(self, proc: asyncio.subprocess.Process, deadline: float) -> str | None:
        """None once /health and /v1/models answer 200; "exit" or "timeout" otherwise."""
        exited = asyncio.create_task(proc.wait())
        try:
            while True:
                if exited.done():
                    return "exit"
                if await self.get_ok("/health") and await self.get_ok("/v1/models"):
                    return None
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return "timeout"
                await asyncio.wait({exited}, timeout=min(0.2, remaining))
        finally:
            exited.cancel()

    async def progress(self, engine: EngineWatch | None, timeout: float) -> Progress | None:
        """(running, generation tokens, preemptions), from the engine view or a scrape of our own.

        The one place progress is read; a scrape goes through parse_progress.
        """
        if engine is not None:
            snap = engine.snapshot
            if snap is None or not snap.ok:
                return None
            return snap.running, snap.generation_tokens_total, snap.preemptions_total
        text = await self.get_text("/metrics", timeout)
        return parse_progress(text) if text is not None else None

    async def watch(
        self, proc: asyncio.subprocess.Process, dog: Watchdog, *, engine: EngineWatch | None, gpu: GpuProbe | None,
    ) -> Trouble | None:
        """Probe a serving engine until the watchdog finds trouble (returned) or the process exits (None)."""
        tick = max(0.05, min(1.0, dog.hang_timeout / 5))
        timeout = max(0.1, min(5.0, dog.hang_timeout / 2))
        exited = asyncio.create_task(proc.wait())
        try:
            while True:
                done, _ = await asyncio.wait({exited}, timeout=tick)
                if done:
                    return None
                trouble = await self.check(dog, proc.pid, engine=engine, gpu=gpu, timeout=timeout)
                if trouble is not None:
                    return trouble
        finally:
            exited.cancel()

    async def check(
        self, dog: Watchdog, pgid: int, *, engine: EngineWatch | None, gpu: GpuProbe | None, timeout: float
    ) -> Trouble | None:
        """One watchdog round: health, then progress, then the group's GPU memory."""
        if isinstance(engine, CountsAnswers):
            dog.observe_answers(self.clock(), engine.answers)
        ok = await self.get_ok("/health", timeout=timeout)
        trouble = dog.observe_health(self.clock(), ok)
        if trouble is not None or not ok:
            return trouble
        progress = await self.progress(engine, timeout)
        if progress is not None:
            trouble = dog.observe_engine(self.clock(), *progress)
            if trouble is not None:
                return trouble
        if gpu is not None:
            mib = await asyncio.to_thread(lambda: gpu.memory_mib(guardian.group_pids(pgid)))
            return dog.observe_memory(mib)
        return None
