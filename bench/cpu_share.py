"""CPU accounting for the benchmarks whose engine, gateway and client share the machine's cores: a process's CPU
time, and a spinner that keeps a set share of a core busy (``bench/realistic.py``'s target ``busy``: what a
gateway's CPU alone costs an engine it shares the cores with)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from types import TracebackType

import psutil

PERIOD_S = 0.01
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


def own_cpu_seconds() -> float:
    """User and system CPU time of this process (every thread), so far."""
    times = psutil.Process().cpu_times()
    return float(times.user + times.system)


class Spinner:
    """A process spinning ``cores`` of one core (at most one) while the ``with`` block runs; ``cpu_s`` is what it
    took, read before it is killed."""

    def __init__(self, cores: float) -> None:
        self.code = SPINNER_CODE.format(share=min(1.0, max(0.0, cores)), period=PERIOD_S)
        self.cpu_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Spinner:
        self._proc = subprocess.Popen([sys.executable, "-c", self.code])
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(proc.pid).cpu_times()
            self.cpu_s = times.user + times.system
        proc.kill()
        proc.wait()
