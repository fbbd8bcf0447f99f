"""The guardian runs a command in a process group of its own, in the gateway's session (where the kernel shares the
CPU between sessions first, an engine in a session of its own starved the gateway), and stopping it takes the whole
group, also a process that ignores SIGTERM or is stopped (SIGSTOP)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from gateway.managed import guardian
from tests.support.procs import alive

SLEEPER = "import sys, time; print('up', flush=True); time.sleep(3600)"
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)']); "
    "print(kid.pid, flush=True); time.sleep(3600)"
)


def gone(pid: int, timeout: float = 5.0) -> bool:
    """The process has ended (SIGKILL is delivered asynchronously: kill() returns before the exit)."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def test_the_command_runs_under_the_guardian_in_its_own_group_in_the_gateway_s_session() -> None:
    proc = await guardian.launch([sys.executable, "-c", SLEEPER], grace=1.0, env=dict(os.environ), line_limit=1024)
    try:
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"up\n"
        engine = guardian.engine_pid(proc.pid)
        assert engine is not None and engine != proc.pid
        assert os.getpgid(engine) == proc.pid != os.getpgid(0)
        assert os.getsid(engine) == os.getsid(proc.pid) == os.getsid(0)
        assert sorted(guardian.group_pids(proc.pid)) == sorted([proc.pid, engine])
        assert await guardian.stop(proc, grace=1.0)
        assert gone(engine)
        assert guardian.group_pids(proc.pid) == []
    finally:
        guardian.signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()


def test_the_guardian_leads_its_group_in_the_gateway_s_session_under_uvloop_too() -> None:
    """The gateway serves on uvloop, whose subprocess_exec takes no ``process_group``: the guardian makes its group
    itself, and ``launch`` returns once it leads it."""
    uvloop = pytest.importorskip("uvloop")

    async def launched() -> tuple[int, int, int]:
        proc = await guardian.launch([sys.executable, "-c", SLEEPER], grace=1.0, env=dict(os.environ), line_limit=1024)
        try:
            return proc.pid, os.getpgid(proc.pid), os.getsid(proc.pid)
        finally:
            await guardian.stop(proc, grace=1.0)
            # Its output read to the end, as the supervisor reads it: the pipe's transport then closes before the
            # loop does (uvloop refuses to close a loop with a handle still open: EBUSY, seen once in CI).
            assert proc.stdout is not None
            await asyncio.wait_for(proc.stdout.read(), 10.0)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        pid, group, session = runner.run(launched())
    assert group == pid and session == os.getsid(0)
    assert gone(pid)


@pytest.mark.parametrize("pause_it", [False, True])
async def test_stop_kills_what_ignores_sigterm_or_is_stopped(pause_it: bool) -> None:
    proc = await guardian.launch([sys.executable, "-c", STUBBORN], grace=0.3, env=dict(os.environ), line_limit=1024)
    try:
        assert proc.stdout is not None
        grandchild = int(await proc.stdout.readline())
        engine = guardian.engine_pid(proc.pid)
        assert engine is not None
        if pause_it:
            os.kill(engine, signal.SIGSTOP)
        await guardian.stop(proc, grace=0.3)
        assert gone(engine)
        assert gone(grandchild)
        assert guardian.group_pids(proc.pid) == []
    finally:
        guardian.signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()


def test_a_group_that_does_not_exist_has_no_processes_and_takes_signals_quietly() -> None:
    gone = 2**22 + 12345  # above the largest pid Linux can hand out
    assert guardian.group_pids(gone) == []
    guardian.signal_group(gone, signal.SIGTERM)
    assert guardian.engine_pid(gone) is None
