"""Managed vLLM: launch, readiness, start-up auto-fit, crash/hang/fragmentation restarts with drain.

The engine runs on a private port in its own process group under a guardian (gateway/managed/guardian.py), so
that no engine process outlives the gateway; this module decides when to start, stop and restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shlex
import signal
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from gateway import gpu as gpu_facts
from gateway.config import Settings
from gateway.errors import UpstreamUnavailable
from gateway.managed import guardian
from gateway.managed.vllm_log import (
    CudaOutOfMemory,
    EngineDead,
    InsufficientFreeMemory,
    LogFacts,
    Trouble,
    Watchdog,
    arg_value,
    base_command,
    describe_failure,
    engine_args,
    log_level,
    parse_progress,
    plan_autofit,
    redact,
)
from gateway.metrics import Metrics
from gateway.redact import SecretRedactor

log = logging.getLogger(__name__)
vllm_log = logging.getLogger("gateway.vllm")

DEFAULT_MAX_NUM_SEQS = 256
OOM_SEQS_FACTOR = 0.75
# Before the first start-up has been timed, clients are told to come back in this many seconds.
STARTUP_GUESS = 30.0
# A dead engine is seen within a watch tick plus the last lines of its log (at most ~3 s here).
FAILURE_NOTICE_TIMEOUT = 5.0
BACKOFF_MAX = 60.0
# Down waits for an operator (POST /guard/restart); the OpenAI SDKs wait at most 60 s anyway.
DOWN_RETRY_AFTER = 60.0
_LOG_LINE_LIMIT = 4 * 1024 * 1024


class SupervisorError(UpstreamUnavailable):
    """The managed engine could not be (re)started; the message says why, with vLLM's numbers."""

    code = "upstream_down"


# -- what the supervisor uses of the other parts --------------------------------------------------
class AdmissionControl(Protocol):
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    @property
    def in_flight(self) -> int: ...
    async def wait_idle(self, timeout: float) -> bool: ...


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


@dataclass
class _Child:
    proc: asyncio.subprocess.Process
    gen: int
    command: list[str]
    started_at: float
    facts: LogFacts = field(default_factory=LogFacts)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=50))
    reader: asyncio.Task[None] | None = None
    expected_exit: bool = False
    reported: bool = False

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def engine_pid(self) -> int | None:
        """The vLLM API server (the guardian's child)."""
        return guardian.engine_pid(self.proc.pid)


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        admission: AdmissionControl | None = None,
        engine: EngineWatch | None = None,
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
        self.backoff_base = backoff_base
        self.port = settings.vllm_port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = "starting"
        self.restarts = 0
        self.restarts_by_reason: Counter[str] = Counter()
        self.last_restart_reason: str | None = None
        self.last_restart_detail: str | None = None
        self.last_error: str | None = None
        self.last_exit_code: int | None = None
        self.autofit_log: list[str] = []
        # vLLM prints its arguments, --api-key among them: its lines are redacted before they are kept or logged.
        self._redactor = SecretRedactor.for_settings(settings)
        self._overrides: dict[str, str] = {}
        self._base: list[str] | None = None
        self._child: _Child | None = None
        self._gen = 0
        self._history: deque[float] = deque()
        self._troubles: asyncio.Queue[tuple[int, Trouble]] = asyncio.Queue()
        self._watch_task: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False
        self._phase_since = clock()
        self._startup_seconds: float | None = None
        self._ready_since: float | None = None
        self._unready = asyncio.Event()
        self._set_state("starting")

    # -- public ---------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int | None:
        fixed = self._overrides.get("--max-model-len") or arg_value(self._args(), "--max-model-len")
        if fixed is not None:
            return int(fixed)
        return self._child.facts.max_model_len if self._child else None

    @property
    def capacity_from_log(self) -> tuple[int, int] | None:
        if self._child is None:
            return None
        block = arg_value(self._args(), "--block-size")
        return self._child.facts.capacity(int(block) if block else None)

    async def start(self) -> None:
        """Launch vLLM and wait until it serves (auto-fitting on known start-up failures)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._auth_headers())
        if self.gpu is None:
            probe = await asyncio.to_thread(NvmlProbe)
            self.gpu = probe if probe.available else None
        if self._base is None:
            script = None if self.settings.vllm_command else await guardian.detect_vllm_script()
            self._base = base_command(self.settings, script)
        self._set_state("starting")
        t0 = self.clock()
        try:
            await self._launch_until_ready()
        except SupervisorError as e:
            self.last_error = e.message
            self._set_state("down")
            raise
        self._startup_seconds = self.clock() - t0

    async def run(self) -> None:
        """Watch the engine and restart it on crash, hang or fragmentation, until stop()."""
        while not self._stopping:
            gen, trouble = await self._troubles.get()
            if self._stopping or gen != self._gen or self.state != "ready":
                continue  # about an engine already replaced
            log.warning("vLLM needs a restart (%s): %s", trouble.reason, trouble.detail)
            try:
                await self.restart(trouble.reason, detail=trouble.detail)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stopping and task is not None and not task.cancelling():
                    return  # stop() cancelled the restart, not us
                raise

    async def restart(self, reason: str, *, detail: str | None = None) -> None:
        """Drain, restart and resume; a restart already under way is joined, not repeated."""
        if self._stopping or (self.state == "starting" and self._restart_task is None):
            return  # the first start-up is still under way
        task = self._restart_task
        if task is None or task.done():
            task = self._restart_task = asyncio.create_task(self._restart(reason, detail))
        # A caller that goes away (an HTTP client) must not cancel the restart it asked for.
        await asyncio.shield(task)

    async def stop(self) -> None:
        """SIGTERM the engine's process group, wait the grace period, SIGKILL what is left."""
        self._stopping = True
        for task in (self._restart_task, self._watch_task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._child is not None:
            await self._stop_child(self._child)
        self._troubles.put_nowait((-1, Trouble("stop", "stopping")))  # wakes run()
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._set_state("down")

    def status(self) -> dict[str, Any]:
        child = self._child
        now = self.clock()
        cap = self.capacity_from_log
        return {
            "state": self.state,
            "url": self.url,
            "pid": child.engine_pid() if child and child.proc.returncode is None else None,
            "pgid": child.pgid if child and child.proc.returncode is None else None,
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
            "uptime_seconds": now - self._ready_since if self._ready_since is not None else None,
        }

    async def failure_noticed(self, timeout: float = FAILURE_NOTICE_TIMEOUT) -> bool:
        """Wait until the engine is no longer ready (admission is then paused for its restart).

        A request that failed because the engine died retries only after this, so that it queues for
        the restart instead of reaching the dead port again. False after ``timeout`` with the engine
        still ready: the failure was not the engine's death.
        """
        try:
            await asyncio.wait_for(self._unready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def retry_after(self) -> float:
        """Seconds a client should wait before retrying while the engine is not ready."""
        expected = self._startup_seconds or STARTUP_GUESS
        elapsed = self.clock() - self._phase_since
        if self.state == "draining":
            return max(1.0, self.settings.drain_timeout - elapsed + expected)
        if self.state in ("starting", "restarting"):
            return max(1.0, expected - elapsed)
        if self.state == "down":
            return DOWN_RETRY_AFTER
        return 1.0

    # -- restarts -------------------------------------------------------------------------------
    async def _restart(self, reason: str, detail: str | None) -> None:
        self.last_restart_reason, self.last_restart_detail = reason, detail
        if self.state == "down":
            self._history.clear()  # someone asked for it after the gateway gave up
        if self.admission is not None:
            self.admission.pause()
        try:
            self._set_state("draining")
            child = self._child
            # A hung engine finishes nothing; a dead one fails its requests by itself.
            if self.admission is not None and reason != "hang" and child and child.proc.returncode is None:
                idle = await self.admission.wait_idle(self.settings.drain_timeout)
                if not idle:
                    log.warning(
                        "drain timeout: %d requests still in flight after %g s; restarting anyway",
                        self.admission.in_flight, self.settings.drain_timeout,
                    )
            if reason == "oom":
                self._lower_max_num_seqs()
            await self._restart_until_ready(reason)
        finally:
            if self.admission is not None:
                # Also when down: queued requests then fail fast with 503 instead of waiting forever.
                self.admission.resume()

    async def _restart_until_ready(self, reason: str) -> None:
        while True:
            now = self.clock()
            while self._history and now - self._history[0] >= self.settings.restart_window:
                self._history.popleft()
            if len(self._history) >= self.settings.max_restarts:
                self.last_error = (
                    f"{len(self._history)} restarts within {self.settings.restart_window:g} s "
                    f"(limit {self.settings.max_restarts}); giving up"
                )
                log.error("vLLM is down: %s", self.last_error)
                if self._child is not None:
                    await self._stop_child(self._child)
                self._set_state("down")
                return
            self._set_state("restarting")
            delay = min(BACKOFF_MAX, self.backoff_base * 2 ** (len(self._history) - 1)) if self._history else 0.0
            if delay > 0:
                log.info("restart back-off: %.1f s", delay)
                await asyncio.sleep(delay)
            self._history.append(self.clock())
            self.restarts += 1
            self.restarts_by_reason[reason] += 1
            if self._child is not None:
                await self._stop_child(self._child)
            t0 = self.clock()
            try:
                await self._launch_until_ready()
            except SupervisorError as e:
                self.last_error = e.message
                self.metrics.record_restart(reason)
                log.error("restart failed: %s", e.message)
                continue
            self._startup_seconds = self.clock() - t0
            self.metrics.record_restart(reason, self._startup_seconds)
            log.info("vLLM restarted (%s) in %.1f s", reason, self._startup_seconds)
            return

    def _lower_max_num_seqs(self) -> None:
        current = int(self._overrides.get("--max-num-seqs") or arg_value(self._args(), "--max-num-seqs")
                      or DEFAULT_MAX_NUM_SEQS)
        new = max(1, math.floor(current * OOM_SEQS_FACTOR))
        self._overrides["--max-num-seqs"] = str(new)
        self.autofit_log.append(f"out of memory while serving: max_num_seqs {current} -> {new}")
        log.warning("after an out-of-memory error, max_num_seqs %d -> %d", current, new)

    # -- launching ------------------------------------------------------------------------------
    async def _launch_until_ready(self) -> None:
        attempts = 0
        while True:
            child = await self._launch()
            problem = await self._wait_ready(child)
            if problem is None:
                self._on_ready(child)
                return
            await self._stop_child(child)
            if problem == "timeout":
                raise SupervisorError(
                    f"vLLM was not ready within the start-up timeout of {self.settings.startup_timeout:g} s",
                    retry_after=self.retry_after(),
                )
            failure = child.facts.failure
            holders: list[str] = []
            if isinstance(failure, InsufficientFreeMemory) and self.gpu is not None:
                holders = await asyncio.to_thread(self.gpu.holders)
            step = plan_autofit(failure, child.command, child.facts.device, holders)
            head = f"vLLM exited with code {child.proc.returncode} during start-up"
            if isinstance(step, str):
                raise SupervisorError(f"{head}: {step}")
            if attempts >= self.settings.autofit_attempts:
                raise SupervisorError(
                    f"{head}: {describe_failure(failure) if failure else 'unknown'}; gave up after "
                    f"{attempts} auto-fit attempts (limit {self.settings.autofit_attempts})"
                )
            attempts += 1
            self._overrides.update(step.changes)
            self.autofit_log.append(step.reason)
            log.warning("auto-fit %d/%d: %s", attempts, self.settings.autofit_attempts, step.reason)

    def _args(self) -> list[str]:
        return engine_args(self.settings, self._overrides, self.port)

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)  # the engine inherits the gateway's environment
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    async def _launch(self) -> _Child:
        assert self._base is not None, "start() resolves the command first"
        command = [*self._base, *self._args()]
        self._gen += 1
        log.info("starting vLLM: %s", shlex.join(redact(command)))
        proc = await guardian.launch(
            command, grace=self.stop_grace, env=self._child_env(), line_limit=_LOG_LINE_LIMIT
        )
        child = _Child(proc=proc, gen=self._gen, command=command, started_at=self.clock())
        child.reader = asyncio.create_task(self._read_log(child))
        self._child = child  # stop() must find it even while it is still starting
        return child

    async def _wait_ready(self, child: _Child) -> str | None:
        """None once /health and /v1/models answer 200; "exit" or "timeout" otherwise."""
        exited = asyncio.create_task(child.proc.wait())
        deadline = child.started_at + self.settings.startup_timeout
        try:
            while True:
                if exited.done():
                    self.last_exit_code = child.proc.returncode
                    return "exit"
                if await self._get_ok("/health") and await self._get_ok("/v1/models"):
                    return None
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return "timeout"
                await asyncio.wait({exited}, timeout=min(0.2, remaining))
        finally:
            exited.cancel()

    def _on_ready(self, child: _Child) -> None:
        self._ready_since = self.clock()
        cap = child.facts.capacity(None)
        log.info("vLLM ready at %s (pid %s, KV capacity from log: %s)", self.url, child.engine_pid(), cap)
        self._set_state("ready")
        self._watch_task = asyncio.create_task(self._watch(child))

    async def _stop_child(self, child: _Child) -> None:
        child.expected_exit = True
        if not await guardian.stop(child.proc, self.stop_grace):
            log.warning("vLLM did not stop within %g s; killed it", self.stop_grace)
        if child.reader is not None:
            # The log's last lines say why it failed; the pipe ends once the whole group is gone.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(child.reader), 5.0)

    # -- watching -------------------------------------------------------------------------------
    async def _read_log(self, child: _Child) -> None:
        stream = child.proc.stdout
        assert stream is not None
        while True:
            try:
                raw = await stream.readline()
            except ValueError:
                continue  # a line over the limit: dropped, the next one is read
            if not raw:
                return
            line = self._redactor.redact(raw.decode("utf-8", "replace").rstrip())
            if not line:
                continue
            child.tail.append(line)
            vllm_log.log(log_level(line), "[vllm] %s", line)
            events = child.facts.feed(line)
            if child.reported or self._child is not child or self.state != "ready":
                continue
            # Acting on the log line, before the API server exits, stops admitting requests it would fail.
            if child.facts.oom is not None and any(isinstance(e, CudaOutOfMemory) for e in events):
                child.reported = True
                self._post(child, Trouble("oom", describe_failure(child.facts.oom) + " while serving"))
            elif any(isinstance(e, EngineDead) for e in events):
                child.reported = True
                self._post(child, Trouble("exit", f"vLLM's engine process died: {line[-200:]}"))

    def _post(self, child: _Child, trouble: Trouble) -> None:
        self._troubles.put_nowait((child.gen, trouble))

    async def _watch(self, child: _Child) -> None:
        tick = max(0.05, min(1.0, self.settings.hang_timeout / 5))
        dog = Watchdog(
            self.clock(), hang_timeout=self.settings.hang_timeout,
            growth_mib=self.settings.fragmentation_growth_mib, storm=self.settings.preemption_storm,
        )
        exited = asyncio.create_task(child.proc.wait())
        try:
            while True:
                done, _ = await asyncio.wait({exited}, timeout=tick)
                if done:
                    await self._on_exit(child)
                    return
                trouble = await self._check(child, dog, timeout=max(0.1, min(5.0, self.settings.hang_timeout / 2)))
                if trouble is not None:
                    self._post(child, trouble)
                    return
        finally:
            exited.cancel()

    async def _on_exit(self, child: _Child) -> None:
        if child.expected_exit:
            return
        self.last_exit_code = child.proc.returncode
        if child.reader is not None:
            # Its last lines (an out-of-memory traceback) decide the reason.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(child.reader), 2.0)
        guardian.signal_group(child.pgid, signal.SIGKILL)
        if child.facts.oom is not None:
            self._post(child, Trouble("oom", describe_failure(child.facts.oom)))
        else:
            last = child.tail[-1] if child.tail else "no output"
            self._post(child, Trouble("exit", f"vLLM exited with code {child.proc.returncode} ({last})"))

    async def _check(self, child: _Child, dog: Watchdog, timeout: float) -> Trouble | None:
        ok = await self._get_ok("/health", timeout=timeout)
        trouble = dog.observe_health(self.clock(), ok)
        if trouble is not None or not ok:
            return trouble
        progress = await self._progress(timeout)
        if progress is not None:
            trouble = dog.observe_engine(self.clock(), *progress)
            if trouble is not None:
                return trouble
        if self.gpu is not None:
            gpu = self.gpu
            mib = await asyncio.to_thread(lambda: gpu.memory_mib(guardian.group_pids(child.pgid)))
            return dog.observe_memory(mib)
        return None

    async def _progress(self, timeout: float) -> tuple[float | None, float | None, float | None] | None:
        """(running, generation tokens, preemptions), from the engine view or a scrape of our own."""
        if self.engine is not None:
            snap = self.engine.snapshot
            if snap is None or not snap.ok:
                return None
            return snap.running, snap.generation_tokens_total, snap.preemptions_total
        text = await self._get_text("/metrics", timeout)
        return parse_progress(text) if text is not None else None

    # -- HTTP -----------------------------------------------------------------------------------
    def _auth_headers(self) -> dict[str, str]:
        key = self.settings.upstream_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _get_text(self, path: str, timeout: float = 2.0) -> str | None:
        if self._session is None:
            return None
        try:
            async with self._session.get(
                self.url + path, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                if resp.status != 200:
                    return None
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def _get_ok(self, path: str, timeout: float = 2.0) -> bool:
        return await self._get_text(path, timeout) is not None

    def _set_state(self, state: str) -> None:
        if state != self.state or state == "starting":
            self._phase_since = self.clock()
        self.state = state
        if state == "ready":
            self._unready.clear()
        else:
            self._unready.set()
        self.metrics.set_upstream_state(state)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
