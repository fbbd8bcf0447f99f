"""The niceness of a managed vLLM's engine core processes (``--engine-core-nice``).

vLLM's engine core waits for its worker's answer every step by spinning: after each read of the worker's queue
it calls ``sched_yield`` in a loop for a second before it sleeps on a socket (``SpinCondition.wait`` in
``vllm/distributed/device_communicators/shm_broadcast.py``, read in 0.32). On a host where it shares CPU cores
with vLLM's API server and the gateway (a small host; vLLM's CPU build, whose worker holds the other cores), that
spin takes the turns they need to read requests and relay tokens. A higher niceness leaves the engine core's own
work first whenever no one else waits, and hands the core to the others when they do. Measured on two cores at 24
chat streams a second (docs/history/realistic-engine-core-niceness.md, "Where a first token's time goes at
capacity"): with the engine core at niceness 10 the gateway's event loop ran 25-78 ms late instead of 45-440 ms,
and its mean time to first token came to 1.15x vLLM alone's instead of 3.5-12x (median 6x), at the same tokens a
second.

Linux keeps a niceness per thread, and a thread takes its creator's: each thread of the process is set, once the
engine is ready (its threads are started by then; any later one inherits from its starter).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

# The kernel keeps 15 characters of a process name: vLLM names its engine cores VLLM::EngineCore (with _DP<n> under
# data parallelism).
ENGINE_CORE_NAME = "VLLM::EngineCor"

SetPriority = Callable[[int, int], None]


def _set_thread_priority(tid: int, niceness: int) -> None:
    os.setpriority(os.PRIO_PROCESS, tid, niceness)


def renice_engine_cores(
    pids: Iterable[int], niceness: int, *, proc: Path = Path("/proc"), set_priority: SetPriority = _set_thread_priority
) -> list[int]:
    """Every thread of each engine core among ``pids`` at ``niceness``; returns the engine cores' pids. A process
    gone meanwhile is skipped; a niceness the gateway may not set (below its own, without ``CAP_SYS_NICE``) is
    logged and skipped."""
    done: list[int] = []
    for pid in pids:
        try:
            if not (proc / str(pid) / "comm").read_text(encoding="utf-8").startswith(ENGINE_CORE_NAME):
                continue
            tids = [int(entry.name) for entry in (proc / str(pid) / "task").iterdir() if entry.name.isdigit()]
        except OSError:
            continue
        try:
            for tid in tids:
                try:
                    set_priority(tid, niceness)
                except ProcessLookupError:
                    continue  # a thread that ended meanwhile
        except PermissionError as exc:
            log.warning("could not set the niceness of vLLM's engine core (pid %d) to %d: %s", pid, niceness, exc)
            continue
        done.append(pid)
    return done
