"""Auto-fit acts on vLLM's own numbers, or gives up with a reason."""

from __future__ import annotations

import pytest

from gateway.managed.autofit import FitStep, fewer_seqs, next_fit, plan_autofit
from gateway.managed.logfacts import (
    CudaOutOfMemory,
    InsufficientFreeMemory,
    MaxSeqLenTooLarge,
    NoCacheMemory,
    StartupFailure,
)

FITS: list[tuple[str, StartupFailure | None, list[str], str | None, dict[str, str] | None]] = [
    ("V1 estimate on CPU", MaxSeqLenTooLarge(32768, estimated_max_len=3968), [], "CPU", {"--max-model-len": "3968"}),
    ("V1 estimate rounded to 16", MaxSeqLenTooLarge(131072, estimated_max_len=79475), [], "GPU",
     {"--max-model-len": "79472"}),
    ("block size from the args", MaxSeqLenTooLarge(32768, estimated_max_len=3999), ["--block-size", "32"], "GPU",
     {"--max-model-len": "3968"}),
    ("V0 token count", MaxSeqLenTooLarge(32768, kv_tokens=20544), [], None, {"--max-model-len": "20544"}),
    ("no estimate", MaxSeqLenTooLarge(8192), [], "GPU", None),
    ("estimate below one block", MaxSeqLenTooLarge(8192, estimated_max_len=100), [], "CPU", None),
    ("estimate not below the current value", MaxSeqLenTooLarge(4096, estimated_max_len=8000),
     ["--max-model-len", "4096"], "GPU", None),
    ("no cache memory, default", NoCacheMemory(), [], None, {"--gpu-memory-utilization": "0.93"}),
    ("no cache memory, stepped", NoCacheMemory(), ["--gpu-memory-utilization", "0.93"], None,
     {"--gpu-memory-utilization": "0.95"}),
    ("no cache memory, at the top", NoCacheMemory(), ["--gpu-memory-utilization=0.95"], None, None),
    ("no cache memory, fixed size", NoCacheMemory(), ["--kv-cache-memory-bytes", "1000"], None, None),
    ("free memory", InsufficientFreeMemory("cuda:0", 10.5, 79.19, 0.9, 71.27), [], "GPU", None),
    ("out of memory", CudaOutOfMemory(20.0, None, False), [], "GPU", None),
    ("unknown failure", None, [], None, None),
]


@pytest.mark.parametrize(("case", "failure", "args", "device", "changes"), FITS, ids=[c[0] for c in FITS])
def test_autofit_acts_on_vllms_numbers_or_gives_up(
    case: str, failure: StartupFailure | None, args: list[str], device: str | None, changes: dict[str, str] | None
) -> None:
    step = plan_autofit(failure, args, device)
    if changes is None:
        assert isinstance(step, str) and step
    else:
        assert isinstance(step, FitStep)
        assert step.changes == changes
        assert all(v in step.reason for v in changes.values())


def test_giving_up_on_free_memory_names_the_processes_holding_it() -> None:
    step = plan_autofit(
        InsufficientFreeMemory("cuda:0", 10.5, 79.19, 0.9, 71.27), [], "GPU",
        ["pid 4242 VLLM::EngineCore on GPU 0: 60000 MiB"],
    )
    assert isinstance(step, str)
    assert "pid 4242 VLLM::EngineCore" in step and "10.5/79.19 GiB" in step


def test_a_fit_past_the_attempt_limit_becomes_the_report() -> None:
    failure = MaxSeqLenTooLarge(32768, estimated_max_len=3968)
    step = next_fit(failure, [], "CPU", [], attempts=0, limit=1, exit_code=1)
    assert isinstance(step, FitStep) and step.changes == {"--max-model-len": "3968"}
    report = next_fit(failure, [], "CPU", [], attempts=1, limit=1, exit_code=1)
    assert isinstance(report, str)
    assert report.startswith("vLLM exited with code 1 during start-up: max_model_len 32768")
    assert report.endswith("gave up after 1 auto-fit attempts (limit 1)")


def test_a_start_up_failure_without_a_fit_is_reported_with_its_exit_code() -> None:
    report = next_fit(None, [], None, [], attempts=0, limit=3, exit_code=3)
    assert isinstance(report, str) and report.startswith("vLLM exited with code 3 during start-up: ")


@pytest.mark.parametrize(
    ("args", "expected"),
    [([], (256, 192)), (["--max-num-seqs", "64"], (64, 48)), (["--max-num-seqs=1"], (1, 1))],
)
def test_out_of_memory_while_serving_lowers_max_num_seqs_by_a_quarter(
    args: list[str], expected: tuple[int, int]
) -> None:
    assert fewer_seqs(args) == expected
