"""CPU accounting from /proc: a process's threads and the children it started, reaped or running."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.harness.cpu import TICK, Meter, cores_busy, cpu_seconds, parse_stat, per, process_table, sched, tree_seconds

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


def stat_line(pid: int, name: str, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> str:
    # Fields 1-17 of /proc/<pid>/stat; the rest do not matter here.
    return f"{pid} ({name}) S {ppid} 1 1 0 -1 4194560 100 0 0 0 {utime} {stime} {cutime} {cstime} 20 0 1 0"


def test_a_stat_line_is_read_after_the_last_parenthesis_of_the_command_name() -> None:
    line = stat_line(42, "python (worker) 1", 7, utime=3 * TICK, stime=TICK, cutime=TICK, cstime=TICK)
    assert parse_stat(line) == (7, 4.0, 2.0)


def test_a_tree_counts_every_descendant_and_what_each_reaped_but_nothing_beside_it() -> None:
    table = {
        10: (1, 1.0, 0.5),  # the gateway, which reaped a child that used 0.5 s
        11: (10, 2.0, 0.0),  # a worker
        12: (11, 0.25, 0.0),  # the worker's own child
        20: (1, 9.0, 0.0),  # another process beside it
    }
    assert tree_seconds(10, table) == 3.75
    assert tree_seconds(11, table) == 2.25
    assert tree_seconds(99, table) == 0.0


@linux
def test_a_busy_child_shows_in_its_parents_tree() -> None:
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while cpu_seconds(child.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cpu_seconds(os.getpid()) >= cpu_seconds(child.pid) >= 0.25
        assert child.pid in process_table()
    finally:
        child.kill()
        child.wait()


@linux
def test_a_meter_gives_what_this_process_spent_over_its_stretch() -> None:
    meter = Meter({"client": 0, "me": os.getpid()}).start()
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
    spent = meter.stop()
    # /proc counts in clock ticks (10 ms): 0.05 s of CPU can read one tick short, and 4 ticks as 0.0399999...
    assert spent["client"] >= 0.03 and spent["me"] >= 0.0


@linux
def test_the_kernels_account_of_this_process_grows_as_it_runs() -> None:
    before = sched(os.getpid())
    sum(i * i for i in range(200_000))
    spent = sched(os.getpid()) - before
    assert spent.ran > 0 and spent.waited >= 0 and spent.slices >= 0


def test_per_unit_and_cores_busy() -> None:
    assert per(0.5, 1000) == 500.0
    assert per(1.0, 0) != per(1.0, 0)  # NaN: nothing was counted
    assert cores_busy({"engine": 1.0, "gateway": 0.5}, 3.0) == 0.5
    assert cores_busy([2.0], 0.0) == 0.0
