"""One run of the engine process: launched under the guardian, its log read line by line, stopped as a group."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.managed import guardian
from gateway.managed.command import redact
from gateway.managed.logfacts import LogEvent, LogFacts, log_level
from gateway.redact import SecretRedactor

log = logging.getLogger(__name__)
relay_log = logging.getLogger("gateway.vllm")  # vLLM's own lines, relayed

_LOG_LINE_LIMIT = 4 * 1024 * 1024
# The log's last lines say why it failed; the pipe ends once the whole group is gone.
LAST_LINES_TIMEOUT = 5.0

LineHandler = Callable[["EngineChild", str, list[LogEvent]], None]


@dataclass
class EngineChild:
    """The guardian process of one engine run and what its log has said so far."""

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

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    def engine_pid(self) -> int | None:
        """The vLLM API server (the guardian's child)."""
        return guardian.engine_pid(self.proc.pid)

    async def last_lines(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the log to end, leaving the reader running if it has not."""
        if self.reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.reader), timeout)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)  # the engine inherits the gateway's environment
    env.update(extra or {})
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def launch_child(
    command: Sequence[str], gen: int, *, grace: float, started_at: float, redactor: SecretRedactor,
    on_line: LineHandler, env: dict[str, str] | None = None, label: str = "vllm",
) -> EngineChild:
    """Start the engine under the guardian and begin reading its log, each line handed to ``on_line``."""
    log.info("starting vLLM: %s", shlex.join(redact(command)))
    proc = await guardian.launch(command, grace=grace, env=child_env(env), line_limit=_LOG_LINE_LIMIT)
    child = EngineChild(proc=proc, gen=gen, command=list(command), started_at=started_at)
    child.reader = asyncio.create_task(_read_log(child, redactor, on_line, label))
    return child


async def stop_child(child: EngineChild, grace: float) -> None:
    """Stop the whole process group, then let the reader take in the last lines (or cancel it)."""
    child.expected_exit = True
    if not await guardian.stop(child.proc, grace):
        log.warning("vLLM did not stop within %g s; killed it", grace)
    await child.last_lines(LAST_LINES_TIMEOUT)
    reader = child.reader
    if reader is not None and not reader.done():
        # Something outside the group still holds the pipe open: the reader is not left behind for it.
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _read_log(child: EngineChild, redactor: SecretRedactor, on_line: LineHandler, label: str) -> None:
    stream = child.proc.stdout
    assert stream is not None
    while True:
        try:
            raw = await stream.readline()
        except ValueError:
            continue  # a line over the limit: dropped, the next one is read
        if not raw:
            return
        # vLLM prints its arguments, --api-key among them: its lines are redacted before they are kept or logged.
        line = redactor.redact(raw.decode("utf-8", "replace").rstrip())
        if not line:
            continue
        child.tail.append(line)
        relay_log.log(log_level(line), "[%s] %s", label, line)
        on_line(child, line, child.facts.feed(line))
