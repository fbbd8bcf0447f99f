"""The KV cache arithmetic against vLLM's own code (the installed CPU build); slow to import, so e2e."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.tools.kvcache import kv_layout
from gateway.tools.modelspec import spec_from_config
from tests.support.paths import MODEL_CONFIGS

pytestmark = pytest.mark.e2e

FIXTURES = MODEL_CONFIGS
GEMMA3_LIKE: dict[str, Any] = {
    "model_type": "gemma3_text", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "num_hidden_layers": 12, "vocab_size": 100, "intermediate_size": 512,
    "max_position_embeddings": 32768, "sliding_window": 1024, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
}


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name / "config.json").read_text())
    return data


CONFIGS = {
    "gemma3-like 10 sliding + 2 full": GEMMA3_LIKE,
    "gemma3-like 29 + 5, padded": {**GEMMA3_LIKE, "num_hidden_layers": 34},
    "12 sliding + 13 full": {**GEMMA3_LIKE, "num_hidden_layers": 25, "sliding_window_pattern": None,
                             "layer_types": ["full_attention"] + ["sliding_attention", "full_attention"] * 12},
    "mistral-7b-v0.1": fixture("mistral-7b-v0.1"),
    "llama-3-70b tp 4": {**fixture("llama-3-70b"), "_tp": 4},
    "deepseek-v3": fixture("deepseek-v3"),
}


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize(("tokens", "in_flight"), [(100, 0), (5000, 4096), (32768, 2048)])
def test_layout_and_blocks_per_request_equal_vllms(cfg: dict[str, Any], tokens: int, in_flight: int) -> None:
    torch = pytest.importorskip("torch")
    iface = pytest.importorskip("vllm.v1.kv_cache_interface")
    utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    tp = int(cfg.get("_tp", 1))
    spec = spec_from_config(cfg)
    specs: dict[str, Any] = {}
    for i, window in enumerate(spec.layer_windows):
        if spec.mla is not None:
            specs[f"layer.{i}"] = iface.MLAAttentionSpec(
                block_size=16, num_kv_heads=1, dtype=torch.bfloat16,
                head_size=spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim,
            )
        else:
            common = {"block_size": 16, "num_kv_heads": max(1, spec.num_kv_heads // tp),
                      "head_size": spec.head_dim, "dtype": torch.bfloat16}
            specs[f"layer.{i}"] = (iface.FullAttentionSpec(**common) if window is None
                                   else iface.SlidingWindowSpec(**common, sliding_window=window))
    groups = utils._get_kv_cache_groups_uniform_page_size(specs)
    theirs_bytes = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)
    theirs_blocks = sum(
        g.kv_cache_spec.max_admission_blocks_per_request(in_flight, tokens)
        if isinstance(g.kv_cache_spec, iface.SlidingWindowSpec) else -(-tokens // 16)
        for g in groups
    )
    mine = kv_layout(spec, block_size=16, tp=tp)
    assert mine.bytes_per_block == theirs_bytes
    assert len(mine.group_windows) == len(groups)
    assert mine.blocks_per_request(tokens, in_flight) == theirs_blocks
