"""No engine process outlives its supervisor: not on stop, not after a crash, not when the gateway is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from gateway.managed.supervisor import Supervisor
from tests.support.paths import FAKE_VLLM, ROOT
from tests.support.procs import alive
from tests.unit.managed.supervising import eventually, make, running, settings

FAKE = FAKE_VLLM


async def test_stop_takes_the_engines_other_processes_along(state: Path, supervisors: list[Supervisor]) -> None:
    sup, _ = make(supervisors, settings(state, "grandchild"))
    await sup.start()
    grandchild = int((state / "grandchild-1").read_text())
    assert alive(grandchild)
    await sup.stop()
    assert not alive(grandchild)


async def test_a_crashed_engine_leaves_no_process_behind(state: Path, supervisors: list[Supervisor]) -> None:
    sup, _ = make(supervisors, settings(state, "grandchild"))
    await sup.start()
    _, finish = await running(sup)
    grandchild = int((state / "grandchild-1").read_text())
    os.kill(sup.status()["pid"], signal.SIGKILL)
    await eventually(lambda: sup.restarts == 1 and sup.state == "ready")
    assert not alive(grandchild)
    await finish()


PARENT = """
import asyncio, sys
from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.managed.supervisor import Supervisor
from tests.support.paths import FAKE_VLLM, ROOT

async def main():
    s = Settings(managed=True, model="m", vllm_command=sys.argv[1], startup_timeout=120.0)
    sup = Supervisor(s, Metrics(), stop_grace=1.0)
    await sup.start()
    print(sup.status()["pid"], flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_no_orphan_survives_when_the_gateway_is_killed(state: Path) -> None:
    command = f"{sys.executable} {FAKE} --fake-scenario grandchild --fake-state-dir {state}"
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), command], stdout=subprocess.PIPE, cwd=ROOT, text=True
    ) as parent:
        try:
            assert parent.stdout is not None
            engine = int(parent.stdout.readline())
            grandchild = int((state / "grandchild-1").read_text())
            assert alive(engine) and alive(grandchild)
            parent.kill()
            parent.wait()
            deadline = time.monotonic() + 10
            while (alive(engine) or alive(grandchild)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not alive(engine)
            assert not alive(grandchild)
        finally:
            parent.kill()
