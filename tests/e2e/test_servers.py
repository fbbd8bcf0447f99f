"""The end-to-end harness itself: servers are killed as whole process groups, failures show their log."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from testing.servers import ServerProcess, ServerStartError, metric_sum

# A parent that starts a grandchild and prints its pid, then both sleep: like vLLM's API server and
# the engine process it forks.
PARENT_WITH_CHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('CHILD_PID', child.pid, flush=True)\n"
    "time.sleep(60)\n"
)
IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('READY', flush=True)\n"
    "time.sleep(60)\n"
)


def _python(tmp_path: Path, code: str, name: str = "server") -> ServerProcess:
    return ServerProcess(name, [sys.executable, "-c", code], port=9, log_path=tmp_path / f"{name}.log")


def _gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for init to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def _wait_for_line(server: ServerProcess, prefix: str) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for line in server.log_path.read_text().splitlines():
            if line.startswith(prefix):
                return line
        time.sleep(0.05)
    raise AssertionError(f"{prefix!r} never appeared in {server.log_path}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stop_kills_the_whole_process_group_forked_children_included(tmp_path: Path) -> None:
    server = _python(tmp_path, PARENT_WITH_CHILD).start()
    assert server.proc is not None
    try:
        child_pid = int(_wait_for_line(server, "CHILD_PID").split()[1])
    finally:
        server.stop(grace=5)

    assert _gone(server.proc.pid)
    deadline = time.monotonic() + 5
    while not _gone(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child_pid)


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    server = _python(tmp_path, IGNORES_SIGTERM).start()
    try:
        _wait_for_line(server, "READY")
    finally:
        code = server.stop(grace=0.5)

    assert code == -9
    assert not server.alive()


def test_stop_is_idempotent_and_safe_before_start(tmp_path: Path) -> None:
    server = _python(tmp_path, "print('bye')")

    assert server.stop() is None
    server.start()
    assert server.proc is not None
    server.proc.wait(timeout=20)
    assert server.stop() == 0
    assert server.stop() == 0


def test_a_server_that_exits_while_starting_fails_at_once_with_its_log(tmp_path: Path) -> None:
    server = _python(tmp_path, "print('ValueError: no KV cache for you'); raise SystemExit(3)").start()

    with pytest.raises(ServerStartError) as caught:
        server.wait_ready(["/health"], timeout=60)

    assert "exited with code 3" in str(caught.value)
    assert "no KV cache for you" in str(caught.value)


def test_a_server_that_never_answers_times_out_on_the_injected_clock(tmp_path: Path) -> None:
    server = _python(tmp_path, "import time; time.sleep(60)").start()
    now = [0.0]
    try:
        with pytest.raises(ServerStartError) as caught:
            server.wait_ready(
                ["/health"], timeout=10, clock=lambda: now[0], pause=lambda s: now.__setitem__(0, now[0] + s)
            )
    finally:
        server.stop(grace=5)

    assert "not ready within 10 s (waiting for /health)" in str(caught.value)
    assert now[0] >= 10


METRICS = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 7.0
vllm:num_preemptions_total{engine="1",model_name="tiny"} 2.0
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.7e9
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0 1700000000000
plain_metric 3
"""


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("vllm:num_preemptions_total", 9.0),
        ("vllm:num_requests_running", 1.0),
        ("plain_metric", 3.0),
        ("vllm:num_preemptions", 0.0),
        ("vllm:absent_total", 0.0),
    ],
)
def test_metric_sum_adds_every_label_set_of_exactly_that_metric(name: str, expected: float) -> None:
    assert metric_sum(METRICS, name) == expected
