"""CPU accounting from /proc: what a process and everything it started spent (every thread, user and system),
what the kernel says of their waits for a core, and a spinner that keeps a set share of a core busy.

A benchmark that shares the machine's cores between the engine, a proxy and the client cannot read the proxy's
cost off throughput alone (the load generator or the engine may bind first); its CPU seconds per request and per
relayed token can: ``Meter`` takes them over a run, ``cores_busy`` says how near the cores were to full.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

TICK = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


def _stat_fields(text: str) -> list[str]:
    # The command name (field 2) may hold spaces and parentheses: the fields start after its last ")".
    return text.rsplit(")", 1)[1].split()


def parse_stat(text: str) -> tuple[int, float, float]:
    """(parent pid, own CPU seconds, reaped children's CPU seconds) of one ``/proc/<pid>/stat`` line."""
    fields = _stat_fields(text)  # fields[0] is field 3 (state)
    ppid = int(fields[1])
    own = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime: every thread of the process
    reaped = (int(fields[13]) + int(fields[14])) / TICK  # cutime, cstime: children it waited for
    return ppid, own, reaped


def process_table(proc: Path = PROC) -> dict[int, tuple[int, float, float]]:
    """Every process's (parent, own CPU seconds, reaped children's) now."""
    table: dict[int, tuple[int, float, float]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            table[int(entry.name)] = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
    return table


def tree_seconds(root: int, table: Mapping[int, tuple[int, float, float]]) -> float:
    """CPU seconds of ``root`` and its descendants: their threads, and the children each of them reaped."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            _, own, reaped = table[pid]
            total += own + reaped
            todo.extend(children.get(pid, ()))
    return total


def own_seconds(pid: int) -> float:
    """CPU seconds of the process ``pid`` alone (every thread; not the processes it started), so far."""
    try:
        return parse_stat((PROC / str(pid) / "stat").read_text())[1]
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and everything it started, so far (0 once it is gone)."""
    return tree_seconds(pid, process_table())


def own_cpu_seconds() -> float:
    """This process's CPU seconds (every thread)."""
    times = os.times()
    return times.user + times.system


class Meter:
    """CPU seconds of named process trees over a stretch of time: ``start()``, then ``stop()`` gives the deltas.
    The name ``client`` with pid 0 stands for this process."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self._before: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        table = process_table()
        return {name: own_cpu_seconds() if pid == 0 else tree_seconds(pid, table) for name, pid in self.pids.items()}

    def start(self) -> Meter:
        self._before = self._now()
        return self

    def stop(self) -> dict[str, float]:
        now = self._now()
        return {name: max(0.0, now[name] - self._before.get(name, 0.0)) for name in self.pids}


def per(cpu_s: float, count: float, scale: float = 1e6) -> float:
    """CPU per unit (microseconds by default); NaN when nothing was counted."""
    return cpu_s * scale / count if count else float("nan")


def cores_busy(cpu: Mapping[str, float] | Iterable[float], wall_s: float) -> float:
    """How many cores the processes kept busy together over ``wall_s``."""
    values = cpu.values() if isinstance(cpu, Mapping) else cpu
    return sum(values) / wall_s if wall_s > 0 else 0.0


@dataclass(frozen=True)
class Sched:
    """What the kernel counted for a process's threads: seconds run, seconds runnable but waiting, slices."""

    ran: float
    waited: float
    slices: int

    def __sub__(self, other: Sched) -> Sched:
        return Sched(self.ran - other.ran, self.waited - other.waited, self.slices - other.slices)


def sched(pid: int, proc: Path = PROC) -> Sched:
    """The sums over a process's threads of ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds run and waited)."""
    ran = waited = slices = 0
    for task in (proc / str(pid) / "task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue  # the thread ended meanwhile
        ran, waited, slices = ran + int(fields[0]), waited + int(fields[1]), slices + int(fields[2])
    return Sched(ran / 1e9, waited / 1e9, slices)


SPINNER_PERIOD_S = 0.01
# Spins for its share of each period and sleeps the rest, at the niceness a gateway runs at (0).
SPINNER_CODE = """
import time
share, period = {share!r}, {period!r}
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < share * period:
        pass
    time.sleep(max(0.0, period - (time.perf_counter() - start)))
"""


class Spinner:
    """A process spinning ``cores`` of one core (at most one) while the ``with`` block runs; ``cpu_s`` is what it
    took, read before it is killed. What a proxy's CPU alone costs an engine that shares the cores with it."""

    def __init__(self, cores: float, *, session: bool = False) -> None:
        self.code = SPINNER_CODE.format(share=min(1.0, max(0.0, cores)), period=SPINNER_PERIOD_S)
        self.session = session  # in a session of its own, as another service of the host runs
        self.cpu_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Spinner:
        self._proc = subprocess.Popen([sys.executable, "-c", self.code], start_new_session=self.session)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self.cpu_s = cpu_seconds(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
