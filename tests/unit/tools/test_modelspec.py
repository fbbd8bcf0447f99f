from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.tools.modelspec import (
    estimate_weight_bytes,
    load_model,
    parameter_counts,
    resolve_model_dir,
    safetensors_bytes,
    spec_from_config,
)
from tests.support.paths import MODEL_CONFIGS

FIXTURES = MODEL_CONFIGS


def fixture_spec(name: str) -> Any:
    return spec_from_config(json.loads((FIXTURES / name / "config.json").read_text()), name=name)


# Published parameter counts (model cards) and the bytes one weight takes in the released checkpoint.
@pytest.mark.parametrize(
    ("name", "published_params", "bytes_per_param"),
    [
        ("llama-3-8b", 8.03e9, 2),
        ("llama-3-70b", 70.6e9, 2),
        ("mistral-7b-v0.1", 7.24e9, 2),
        ("deepseek-v3", 671e9, 1),  # fp8 checkpoint; 685B on the hub counts the MTP head too
    ],
)
def test_parameters_and_weight_bytes_match_published_figures(
    name: str, published_params: float, bytes_per_param: int
) -> None:
    spec = fixture_spec(name)
    params = sum(parameter_counts(spec))
    assert params == pytest.approx(published_params, rel=0.02)
    assert estimate_weight_bytes(spec) == pytest.approx(published_params * bytes_per_param, rel=0.03)


def test_deepseek_v3_is_read_as_mla_with_58_moe_layers_in_fp8() -> None:
    spec = fixture_spec("deepseek-v3")
    assert spec.mla is not None and spec.mla.kv_lora_rank == 512 and spec.mla.qk_rope_head_dim == 64
    assert spec.moe is not None and spec.moe.moe_layers == 61 - 3 and spec.moe.num_experts == 256
    assert (spec.quant_method, spec.quant_bits) == ("fp8", 8.0)
    # YaRN configs already state the long context: vLLM does not multiply by the factor again.
    assert spec.max_model_len == 163840


def test_mistral_v01_slides_on_every_layer_and_llama_on_none() -> None:
    assert set(fixture_spec("mistral-7b-v0.1").layer_windows) == {4096}
    assert set(fixture_spec("llama-3-8b").layer_windows) == {None}


BASE: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 6,
    "vocab_size": 100, "intermediate_size": 128, "max_position_embeddings": 4096,
}


@pytest.mark.parametrize(
    ("extra", "windows"),
    [
        ({"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"] * 3},
         (512, None, 512, None, 512, None)),
        ({"sliding_window": 512, "sliding_window_pattern": 3}, (512, 512, None, 512, 512, None)),
        ({"model_type": "gemma2", "sliding_window": 512}, (512, None, 512, None, 512, None)),
        ({"model_type": "qwen2", "sliding_window": 512, "use_sliding_window": False}, (None,) * 6),
        ({"model_type": "qwen2", "sliding_window": 512, "use_sliding_window": True, "max_window_layers": 4},
         (None, None, None, None, 512, 512)),
        ({"sliding_window": None}, (None,) * 6),
    ],
)
def test_per_layer_windows_follow_the_config(extra: dict[str, Any], windows: tuple[int | None, ...]) -> None:
    assert spec_from_config({**BASE, **extra}).layer_windows == windows


@pytest.mark.parametrize(
    ("rope", "model_type", "expected"),
    [
        ({"rope_type": "linear", "factor": 4.0}, "llama", 16384),
        ({"type": "dynamic", "factor": 2.0}, "llama", 8192),
        ({"rope_type": "llama3", "factor": 8.0}, "llama", 4096),
        ({"rope_type": "yarn", "factor": 4.0}, "qwen2", 4096),
        ({"rope_type": "linear", "factor": 8.0}, "gemma3_text", 4096),
    ],
)
def test_max_model_len_scales_like_vllm(rope: dict[str, Any], model_type: str, expected: int) -> None:
    spec = spec_from_config({**BASE, "model_type": model_type, "rope_scaling": rope})
    assert spec.max_model_len == expected


@pytest.mark.parametrize(
    ("quant", "bits"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, 4.0),
        ({"quant_method": "awq", "w_bit": 4}, 4.0),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, 4.0),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, 8.0),
        ({"quant_method": "compressed-tensors", "config_groups": {"g0": {"weights": {"num_bits": 8}}}}, 8.0),
        ({"quant_method": "fp8"}, 8.0),
    ],
)
def test_quantization_bits_are_read_from_every_known_spelling(quant: dict[str, Any], bits: float) -> None:
    assert spec_from_config({**BASE, "quantization_config": quant}).quant_bits == bits


def test_quantized_linear_layers_shrink_the_weight_estimate() -> None:
    full = spec_from_config(BASE)
    four_bit = spec_from_config({**BASE, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    linear, other = parameter_counts(full)
    assert estimate_weight_bytes(full) == 2 * (linear + other)
    assert estimate_weight_bytes(four_bit) == linear // 2 + 2 * other


def test_multimodal_configs_are_read_from_their_text_config() -> None:
    spec = spec_from_config({"model_type": "llava", "text_config": {**BASE, "num_key_value_heads": 2}})
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (6, 2, 16)


def test_a_config_without_layers_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequest, match="num_hidden_layers"):
        spec_from_config({"hidden_size": 64})


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, int]]) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (rows, cols) in shapes.items():
        size = rows * cols * 2
        header[name] = {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return offset


def test_weight_bytes_come_from_the_index_first_then_the_headers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    a = _write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"w1": (64, 64), "w2": (8, 64)})
    b = _write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"w3": (16, 16)})
    assert safetensors_bytes(tmp_path) == (a + b, "safetensors-headers")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 12345}}))
    info = load_model(str(tmp_path))
    assert (info.weights.bytes, info.weights.source) == (12345, "safetensors-index")


def test_without_weights_the_bytes_are_estimated_and_the_tokenizer_caps_the_length(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    info = load_model(str(tmp_path / "config.json"))
    assert info.weights.source == "estimate"
    assert info.weights.bytes == estimate_weight_bytes(info.spec)
    assert info.spec.max_model_len == 1024


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path: Path) -> None:
    repo = tmp_path / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (snapshot / "config.json").write_text(json.dumps(BASE))
    assert resolve_model_dir("acme/tiny", cache_dir=tmp_path) == snapshot
    assert load_model("acme/tiny", cache_dir=tmp_path).spec.num_layers == 6


@pytest.mark.parametrize("model", ["acme/not-cached", "/no/such/dir", "./relative/missing", "not a hub id"])
def test_a_model_that_is_neither_local_nor_cached_is_a_clear_error(tmp_path: Path, model: str) -> None:
    with pytest.raises(InvalidRequest, match="never downloads"):
        load_model(model, cache_dir=tmp_path)


def test_an_unreadable_config_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        load_model(str(tmp_path))
