"""Managed vLLM: launch, readiness, start-up auto-fit, crash/hang/fragmentation restarts with drain.

The engine runs on a private port in its own process group under a guardian (gateway/managed/guardian.py), so
that no engine process outlives the gateway; this module decides when to start, stop and restart it. The
rules it follows live beside it, free of I/O: log facts, auto-fit, the watchdog and the restart budget.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from gateway.config import Settings
from gateway.errors import UpstreamUnavailable
from gateway.managed import guardian
from gateway.managed.autofit import fewer_seqs, next_fit
from gateway.managed.child import EngineChild, launch_child, stop_child
from gateway.managed.command import base_command, engine_args, free_port, redact
from gateway.managed.lifecycle import EngineLifecycle, EngineStatus, Phase
from gateway.managed.logfacts import CudaOutOfMemory, EngineDead, InsufficientFreeMemory, LogEvent, describe_failure
from gateway.managed.niceness import renice_engine_cores
from gateway.managed.probe import EngineProbe, EngineWatch, GpuProbe, NvmlProbe
from gateway.managed.restarts import RestartBudget
from gateway.managed.tasks import OwnedTasks
from gateway.managed.watchdog import Trouble, Watchdog
from gateway.metrics import Metrics
from gateway.redact import SecretRedactor
from gateway.vllm_args import arg_value

log = logging.getLogger(__name__)

# Before the first start-up has been timed, clients are told to come back in this many seconds.
STARTUP_GUESS = 30.0
# A dead engine is seen within a watch tick plus the last lines of its log (at most ~3 s here).
FAILURE_NOTICE_TIMEOUT = 5.0
# After an unexpected exit, its last lines (an out-of-memory traceback) decide the reason.
EXIT_LINES_TIMEOUT = 2.0


class SupervisorError(UpstreamUnavailable):
    """The managed engine could not be (re)started; the message says why, with vLLM's numbers."""

    code = "upstream_down"


class AdmissionControl(Protocol):
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    @property
    def in_flight(self) -> int: ...
    async def wait_idle(self, timeout: float) -> bool: ...


class Supervisor:
    """Owns the managed engine: every task it starts is kept here and ended by stop()."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        admission: AdmissionControl | None = None,
        engine: EngineWatch | None = None,
        index: int = 0,
        devices: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        gpu: GpuProbe | None = None,
        stop_grace: float = 15.0,
        backoff_base: float = 1.0,
    ) -> None:
        if not settings.model:
            raise ValueError("managed mode needs a model")
        self.settings = settings
        self.metrics = metrics
        self.admission = admission
        self.engine = engine
        self.clock = clock
        self.gpu = gpu
        self.stop_grace = stop_grace
        # One of several engines: the first publishes the engine-state gauge, each logs under its own name.
        self.index = index
        self.name = str(index)
        self._who = "vLLM" if settings.engine_count() == 1 else f"vLLM engine {index}"
        self.devices = devices  # its CUDA_VISIBLE_DEVICES, when the engines split the GPUs
        self.port = settings.vllm_port + index if settings.vllm_port else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.restarts = 0
        self.restarts_by_reason: Counter[str] = Counter()
        self.last_restart_reason: str | None = None
        self.last_restart_detail: str | None = None
        self.last_error: str | None = None
        self.last_exit_code: int | None = None
        self.autofit_log: list[str] = []
        self._redactor = SecretRedactor(settings.secrets())
        self._probe = EngineProbe(self.url, settings.upstream_api_key, clock)
        self._budget = RestartBudget(
            max_restarts=settings.max_restarts, window=settings.restart_window, backoff_base=backoff_base, clock=clock
        )
        self._phase = Phase(metrics if index == 0 else None, clock)
        self._overrides: dict[str, str] = {}
        self._base: list[str] | None = None
        self._child: EngineChild | None = None
        self._gen = 0
        self._troubles: asyncio.Queue[tuple[int, Trouble]] = asyncio.Queue()
        self._tasks = OwnedTasks()
        self._restart_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._startup_seconds: float | None = None
        self._ready_since: float | None = None

    # -- public ---------------------------------------------------------------------------------
    @property
    def state(self) -> EngineLifecycle:
        return self._phase.state

    @property
    def max_model_len(self) -> int | None:
        fixed = arg_value(self._args(), "--max-model-len")
        return int(fixed) if fixed is not None else self._child.facts.max_model_len if self._child else None

    @property
    def capacity_from_log(self) -> tuple[int, int] | None:
        if self._child is None:
            return None
        block = arg_value(self._args(), "--block-size")
        return self._child.facts.capacity(int(block) if block else None)

    async def start(self) -> None:
        """Launch vLLM and wait until it serves (auto-fitting on known start-up failures)."""
        self._probe.open()
        if self.gpu is None:
            probe = await asyncio.to_thread(NvmlProbe)
            self.gpu = probe if probe.available else None
        if self._base is None:
            script = None if self.settings.vllm_command else await guardian.detect_vllm_script()
            self._base = base_command(self.settings, script)
        self._phase.set(EngineLifecycle.STARTING)
        t0 = self.clock()
        try:
            await self._launch_until_ready()
        except SupervisorError as e:
            self.last_error = e.message
            self._phase.set(EngineLifecycle.DOWN)
            raise
        self._startup_seconds = self.clock() - t0

    async def run(self) -> None:
        """Watch the engine and restart it on crash, hang or fragmentation, until stop()."""
        while not self._stopping:
            gen, trouble = await self._troubles.get()
            if self._stopping or gen != self._gen or self.state != EngineLifecycle.READY:
                continue  # about an engine already replaced
            log.warning("%s needs a restart (%s): %s", self._who, trouble.reason, trouble.detail)
            try:
                await self.restart(trouble.reason, detail=trouble.detail)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stopping and task is not None and not task.cancelling():
                    return  # stop() cancelled the restart, not us
                raise

    async def restart(self, reason: str, *, detail: str | None = None) -> None:
        """Drain, restart and resume; a restart already under way is joined, not repeated."""
        if self._stopping or (self.state == EngineLifecycle.STARTING and self._restart_task is None):
            return  # the first start-up is still under way
        task = self._restart_task
        if task is None or task.done():
            task = self._restart_task = self._tasks.spawn(self._restart(reason, detail))
        # A caller that goes away (an HTTP client) must not cancel the restart it asked for.
        await asyncio.shield(task)

    async def stop(self) -> None:
        """End every task of the supervisor, then SIGTERM the engine's group, wait the grace, SIGKILL the rest."""
        self._stopping = True
        await self._tasks.close()
        if self._child is not None:
            await stop_child(self._child, self.stop_grace)
        self._troubles.put_nowait((-1, Trouble("stop", "stopping")))  # wakes run()
        await self._probe.close()
        self._phase.set(EngineLifecycle.DOWN)

    def status(self) -> EngineStatus:
        child = self._child
        live = child is not None and child.running
        cap = self.capacity_from_log
        return {
            "state": self.state,
            "url": self.url,
            "pid": child.engine_pid() if child and live else None,
            "pgid": child.pgid if child and live else None,
            "command": redact(child.command) if child else None,
            "restarts": self.restarts,
            "restarts_by_reason": dict(self.restarts_by_reason),
            "last_restart_reason": self.last_restart_reason,
            "last_restart_detail": self.last_restart_detail,
            "last_error": self.last_error,
            "last_exit_code": self.last_exit_code,
            "max_model_len": self.max_model_len,
            "capacity_from_log": {"kv_tokens": cap[0], "blocks": cap[1]} if cap else None,
            "autofit": list(self.autofit_log),
            "overrides": dict(self._overrides),
            "startup_seconds": self._startup_seconds,
            "uptime_seconds": self.clock() - self._ready_since if self._ready_since is not None else None,
        }

    async def failure_noticed(self, timeout: float = FAILURE_NOTICE_TIMEOUT) -> bool:
        """Wait until the engine is no longer ready (admission is then paused for its restart).

        A request that failed because the engine died retries only after this, so that it queues for
        the restart instead of reaching the dead port again. False after ``timeout`` with the engine
        still ready: the failure was not the engine's death.
        """
        try:
            await asyncio.wait_for(self._phase.unready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def on_change(self, callback: Callable[[], None]) -> None:
        """``callback`` runs after each change of its lifecycle state (--workers: the authority tells them)."""
        self._phase.on_change = callback

    def retry_after(self) -> float:
        """Seconds a client should wait before retrying while the engine is not ready."""
        return self._phase.retry_after(self._startup_seconds or STARTUP_GUESS, self.settings.drain_timeout)

    # -- restarts -------------------------------------------------------------------------------
    async def _restart(self, reason: str, detail: str | None) -> None:
        self.last_restart_reason, self.last_restart_detail = reason, detail
        if self.state == EngineLifecycle.DOWN:
            self._budget.clear()  # someone asked for it after the gateway gave up
        if self.admission is not None:
            self.admission.pause()
        try:
            self._phase.set(EngineLifecycle.DRAINING)
            # A hung engine finishes nothing; a dead one fails its requests by itself.
            if reason != "hang" and self._child is not None and self._child.running:
                await self._drain()
            if reason == "oom":
                self._lower_max_num_seqs()
            await self._restart_until_ready(reason)
        finally:
            if self.admission is not None:
                # Also when down: queued requests then fail fast with 503 instead of waiting forever.
                self.admission.resume()

    async def _drain(self) -> None:
        if self.admission is None:
            return
        if not await self.admission.wait_idle(self.settings.drain_timeout):
            log.warning(
                "drain timeout: %d requests still in flight after %g s; restarting anyway",
                self.admission.in_flight, self.settings.drain_timeout,
            )

    async def _restart_until_ready(self, reason: str) -> None:
        while True:
            if (error := self._budget.exhausted()) is not None:
                await self._give_up(error)
                return
            self._phase.set(EngineLifecycle.RESTARTING)
            delay = self._budget.delay()
            if delay > 0:
                log.info("restart back-off: %.1f s", delay)
                await asyncio.sleep(delay)
            self._budget.record()
            self.restarts += 1
            self.restarts_by_reason[reason] += 1
            if self._child is not None:
                await stop_child(self._child, self.stop_grace)
            t0 = self.clock()
            try:
                await self._launch_until_ready()
            except SupervisorError as e:
                self.last_error = e.message
                self.metrics.record_restart(reason)
                log.error("%s: restart failed: %s", self._who, e.message)
                continue
            self._startup_seconds = self.clock() - t0
            self.metrics.record_restart(reason, self._startup_seconds)
            log.info("%s restarted (%s) in %.1f s", self._who, reason, self._startup_seconds)
            return

    async def _give_up(self, error: str) -> None:
        self.last_error = error
        log.error("%s is down: %s", self._who, error)
        if self._child is not None:
            await stop_child(self._child, self.stop_grace)
        self._phase.set(EngineLifecycle.DOWN)

    def _lower_max_num_seqs(self) -> None:
        current, new = fewer_seqs(self._args())
        self._overrides["--max-num-seqs"] = str(new)
        self.autofit_log.append(f"out of memory while serving: max_num_seqs {current} -> {new}")
        log.warning("after an out-of-memory error, max_num_seqs %d -> %d", current, new)

    # -- launching ------------------------------------------------------------------------------
    async def _launch_until_ready(self) -> None:
        attempts = 0
        while True:
            child = await self._launch()
            problem = await self._probe.wait_ready(child.proc, child.started_at + self.settings.startup_timeout)
            if problem is None:
                self._on_ready(child)
                return
            if problem == "exit":
                self.last_exit_code = child.proc.returncode
            await stop_child(child, self.stop_grace)
            if problem == "timeout":
                raise SupervisorError(
                    f"vLLM was not ready within the start-up timeout of {self.settings.startup_timeout:g} s",
                    retry_after=self.retry_after(),
                )
            await self._autofit(child, attempts)
            attempts += 1

    async def _autofit(self, child: EngineChild, attempts: int) -> None:
        """Apply the next auto-fit step for a failed start-up, or raise why there is none."""
        failure = child.facts.failure
        holders: list[str] = []
        if isinstance(failure, InsufficientFreeMemory) and self.gpu is not None:
            holders = await asyncio.to_thread(self.gpu.holders)
        step = next_fit(
            failure, child.command, child.facts.device, holders, attempts=attempts,
            limit=self.settings.autofit_attempts, exit_code=child.proc.returncode,
        )
        if isinstance(step, str):
            raise SupervisorError(step)
        self._overrides.update(step.changes)
        self.autofit_log.append(step.reason)
        log.warning("auto-fit %d/%d: %s", attempts + 1, self.settings.autofit_attempts, step.reason)

    def _args(self) -> list[str]:
        return engine_args(self.settings, self._overrides, self.port)

    async def _launch(self) -> EngineChild:
        assert self._base is not None, "start() resolves the command first"
        self._gen += 1
        child = await launch_child(
            [*self._base, *self._args()], self._gen, grace=self.stop_grace, started_at=self.clock(),
            redactor=self._redactor, on_line=self._on_line,
            env={"CUDA_VISIBLE_DEVICES": self.devices} if self.devices is not None else None,
            label="vllm" if self.settings.engine_count() == 1 else f"vllm {self.index}",
        )
        self._child = child  # stop() must find it even while it is still starting
        return child

    def _on_ready(self, child: EngineChild) -> None:
        self._ready_since = self.clock()
        cap = child.facts.capacity(None)
        log.info("%s ready at %s (pid %s, KV capacity from log: %s)", self._who, self.url, child.engine_pid(), cap)
        niceness = self.settings.engine_core_nice
        if niceness is not None:
            cores = renice_engine_cores(guardian.group_pids(child.pgid), niceness)
            log.info("%s: engine core processes %s at niceness %d", self._who, cores or "(none found)", niceness)
        self._phase.set(EngineLifecycle.READY)
        self._tasks.spawn(self._watch(child))

    # -- watching -------------------------------------------------------------------------------
    def _on_line(self, child: EngineChild, line: str, events: list[LogEvent]) -> None:
        if child.reported or self._child is not child or self.state != EngineLifecycle.READY:
            return
        # Acting on the log line, before the API server exits, stops admitting requests it would fail.
        if child.facts.oom is not None and any(isinstance(e, CudaOutOfMemory) for e in events):
            child.reported = True
            self._post(child, Trouble("oom", describe_failure(child.facts.oom) + " while serving"))
        elif any(isinstance(e, EngineDead) for e in events):
            child.reported = True
            self._post(child, Trouble("exit", f"vLLM's engine process died: {line[-200:]}"))

    def _post(self, child: EngineChild, trouble: Trouble) -> None:
        self._troubles.put_nowait((child.gen, trouble))

    async def _watch(self, child: EngineChild) -> None:
        dog = Watchdog(
            self.clock(), hang_timeout=self.settings.hang_timeout,
            growth_mib=self.settings.fragmentation_growth_mib, storm=self.settings.preemption_storm,
        )
        trouble = await self._probe.watch(child.proc, dog, engine=self.engine, gpu=self.gpu)
        if trouble is None:
            await self._on_exit(child)
        else:
            self._post(child, trouble)

    async def _on_exit(self, child: EngineChild) -> None:
        if child.expected_exit:
            return
        self.last_exit_code = child.proc.returncode
        await child.last_lines(EXIT_LINES_TIMEOUT)
        guardian.signal_group(child.pgid, signal.SIGKILL)
        if child.facts.oom is not None:
            self._post(child, Trouble("oom", describe_failure(child.facts.oom)))
        else:
            last = child.tail[-1] if child.tail else "no output"
            self._post(child, Trouble("exit", f"vLLM exited with code {child.proc.returncode} ({last})"))
