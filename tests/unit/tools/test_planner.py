"""The ``vllm-guard plan`` command: its table, its JSON and its exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway import gpu
from gateway.gpu import GpuDevice, GpuReport
from gateway.tools.memsize import GIB
from gateway.tools.modelspec import ModelInfo, load_model
from gateway.tools.planner import main_plan, render_plan
from gateway.tools.sizing import PlanInput, make_plan
from tests.support.paths import MODEL_CONFIGS

FIXTURES = MODEL_CONFIGS


def model(name: str) -> ModelInfo:
    return load_model(str(FIXTURES / name))


def test_a_context_longer_than_the_cache_says_what_max_model_len_fits() -> None:
    plan = make_plan(model("llama-3-8b"), PlanInput(gpu_memory_bytes=24 * GIB, max_model_len=131072))
    assert plan.verdict == "context-too-long" and plan.num_blocks is not None
    assert plan.max_model_len_fit == (plan.num_blocks - 1) * 16
    assert f"--max-model-len {plan.max_model_len_fit}" in render_plan(plan)


def test_plan_command_prints_json_and_exits_by_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", str(FIXTURES / "llama-3-8b"), "--gpu-memory", "24GiB", "--json",
            "--gpu-memory-utilization", "0.9", "--context-length", "1000,2000"]
    assert main_plan(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert [c["context_tokens"] for c in data["concurrency"]] == [1000, 2000, 8192]
    assert main_plan(["--model", str(FIXTURES / "llama-3-70b"), "--gpu-memory", "24GiB"]) == 1
    assert "No room for the KV cache" in capsys.readouterr().out


def test_plan_command_reports_bad_input_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_plan(["--model", str(tmp_path / "missing")]) == 2
    assert "never downloads" in capsys.readouterr().err


def test_detected_gpu_memory_uses_the_smallest_of_the_gpus_needed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    devices = tuple(GpuDevice(i, "H100", f"GPU-{i}", total, total, 0) for i, total in enumerate((80 * GIB, 79 * GIB)))
    monkeypatch.setattr(gpu, "query_gpus", lambda: GpuReport(available=True, driver_version="550", devices=devices))
    assert main_plan(["--model", str(FIXTURES / "llama-3-70b"), "--gpu-memory", "detected", "-tp", "2",
                      "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu_memory_bytes"] == 79 * GIB
    assert main_plan(["--model", str(FIXTURES / "llama-3-70b"), "--gpu-memory", "detected", "-tp", "4"]) == 2
    assert "2 GPU(s) found, 4 needed" in capsys.readouterr().err
