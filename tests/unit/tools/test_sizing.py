"""The plan: budget, overhead, blocks, concurrency and verdict for a model on given GPUs."""

from __future__ import annotations

import json

import pytest

from gateway.tools.memsize import GIB, MIB
from gateway.tools.modelspec import ModelInfo, WeightInfo, load_model
from gateway.tools.sizing import PlanInput, default_gpu_memory_utilization, estimate_overhead, make_plan
from tests.support.paths import MODEL_CONFIGS

FIXTURES = MODEL_CONFIGS


def model(name: str) -> ModelInfo:
    return load_model(str(FIXTURES / name))


def test_a_24gib_gpu_plan_subtracts_weights_and_the_stated_overhead() -> None:
    llama = model("llama-3-8b")
    plan = make_plan(llama, PlanInput(gpu_memory_bytes=24 * GIB))
    overhead = estimate_overhead(llama.spec, tp=1, pp=1, max_num_batched_tokens=2048, max_num_seqs=256)
    expected_kv = int(24 * GIB * 0.9) - llama.weights.bytes - sum(overhead.values())
    assert plan.overhead_detail == overhead and set(overhead) >= {"activations", "cuda_graphs", "non_torch"}
    assert plan.kv_cache_bytes == expected_kv
    assert plan.bytes_per_block == 16 * 131072
    assert plan.num_blocks == expected_kv // (2 * MIB)
    assert plan.kv_tokens == plan.num_blocks * 16
    assert plan.verdict == "fits" and plan.max_model_len_fit == 8192
    by_len = {c.context_tokens: c for c in plan.concurrency}
    assert by_len[8192].max_sequences == pytest.approx(plan.num_blocks / 512)
    assert plan.suggested_max_num_seqs == (plan.num_blocks - 1) // 256  # 4096-token sequences


@pytest.mark.parametrize(
    ("name", "inp", "verdict"),
    [
        ("llama-3-70b", PlanInput(gpu_memory_bytes=24 * GIB), "does-not-fit"),
        ("llama-3-70b", PlanInput(gpu_memory_bytes=80 * GIB, tensor_parallel_size=4), "fits"),
        ("deepseek-v3", PlanInput(gpu_memory_bytes=141 * GIB, tensor_parallel_size=8), "fits"),
        ("deepseek-v3", PlanInput(gpu_memory_bytes=80 * GIB, tensor_parallel_size=8), "does-not-fit"),
        ("llama-3-8b", PlanInput(), "no-gpu-memory"),
    ],
)
def test_plans_reach_the_expected_verdict(name: str, inp: PlanInput, verdict: str) -> None:
    assert make_plan(model(name), inp).verdict == verdict


def test_tensor_parallel_splits_weights_and_the_kv_heads() -> None:
    one = make_plan(model("llama-3-70b"), PlanInput(gpu_memory_bytes=80 * GIB, tensor_parallel_size=1))
    four = make_plan(model("llama-3-70b"), PlanInput(gpu_memory_bytes=80 * GIB, tensor_parallel_size=4))
    assert four.weight_bytes_per_gpu == -(-one.weight_bytes // 4)
    assert four.kv_bytes_per_token == one.kv_bytes_per_token // 4
    assert "multi_gpu" in four.overhead_detail and "multi_gpu" not in one.overhead_detail


def test_kv_cache_memory_bytes_skips_the_budget_like_vllms_flag() -> None:
    plan = make_plan(model("tiny-llama-cpu"),
                     PlanInput(kv_cache_memory_bytes=4194304, block_size=128, max_model_len=2048))
    assert (plan.num_blocks, plan.kv_tokens, plan.budget_bytes) == (32, 4096, None)
    # "Maximum concurrency for 2,048 tokens per request: 2.00x"
    assert [c.max_sequences for c in plan.concurrency if c.context_tokens == 2048] == [2.0]


def test_a_plan_serialises_to_json() -> None:
    plan = make_plan(model("mistral-7b-v0.1"), PlanInput(gpu_memory_bytes=24 * GIB))
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["kv_bytes_per_token"] == 131072 and data["verdict"] == "fits"
    assert data["concurrency"][0]["context_tokens"] == 1024


@pytest.mark.parametrize(
    ("version", "expected"), [(None, 0.9), ("0.10.2", 0.9), ("0.19.1", 0.9), ("0.20.0", 0.92), ("0.32.0+cpu", 0.92)]
)
def test_default_gpu_memory_utilization_follows_the_vllm_version(version: str | None, expected: float) -> None:
    assert default_gpu_memory_utilization(version) == expected


def test_estimated_weights_are_stated_in_the_plan() -> None:
    weights = WeightInfo(bytes=GIB, parameters=10**9, source="estimate")
    info = ModelInfo(spec=model("llama-3-8b").spec, weights=weights, path=None)
    assert any("estimated" in n for n in make_plan(info, PlanInput()).notes)
