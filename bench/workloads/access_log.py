"""What one access-log record costs the caller (the event loop): ``AccessLog.write`` as ``vllm-guard serve`` runs
it, with the process-wide log redaction installed and the default handler's batches and writer thread, on an event
loop, writing to a pipe that a thread reads at once.

Run by ``python -m bench run access-log``. Three records: an ordinary one, and the same refused with a model name
of 1 MiB and of 8 MiB (a client's, under the default ``--max-body-bytes``): every field is cut to a bounded form
before it is written, so the huge ones should cost about what the ordinary one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from gateway.observe.access_log import AccessLog, AccessLogFormat, AccessRecord, install_default_handler
from gateway.redact import SecretRedactor, install_log_redaction

RECORD = AccessRecord(
    time=1_795_000_000.25, request_id="0a1b2c3d4e5f00000001", tenant="team-a", route="chat",
    model="Qwen/Qwen2.5-0.5B-Instruct", status=200, outcome="ok", reason=None, prompt_tokens=12,
    max_tokens_asked=4000, max_tokens=2036, truncated_tokens=0, queue_ms=1.26, engine="0", ttft_ms=15.04,
    duration_ms=40.0, completion_tokens=7, trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
)  # fmt: skip
# A key the redaction looks for in every record, as a configured gateway's would.
CONFIGURED_KEY = "sk-some-configured-key-0123"


@dataclass(frozen=True)
class Case:
    key: str  # the figures' key: the caller's microseconds per record (``_written_us``, ``_cpu_us`` beside it)
    label: str
    record: AccessRecord
    count: int  # records written per run; fewer of the huge ones, each of which is built once


def cases(scale: float = 1.0) -> list[Case]:
    """The three records; ``scale`` multiplies how many of each one run writes (tests write a few)."""
    refused = replace(RECORD, status=404, outcome="refused")
    return [
        Case("ordinary_us", "an ordinary record", RECORD, max(1, round(10_000 * scale))),
        Case("model_1mib_us", "a 1 MiB model name", replace(refused, model="x" * (1 << 20)), max(1, round(20 * scale))),
        Case("model_8mib_us", "an 8 MiB model name", replace(refused, model="m\u00e9" * (4 << 20)),
             max(1, round(10 * scale))),
    ]  # fmt: skip


def _drained_pipe() -> tuple[int, int]:
    """A pipe whose read end a thread empties as fast as it can, until its write end is closed."""
    read, write = os.pipe()

    def drain() -> None:
        with contextlib.suppress(OSError):
            while os.read(read, 1 << 20):
                pass
        os.close(read)

    threading.Thread(target=drain, daemon=True, name="access-log-drain").start()
    return read, write


@contextlib.contextmanager
def _serving_log(fmt: AccessLogFormat) -> Iterator[AccessLog]:
    """The access log as ``vllm-guard serve`` sets it up, undone at the end."""
    undo = install_log_redaction(SecretRedactor([CONFIGURED_KEY]))
    _, write = _drained_pipe()
    stream = os.fdopen(write, "w", buffering=1 << 16)
    handler = install_default_handler(fmt, stream)
    try:
        yield AccessLog(fmt)
    finally:
        if handler is not None:
            handler.stop()
        stream.close()
        undo()


async def _write_on_a_loop(fmt: AccessLogFormat, record: AccessRecord, count: int, wall0: float) -> float:
    """``count`` records written on an event loop, as the gateway writes them (batched there for the writer's
    thread); the caller's seconds since ``wall0``."""
    with _serving_log(fmt) as log:
        for _ in range(count):
            log.write(record)
        return time.perf_counter() - wall0


def caller_cost(fmt: AccessLogFormat, scale: float = 1.0, pause_s: float = 0.2) -> dict[str, float]:
    """Each case's cost per record, in microseconds: the caller's time (what the event loop pays: an append to
    the batch handed to the writer's thread), the wall time until every record was written (the writer thread
    formats, redacts and writes them), and the process's CPU over that time (every thread's: the writer's work
    holds the interpreter's lock the loop needs). Each case gets a fresh writer; the machine settles between
    cases."""
    figures: dict[str, float] = {}
    for case in cases(scale):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        caller = asyncio.run(_write_on_a_loop(fmt, case.record, case.count, wall0))
        # Leaving the block stopped the writer once it had written everything waiting.
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        stem = case.key.removesuffix("_us")
        figures |= {f"{stem}_us": caller / case.count * 1e6, f"{stem}_written_us": wall / case.count * 1e6,
                    f"{stem}_cpu_us": cpu / case.count * 1e6}
        time.sleep(pause_s)
    return figures
