"""The supervisor runs a vLLM-like child (tests/support/fake_vllm/server.py): it starts it, fits it, restarts it
on crash, hang and out-of-memory, drains around restarts, gives up within bounds and leaves no orphan."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings
from gateway.managed.guardian import group_pids
from gateway.managed.supervisor import Supervisor, SupervisorError
from gateway.metrics import Metrics
from tests.support.paths import FAKE_VLLM, ROOT
from tests.support.procs import alive

FAKE = FAKE_VLLM


class FakeAdmission:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.in_flight = 0

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    async def wait_idle(self, timeout: float) -> bool:
        self.calls.append(f"wait_idle({timeout:g})")
        return True


class FakeGpu:
    def memory_mib(self, pids: Collection[int]) -> float | None:
        return None

    def holders(self) -> list[str]:
        return ["pid 4242 VLLM::EngineCore on GPU 0: 60000 MiB"]


@dataclass(frozen=True)
class Snapshot:
    ok: bool
    running: int | None
    generation_tokens_total: float | None
    preemptions_total: float | None


class FakeEngine:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot


def settings(state: Path, scenario: str = "ok", *fake: str, **kw: Any) -> Settings:
    command = [sys.executable, str(FAKE), "--fake-scenario", scenario, "--fake-state-dir", str(state), *fake]
    values: dict[str, Any] = {
        "managed": True, "model": "fake-model", "vllm_command": " ".join(command), "startup_timeout": 10.0,
        # Long enough that a busy machine's slow /health answer is not taken for a hang.
        "hang_timeout": 3.0, "drain_timeout": 2.0, "max_restarts": 3, "restart_window": 60.0,
        "autofit_attempts": 3,
    } | kw
    return Settings.model_validate(values)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "fake-state"


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    made: list[Supervisor] = []
    yield made
    # Every engine a test started is gone afterwards, whatever the test did.
    for sup in made:
        child = sup._child
        if child is not None and child.proc.returncode is None:
            os.killpg(child.pgid, signal.SIGKILL)


def make(
    made: list[Supervisor], s: Settings, admission: FakeAdmission | None = None, **kw: Any
) -> tuple[Supervisor, Metrics]:
    metrics = Metrics()
    kw.setdefault("gpu", FakeGpu())
    sup = Supervisor(s, metrics, admission=admission, stop_grace=2.0, backoff_base=0.05, **kw)
    made.append(sup)
    return sup, metrics


async def eventually(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def launches(state: Path) -> int:
    return int((state / "launches").read_text())


def argv(state: Path, launch: int) -> list[str]:
    return list(json.loads((state / f"argv-{launch}.json").read_text()))


def restarts(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("vllm_guard_restarts_total", {"reason": reason})
    return value or 0.0


async def running(sup: Supervisor) -> tuple[asyncio.Task[None], Callable[[], Awaitable[None]]]:
    task = asyncio.create_task(sup.run())

    async def finish() -> None:
        await sup.stop()
        await asyncio.wait_for(task, 5)

    return task, finish


async def test_start_waits_for_ready_and_reads_capacity_from_the_log(
    state: Path, supervisors: list[Supervisor]
) -> None:
    sup, metrics = make(supervisors, settings(state, upstream_api_key="sk-up", served_model_name="served"))
    assert sup.retry_after() >= 1.0
    await sup.start()
    assert sup.state == "ready"
    assert metrics.registry.get_sample_value("vllm_guard_upstream_up") == 1.0
    assert sup.capacity_from_log == (4096, 32)
    assert sup.max_model_len == 32768
    args = argv(state, 1)
    assert args[args.index("--port") + 1] == str(sup.port)
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--api-key") + 1] == "sk-up"
    assert args[args.index("--served-model-name") + 1] == "served"
    status = sup.status()
    assert status["state"] == "ready" and status["restarts"] == 0
    assert "sk-up" not in " ".join(status["command"])
    pid = status["pid"]
    assert pid == int((state / "pid-1").read_text())
    pgid = status["pgid"]
    await sup.stop()
    assert sup.state == "down"
    assert not alive(pid)
    assert group_pids(pgid) == []


async def test_a_crash_is_restarted_with_a_drain_and_counted(state: Path, supervisors: list[Supervisor]) -> None:
    admission = FakeAdmission()
    sup, metrics = make(supervisors, settings(state, "crash-after", "--fake-on", "1"), admission)
    await sup.start()
    _, finish = await running(sup)
    await eventually(lambda: sup.restarts == 1 and sup.state == "ready")
    assert sup.last_restart_reason == "exit"
    assert sup.status()["restarts_by_reason"] == {"exit": 1}
    assert restarts(metrics, "exit") == 1.0
    assert launches(state) == 2
    # The dead engine had nothing to drain; admission was paused around the restart and resumed.
    assert admission.calls == ["pause", "resume"]
    await finish()


async def test_an_engine_death_in_the_log_restarts_before_the_api_server_exits(
    state: Path, supervisors: list[Supervisor]
) -> None:
    admission = FakeAdmission()
    sup, _ = make(supervisors, settings(state, "engine-dead", "--fake-on", "1"), admission)
    await sup.start()
    _, finish = await running(sup)
    await eventually(lambda: sup.restarts == 1 and sup.state == "ready")
    assert sup.last_restart_reason == "exit"
    assert "engine process died" in (sup.last_restart_detail or "")
    # The server was still up, so its in-flight requests were given the drain time.
    assert admission.calls == ["pause", "wait_idle(2)", "resume"]
    await finish()


async def test_a_stopped_engine_is_a_hang_even_though_nothing_runs(
    state: Path, supervisors: list[Supervisor]
) -> None:
    sup, metrics = make(supervisors, settings(state, "ok"))
    await sup.start()
    _, finish = await running(sup)
    first = sup.status()["pid"]
    os.kill(first, signal.SIGSTOP)
    await eventually(lambda: sup.restarts == 1 and sup.state == "ready")
    assert sup.last_restart_reason == "hang"
    assert restarts(metrics, "hang") == 1.0
    assert not alive(first)
    assert sup.status()["pid"] not in (None, first)
    await finish()


async def test_running_requests_without_progress_are_a_hang_while_health_says_ok(
    state: Path, supervisors: list[Supervisor]
) -> None:
    sup, _ = make(supervisors, settings(state, "stall", "--fake-on", "1"))
    await sup.start()
    _, finish = await running(sup)
    await eventually(lambda: sup.restarts == 1 and sup.state == "ready")
    assert sup.last_restart_reason == "hang"
    assert "generation_tokens_total" in (sup.last_restart_detail or "")
    await finish()


@pytest.mark.parametrize(
    ("snapshot", "restarted"),
    [
        (Snapshot(ok=True, running=3, generation_tokens_total=10.0, preemptions_total=0.0), True),
        (Snapshot(ok=True, running=0, generation_tokens_total=10.0, preemptions_total=0.0), False),
        (Snapshot(ok=True, running=3, generation_tokens_total=10.0, preemptions_total=None), True),
        (Snapshot(ok=False, running=3, generation_tokens_total=10.0, preemptions_total=0.0), False),
    ],
)
async def test_the_engine_view_decides_progress_when_given(
    state: Path, supervisors: list[Supervisor], snapshot: Snapshot, restarted: bool
) -> None:
    sup, _ = make(supervisors, settings(state, "ok", hang_timeout=2.0), engine=FakeEngine(snapshot))
    await sup.start()
    _, finish = await running(sup)
    if restarted:
        await eventually(lambda: sup.restarts == 1)
        assert sup.last_restart_reason == "hang"
    else:
        started = time.monotonic()
        await eventually(lambda: time.monotonic() - started > 3.0)
        assert sup.restarts == 0
    await finish()


async def test_out_of_memory_while_serving_restarts_with_fewer_sequences(
    state: Path, supervisors: list[Supervisor]
) -> None:
    sup, metrics = make(
        supervisors, settings(state, "oom-after", "--fake-on", "1", vllm_args=["--max-num-seqs", "64"])
    )
    await sup.start()
    _, finish = await running(sup)
    await eventually(lambda: sup.restarts == 1 and sup.state == "ready")
    assert sup.last_restart_reason == "oom"
    assert restarts(metrics, "oom") == 1.0
    args = argv(state, 2)
    assert args[args.index("--max-num-seqs") + 1] == "48"
    assert args.count("--max-num-seqs") == 1
    # Kept for later restarts, and lowered again after another out-of-memory error.
    await sup.restart("manual")
    assert argv(state, 3)[argv(state, 3).index("--max-num-seqs") + 1] == "48"
    await finish()


async def test_a_manual_restart_drains_in_flight_requests_first(state: Path, supervisors: list[Supervisor]) -> None:
    admission = FakeAdmission()
    sup, metrics = make(supervisors, settings(state, "ok", drain_timeout=7.0), admission)
    await sup.start()
    await asyncio.gather(sup.restart("manual"), sup.restart("manual"))  # the second joins the first
    assert admission.calls == ["pause", "wait_idle(7)", "resume"]
    assert sup.state == "ready" and sup.restarts == 1 and launches(state) == 2
    assert restarts(metrics, "manual") == 1.0
    await sup.stop()


@pytest.mark.parametrize(
    ("scenario", "fake", "flag", "values"),
    [
        ("fit", ["--fake-estimate", "3968"], "--max-model-len", ["3968"]),
        ("fit-v0", ["--fake-kv-tokens", "2100"], "--max-model-len", ["2048"]),
        ("no-cache", ["--fake-min-util", "0.95"], "--gpu-memory-utilization", ["0.93", "0.95"]),
    ],
)
async def test_autofit_restarts_with_the_values_vllm_names(
    state: Path, supervisors: list[Supervisor], scenario: str, fake: list[str], flag: str, values: list[str]
) -> None:
    sup, _ = make(supervisors, settings(state, scenario, *fake))
    await sup.start()
    assert sup.state == "ready"
    assert launches(state) == len(values) + 1
    for launch, value in enumerate(values, start=2):
        args = argv(state, launch)
        assert args[args.index(flag) + 1] == value
    assert len(sup.status()["autofit"]) == len(values)
    if flag == "--max-model-len":
        assert sup.max_model_len == int(values[-1])
    await sup.stop()


@pytest.mark.parametrize(
    ("scenario", "fake", "extra", "words"),
    [
        ("fit", [], {"autofit_attempts": 0}, ["gave up after 0 auto-fit attempts", "32768"]),
        ("no-cache", ["--fake-min-util", "0.99"], {}, ["gpu_memory_utilization 0.95"]),
        ("free-memory", [], {}, ["10.5/79.19 GiB", "pid 4242 VLLM::EngineCore"]),
        ("startup-oom", [], {}, ["CUDA out of memory", "2048 MiB"]),
        ("crash-at-start", ["--fake-exit-code", "3"], {}, ["exited with code 3"]),
        ("never-ready", [], {"startup_timeout": 1.0}, ["start-up timeout of 1 s"]),
    ],
)
async def test_startup_gives_up_with_a_report(
    state: Path, supervisors: list[Supervisor], scenario: str, fake: list[str], extra: dict[str, Any],
    words: list[str],
) -> None:
    sup, metrics = make(supervisors, settings(state, scenario, *fake, **extra))
    with pytest.raises(SupervisorError) as err:
        await sup.start()
    for word in words:
        assert word in err.value.message
    assert err.value.status == 503
    assert sup.state == "down"
    assert metrics.registry.get_sample_value("vllm_guard_upstream_state", {"state": "down"}) == 1.0
    pid = int((state / f"pid-{launches(state)}").read_text())
    assert not alive(pid)
    await sup.stop()


async def test_too_many_restarts_within_the_window_leave_it_down(
    state: Path, supervisors: list[Supervisor]
) -> None:
    admission = FakeAdmission()
    sup, metrics = make(
        supervisors, settings(state, "crash-after", "--fake-on", "1,2,3,4,5,6", max_restarts=2), admission
    )
    await sup.start()
    _, finish = await running(sup)
    await eventually(lambda: sup.state == "down")
    assert sup.restarts == 2
    assert restarts(metrics, "exit") == 2.0
    assert "2 restarts within 60 s (limit 2)" in (sup.status()["last_error"] or "")
    assert sup.retry_after() >= 1.0
    # Queued requests are let go (to fail fast) once the gateway gives up.
    assert admission.calls[-1] == "resume"
    await finish()


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
    s = Settings(managed=True, model="m", vllm_command=sys.argv[1], startup_timeout=10.0)
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


async def test_stop_during_start_up_leaves_no_engine_behind(state: Path, supervisors: list[Supervisor]) -> None:
    sup, _ = make(supervisors, settings(state, "never-ready", startup_timeout=60.0))
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: (state / "pid-1").exists())
    pid = int((state / "pid-1").read_text())
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    await sup.stop()
    assert not alive(pid)
