"""Start-up auto-fit: the next vLLM arguments after a failed start, taken from vLLM's own numbers.

Free of I/O so that every rule can be table-tested; the supervisor applies the changes and relaunches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.engine.vllm_api.defaults import default_block_size
from gateway.managed.logfacts import (
    CudaOutOfMemory,
    InsufficientFreeMemory,
    MaxSeqLenTooLarge,
    NoCacheMemory,
    StartupFailure,
    describe_failure,
)
from gateway.vllm_args import arg_value

DEFAULT_GPU_UTILIZATION = 0.9
MAX_GPU_UTILIZATION = 0.95
GPU_UTILIZATION_STEP = 0.03
DEFAULT_MAX_NUM_SEQS = 256
OOM_SEQS_FACTOR = 0.75


@dataclass(frozen=True)
class FitStep:
    """The flags to change for the next start-up attempt, and why, with vLLM's numbers."""

    changes: dict[str, str]
    reason: str


def plan_autofit(
    failure: StartupFailure | None, args: Sequence[str], device: str | None, holders: Sequence[str] = ()
) -> FitStep | str:
    """The next start-up attempt for a failed one, or the reason to give up (a str)."""
    if failure is None:
        return "it printed no start-up failure the gateway knows how to fix (see the log above)"
    what = describe_failure(failure)
    if isinstance(failure, MaxSeqLenTooLarge):
        block = int(arg_value(args, "--block-size") or default_block_size(device))
        limit = failure.estimated_max_len if failure.estimated_max_len is not None else failure.kv_tokens
        current = int(arg_value(args, "--max-model-len") or failure.max_seq_len)
        fitted = (limit // block) * block if limit is not None else 0
        if fitted <= 0 or fitted >= current:
            return f"{what}; no shorter max_model_len in whole blocks of {block} tokens fits"
        source = "vLLM's estimate" if failure.estimated_max_len is not None else "the KV cache"
        return FitStep(
            {"--max-model-len": str(fitted)},
            f"{what}: max_model_len {current} -> {fitted} ({source} {limit} rounded down to blocks of {block})",
        )
    if isinstance(failure, NoCacheMemory):
        if arg_value(args, "--kv-cache-memory-bytes") is not None:
            return f"{what}, and --kv-cache-memory-bytes fixes the KV cache size; lower it or the model size"
        util = float(arg_value(args, "--gpu-memory-utilization") or DEFAULT_GPU_UTILIZATION)
        if util >= MAX_GPU_UTILIZATION - 1e-9:
            return (
                f"{what}, even at gpu_memory_utilization {util:g} (the most the gateway sets is "
                f"{MAX_GPU_UTILIZATION:g}); use a smaller model, quantization, or more tensor parallelism"
            )
        new = min(MAX_GPU_UTILIZATION, round(util + GPU_UTILIZATION_STEP, 2))
        return FitStep({"--gpu-memory-utilization": f"{new:g}"}, f"{what}: gpu_memory_utilization {util:g} -> {new:g}")
    if isinstance(failure, InsufficientFreeMemory):
        held = "; ".join(holders) if holders else "no process list available"
        return f"{what}. Processes holding GPU memory: {held}. Stop them or lower --gpu-memory-utilization"
    assert isinstance(failure, CudaOutOfMemory)
    return f"{what} while starting; lower --max-model-len, --max-num-seqs or --gpu-memory-utilization"


def next_fit(
    failure: StartupFailure | None, command: Sequence[str], device: str | None, holders: Sequence[str], *,
    attempts: int, limit: int, exit_code: int | None,
) -> FitStep | str:
    """plan_autofit within ``limit`` attempts; a str is the whole report of why the start-up failed."""
    step = plan_autofit(failure, command, device, holders)
    head = f"vLLM exited with code {exit_code} during start-up"
    if isinstance(step, str):
        return f"{head}: {step}"
    if attempts >= limit:
        return (
            f"{head}: {describe_failure(failure) if failure else 'unknown'}; gave up after "
            f"{attempts} auto-fit attempts (limit {limit})"
        )
    return step


def fewer_seqs(args: Sequence[str]) -> tuple[int, int]:
    """(current, lowered) --max-num-seqs after an out-of-memory error while serving."""
    current = int(arg_value(args, "--max-num-seqs") or DEFAULT_MAX_NUM_SEQS)
    return current, max(1, math.floor(current * OOM_SEQS_FACTOR))
