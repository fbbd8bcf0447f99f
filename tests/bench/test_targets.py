"""Starting and stopping targets: a server in its own session answers, is accounted, and is gone with its whole
group when stopped; a commit's gateway source is extracted once; the default cores put the proxy alone."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench.harness.context import Context, Cores
from bench.harness.processes import ROOT, Server, StartError, cpu_list, free_port, pinned, python
from bench.targets import engines, proxies

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc are Linux's")


@linux
def test_a_fake_engine_target_starts_answers_is_accounted_and_stops_with_its_group(tmp_path: Path) -> None:
    ctx = Context("unit", argparse.Namespace(), [], out_dir=tmp_path, cache=tmp_path)
    with ctx:
        engine = engines.fake(ctx, "engine", token_delay=0.0, cpus="")
        ctx.start(engine)
        for _ in range(50):
            urllib.request.urlopen(engine.url + "/health", timeout=5).read()
        assert engine.cpu_seconds() > 0
        pid = engine.pid
        assert engine.describe()["kind"] == "fake"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the engine's process group outlived its run")


@linux
def test_a_fake_engine_of_several_processes_serves_one_port_and_is_accounted_as_one(tmp_path: Path) -> None:
    import psutil

    ctx = Context("unit", argparse.Namespace(), [], out_dir=tmp_path, cache=tmp_path)
    with ctx:
        engine = engines.fake(ctx, "engine", token_delay=0.0, cpus="", processes=3)
        ctx.start(engine)
        assert len(psutil.Process(engine.pid).children()) == 2
        for _ in range(30):  # fresh connections: the kernel spreads them over the three
            urllib.request.urlopen(engine.url + "/health", timeout=5).read()
        assert engine.cpu_seconds() > 0 and engine.describe()["processes"] == 3


@linux
def test_a_server_that_exits_before_it_is_ready_says_so_with_its_log(tmp_path: Path) -> None:
    server = Server("broken", [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"], free_port(),
                    tmp_path / "broken.log").start()
    with pytest.raises(StartError, match=r"exited before it was ready(.|\n)*no such model"):
        server.wait_ready(("/health",), 30)
    server.stop()


@linux
def test_stopping_a_stopped_server_continues_it_first_and_is_idempotent(tmp_path: Path) -> None:
    server = Server("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], free_port(),
                    tmp_path / "s.log").start()
    server.signal(signal.SIGSTOP)
    server.stop(grace=5)
    server.stop()
    assert server.proc is not None and server.proc.poll() is not None


def test_a_commits_gateway_is_extracted_once(tmp_path: Path) -> None:
    src, short = proxies.source_at("HEAD", cache=tmp_path)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert short == head and (src / "gateway" / "cli.py").is_file()
    marker = src / "gateway" / "marker"
    marker.write_text("kept")
    assert proxies.source_at("HEAD", cache=tmp_path)[0] == src and marker.exists()


def test_cores_put_the_proxy_alone_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert Cores.default() == Cores("1", "0", "0")
    assert Cores.default(proxy="1,2", engine="3") == Cores("1,2", "3", "3")
    assert Cores.default(pin=False) == Cores(None, None, None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert Cores.default(proxy="1") == Cores(None, None, None)
    assert pinned("1") == []  # one core: nothing to pin to


@pytest.mark.parametrize(("spec", "cores"), [("0", {0}), ("1,2", {1, 2}), ("2-4", {2, 3, 4}), ("0,3-4", {0, 3, 4})])
def test_a_taskset_list_names_its_cores(spec: str, cores: set[int]) -> None:
    assert cpu_list(spec) == cores


def test_a_module_of_this_repository_runs_with_this_interpreter() -> None:
    assert python("bench.servers.fake_engine", "--port", "1") == [sys.executable, "-m", "bench.servers.fake_engine",
                                                                  "--port", "1"]


def test_without_vllm_the_frontend_target_is_left_out_and_nothing_starts(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.targets import frontend

    monkeypatch.setattr(frontend, "unavailable", lambda: "vLLM is not installed in this environment")
    ctx = Context("unit", argparse.Namespace(), [], out_dir=tmp_path, cache=tmp_path)
    names = ["engine", "gateway", "frontend"]
    with ctx:
        assert frontend.start(ctx, names, ()) == {}
    assert names == ["engine", "gateway"] and ctx.targets == {}
