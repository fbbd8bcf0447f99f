"""The supervisor runs a vLLM-like child (testing/fake_vllm.py): it starts it, restarts it on crash,
hang and out-of-memory, drains around restarts, and gives up within bounds."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from gateway.managed.command import free_port
from gateway.managed.guardian import group_pids
from gateway.managed.supervisor import Supervisor
from tests.support.procs import alive, environ
from tests.unit.managed.supervising import (
    FakeAdmission,
    FakeEngine,
    Snapshot,
    argv,
    eventually,
    launches,
    make,
    restarts,
    running,
    settings,
)


def fail_when(state: Path) -> tuple[str, str]:
    """The fake engine's failure waits for ``fail_now``, not a time after its start: on a busy machine, a failure
    0.3 s after launch could land before the start-up was seen through."""
    return ("--fake-trigger", str(state.parent / "fail-now"))


def fail_now(state: Path) -> None:
    (state.parent / "fail-now").touch()


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


async def test_the_engine_core_runs_at_the_niceness_asked_once_the_engine_is_ready(
    state: Path, supervisors: list[Supervisor]
) -> None:
    niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    sup, _ = make(supervisors, settings(state, "engine-core", engine_core_nice=niceness))
    await sup.start()
    core = int((state / "grandchild-1").read_text())
    api_server = int((state / "pid-1").read_text())
    assert {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{core}/task")} == {niceness}
    assert os.getpriority(os.PRIO_PROCESS, api_server) == os.getpriority(os.PRIO_PROCESS, 0)
    await sup.stop()


async def test_a_crash_is_restarted_with_a_drain_and_counted(state: Path, supervisors: list[Supervisor]) -> None:
    admission = FakeAdmission()
    sup, metrics = make(supervisors, settings(state, "crash-after", "--fake-on", "1", *fail_when(state)), admission)
    await sup.start()
    fail_now(state)
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
    sup, _ = make(supervisors, settings(state, "engine-dead", "--fake-on", "1", *fail_when(state)), admission)
    await sup.start()
    fail_now(state)
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
    sup, metrics = make(supervisors, settings(state, "ok", hang_timeout=3.0))
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
    sup, _ = make(supervisors, settings(state, "stall", "--fake-on", "1", hang_timeout=3.0))
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
    hang_timeout = 4.0  # its /health probes wait 2 s: a busy machine's slow answer is not a silence
    engine = FakeEngine(snapshot)
    sup, _ = make(supervisors, settings(state, "ok", hang_timeout=hang_timeout), engine=engine)
    await sup.start()
    _, finish = await running(sup)
    if restarted:
        await eventually(lambda: sup.restarts == 1)
        assert sup.last_restart_reason == "hang"
    else:
        # Judged past the bound, and over several of the watchdog's looks at the view (however slow they come).
        started, reads = time.monotonic(), engine.reads
        await eventually(lambda: time.monotonic() - started > hang_timeout + 1 and engine.reads >= reads + 5)
        assert sup.restarts == 0
    await finish()


async def test_out_of_memory_while_serving_restarts_with_fewer_sequences(
    state: Path, supervisors: list[Supervisor]
) -> None:
    sup, metrics = make(
        supervisors,
        settings(state, "oom-after", "--fake-on", "1", *fail_when(state), vllm_args=["--max-num-seqs", "64"]),
    )
    await sup.start()
    fail_now(state)
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


async def test_a_restart_belongs_to_the_supervisor_outlives_its_caller_and_ends_with_it(
    state: Path, supervisors: list[Supervisor]
) -> None:
    sup, _ = make(supervisors, settings(state, "ok"))
    await sup.start()
    caller = asyncio.create_task(sup.restart("manual"))
    await eventually(lambda: launches(state) == 2)
    caller.cancel()  # an HTTP client that went away
    await eventually(lambda: sup.restarts == 1 and sup.state == "ready")
    caller = asyncio.create_task(sup.restart("manual"))
    await eventually(lambda: (state / "pid-3").exists())
    caller.cancel()
    await sup.stop()
    assert len(sup._tasks) == 0
    assert sup.state == "down"
    assert not alive(int((state / "pid-3").read_text()))


async def test_too_many_restarts_within_the_window_leave_it_down(
    state: Path, supervisors: list[Supervisor]
) -> None:
    admission = FakeAdmission()
    sup, metrics = make(
        supervisors, settings(state, "crash-after", "--fake-on", "1,2,3,4,5,6", *fail_when(state), max_restarts=2),
        admission,
    )
    await sup.start()
    fail_now(state)
    _, finish = await running(sup)
    await eventually(lambda: sup.state == "down")
    assert sup.restarts == 2
    assert restarts(metrics, "exit") == 2.0
    assert "2 restarts within 600 s (limit 2)" in (sup.status()["last_error"] or "")
    assert sup.retry_after() >= 1.0
    # Queued requests are let go (to fail fast) once the gateway gives up.
    assert admission.calls[-1] == "resume"
    await finish()


def free_pair() -> int:
    """A free port whose next is free too: the second engine takes ``--vllm-port`` + 1 (a busy machine's other
    tests took it once)."""
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


async def test_a_second_engine_runs_on_the_next_port_with_its_devices_and_leaves_the_state_gauge_alone(
    state: Path, supervisors: list[Supervisor]
) -> None:
    s = settings(state, vllm_port=free_pair(), engine_devices="0;1")
    sup, metrics = make(supervisors, s, index=1, devices="1")
    assert (sup.name, sup.port) == ("1", s.vllm_port + 1)
    await sup.start()
    pid = sup.status()["pid"]
    assert pid is not None
    assert (await asyncio.to_thread(environ, pid))["CUDA_VISIBLE_DEVICES"] == "1"
    # The engine-state gauge is the first engine's: the second one's phases do not move it.
    assert metrics.registry.get_sample_value("vllm_guard_upstream_up") == 0.0
    await sup.stop()
