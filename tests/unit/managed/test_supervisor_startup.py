"""The supervisor's start-up: auto-fit with the values vLLM names, a report when it gives up, and a start-up cut
short leaves no engine behind."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.http.errors import status_and_type
from gateway.managed.supervisor import Supervisor, SupervisorError
from tests.support.procs import alive
from tests.unit.managed.supervising import argv, eventually, launches, make, settings


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
    assert status_and_type(err.value)[0] == 503
    assert sup.state == "down"
    assert metrics.registry.get_sample_value("vllm_guard_upstream_state", {"state": "down"}) == 1.0
    pid = int((state / f"pid-{launches(state)}").read_text())
    assert not alive(pid)
    await sup.stop()


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
