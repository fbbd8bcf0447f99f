"""--engine-core-nice: every thread of vLLM's engine core processes at the niceness asked, nothing else touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.managed.niceness import ENGINE_CORE_NAME, renice_engine_cores
from testing.fake_vllm import ENGINE_CORE

OTHER = (
    "import threading, time; threading.Thread(target=time.sleep, args=(3600,), daemon=True).start(); "
    "time.sleep(3600)"
)


def threads(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def started(code: str, threads_expected: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while len(threads(proc.pid)) < threads_expected or (
        code == ENGINE_CORE and not Path(f"/proc/{proc.pid}/comm").read_text().startswith(ENGINE_CORE_NAME)
    ):
        assert time.monotonic() < deadline, "the child did not start its threads"
        time.sleep(0.02)
    return proc


@pytest.fixture
def engine_and_other() -> Iterator[tuple[int, int]]:
    engine, other = started(ENGINE_CORE, 2), started(OTHER, 2)
    try:
        yield engine.pid, other.pid
    finally:
        for proc in (engine, other):
            proc.kill()
            proc.wait()


def test_each_thread_of_an_engine_core_takes_the_niceness_and_other_processes_keep_theirs(
    engine_and_other: tuple[int, int],
) -> None:
    engine, other = engine_and_other
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    niceness = min(19, mine + 10)  # raising it needs no privilege
    assert renice_engine_cores([engine, other, 999_999_999], niceness) == [engine]
    assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in threads(engine)} == {niceness}
    assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in threads(other)} == {mine}


def fake_proc(root: Path, pid: int, name: str, tids: list[int]) -> None:
    (root / str(pid) / "task").mkdir(parents=True)
    (root / str(pid) / "comm").write_text(name + "\n")
    for tid in tids:
        (root / str(pid) / "task" / str(tid)).mkdir()


@pytest.mark.parametrize(
    ("refusal", "reniced", "expected"),
    [
        (None, [11, 12, 21], [10, 20]),  # every thread of both engine cores (data parallel: _DP0, _DP1)
        (ProcessLookupError, [12, 21], [10, 20]),  # a thread gone meanwhile is skipped
        (PermissionError, [21], [20]),  # a niceness not allowed is logged, and the rest goes on
    ],
)
def test_engine_cores_are_found_by_name_and_refusals_skip_what_they_concern(
    tmp_path: Path, refusal: type[OSError] | None, reniced: list[int], expected: list[int]
) -> None:
    fake_proc(tmp_path, 10, "VLLM::EngineCor", [11, 12])
    fake_proc(tmp_path, 20, "VLLM::EngineCor", [21])
    fake_proc(tmp_path, 30, "python", [31])
    done: list[int] = []

    def set_priority(tid: int, niceness: int) -> None:
        assert niceness == 10
        if tid == 11 and refusal is not None:
            raise refusal(f"refused for {tid}")
        done.append(tid)

    assert renice_engine_cores([10, 20, 30, 40], 10, proc=tmp_path, set_priority=set_priority) == expected
    assert done == reniced
