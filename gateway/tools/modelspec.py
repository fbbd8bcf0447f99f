"""What a model is, for sizing: its architecture from ``config.json`` and its weight bytes.

Reads a local model directory or a hub id's snapshot in the local cache (never downloads): the
config (multimodal ``text_config`` included), ``tokenizer_config.json``'s length cap, and the weight
size from ``model.safetensors.index.json`` or the safetensors headers, else an estimate from the
config (dense, MoE, MLA; quantized linear layers at their bit width).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gateway.errors import InvalidRequest

DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1,
}
_GATED_MLP_FREE = {"gpt2", "gpt_neox", "gptj", "opt", "falcon", "bloom", "phi", "starcoder2", "gpt_bigcode"}
_SLIDING_TYPES = {"sliding_attention", "sliding_window", "local_attention", "chunked_attention"}
_UNSCALED_ROPE = {"default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
_QUANT_DEFAULT_BITS = {
    "fp8": 8.0, "fbgemm_fp8": 8.0, "ptpc_fp8": 8.0, "experts_int8": 8.0, "mxfp4": 4.25,
    "awq": 4.0, "gptq": 4.0, "awq_marlin": 4.0, "gptq_marlin": 4.0, "modelopt_fp4": 4.5, "nvfp4": 4.5,
}


def _model_error(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="model", code="model_config_unavailable")


# -- the model -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLASpec:
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int  # all shared experts together; 0 when none
    moe_layers: int


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts sizing needs, read from a ``config.json``."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    dtype: str
    max_model_len: int
    layer_windows: tuple[int | None, ...]  # per layer: None for full attention, else the window
    mla: MLASpec | None = None
    moe: MoESpec | None = None
    quant_method: str | None = None
    quant_bits: float | None = None
    gated_mlp: bool = True
    qkv_bias: bool = False

    @property
    def dtype_bytes(self) -> float:
        return DTYPE_BYTES.get(self.dtype, 2)


@dataclass(frozen=True)
class WeightInfo:
    bytes: int
    parameters: int  # estimated from the config, whatever the source of ``bytes``
    source: str  # "safetensors-index", "safetensors-headers" or "estimate"


@dataclass(frozen=True)
class ModelInfo:
    spec: ModelSpec
    weights: WeightInfo
    path: str | None


def _first(cfg: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            return value
    return None


def _int(cfg: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    value = _first(cfg, *keys)
    if value is None:
        if default is None:
            raise _model_error(f"config.json has none of {', '.join(keys)}")
        return default
    return int(value)


def _rope_params(cfg: Mapping[str, Any]) -> dict[str, Any]:
    rope = _first(cfg, "rope_parameters", "rope_scaling")
    return dict(rope) if isinstance(rope, Mapping) else {}


def _derived_max_len(cfg: Mapping[str, Any], model_type: str) -> int:
    base = _int(cfg, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", default=2048)
    rope = _rope_params(cfg)
    rope_type = str(rope.get("rope_type") or rope.get("type") or "default")
    factor = rope.get("factor")
    # vLLM 0.32 scales only linear/dynamic RoPE; YaRN and Llama-3 configs already state the long length.
    if rope_type not in _UNSCALED_ROPE and "gemma3" not in model_type and isinstance(factor, int | float):
        return int(base * factor)
    return base


def _layer_windows(cfg: Mapping[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not isinstance(window, int) or window <= 0 or cfg.get("use_sliding_window") is False:
        return (None,) * layers
    if isinstance(types, list) and len(types) >= layers:
        return tuple(window if str(t) in _SLIDING_TYPES else None for t in types[:layers])
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:  # Gemma 3: every pattern-th layer is global
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(layers))
    if model_type == "gemma2":  # alternates, local first
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    first_sliding = cfg.get("max_window_layers") if model_type.startswith("qwen") else None
    if isinstance(first_sliding, int):
        return tuple(window if i >= first_sliding else None for i in range(layers))
    return (window,) * layers  # Mistral-7B-v0.1: every layer slides


def _quantization(cfg: Mapping[str, Any]) -> tuple[str | None, float | None]:
    q = cfg.get("quantization_config")
    if not isinstance(q, Mapping):
        return None, None
    method = str(q.get("quant_method") or q.get("quant_algo") or "unknown").lower()
    bits = _first(q, "bits", "w_bit", "weight_bits", "num_bits")
    if bits is None and method == "bitsandbytes":
        bits = 4 if q.get("load_in_4bit") else 8
    if bits is None and isinstance(q.get("config_groups"), Mapping):  # compressed-tensors
        for group in q["config_groups"].values():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping) and weights.get("num_bits") is not None:
                bits = weights["num_bits"]
                break
    if bits is None:
        bits = _QUANT_DEFAULT_BITS.get(method)
    return method, (float(bits) if bits is not None else None)


def _moe(cfg: Mapping[str, Any], layers: int, intermediate: int) -> MoESpec | None:
    experts = _first(cfg, "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
    if not isinstance(experts, int) or experts <= 1:
        return None
    expert_inter = _int(cfg, "moe_intermediate_size", default=intermediate)
    if cfg.get("shared_expert_intermediate_size"):
        shared = int(cfg["shared_expert_intermediate_size"])
    else:
        shared = int(_first(cfg, "n_shared_experts", "num_shared_experts") or 0) * expert_inter
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    moe_layers = sum(
        1 for i in range(layers)
        if i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in dense_only
    )
    return MoESpec(
        num_experts=experts,
        experts_per_token=_int(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_top_k", default=2),
        expert_intermediate_size=expert_inter,
        shared_intermediate_size=shared,
        moe_layers=moe_layers,
    )


def spec_from_config(config: Mapping[str, Any], *, name: str = "model") -> ModelSpec:
    """Read a (possibly multimodal) ``config.json`` mapping into a ``ModelSpec``."""
    cfg: dict[str, Any] = dict(config)
    text = config.get("text_config")
    if isinstance(text, Mapping):  # multimodal wrappers keep the language model here
        cfg.update(text)
    model_type = str(cfg.get("model_type") or "unknown")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model", "dim")
    heads = _int(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads")
    kv_heads = 1 if cfg.get("multi_query") else _int(
        cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads", default=heads
    )
    intermediate = _int(cfg, "intermediate_size", "ffn_hidden_size", "n_inner", default=4 * hidden)
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLASpec(
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", default=64),
            qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", default=128),
            v_head_dim=_int(cfg, "v_head_dim", default=128),
            q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        )
    method, bits = _quantization(cfg)
    return ModelSpec(
        name=name,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_int(cfg, "head_dim", default=hidden // heads),
        vocab_size=_int(cfg, "vocab_size", "padded_vocab_size"),
        intermediate_size=intermediate,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=str(_first(cfg, "torch_dtype", "dtype") or "bfloat16").removeprefix("torch."),
        max_model_len=_derived_max_len(cfg, model_type),
        layer_windows=_layer_windows(cfg, model_type, layers),
        mla=mla,
        moe=_moe(cfg, layers, intermediate),
        quant_method=method,
        quant_bits=bits,
        gated_mlp=model_type not in _GATED_MLP_FREE,
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
    )


# -- weights ---------------------------------------------------------------------------------------
def parameter_counts(spec: ModelSpec) -> tuple[int, int]:
    """(parameters of the decoder's linear layers, all other parameters) of the served model.

    Linear layers are what quantization shrinks; embeddings, the LM head, norms and routers stay in
    the model dtype. Multi-token-prediction heads are left out: vLLM loads them only to speculate.
    """
    h, n = spec.hidden_size, spec.num_layers
    if spec.mla is not None:
        m = spec.mla
        qk_dim = spec.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        q = h * m.q_lora_rank + m.q_lora_rank * qk_dim if m.q_lora_rank else h * qk_dim
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim)
        kv += m.kv_lora_rank * spec.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
        attn = q + kv + spec.num_attention_heads * m.v_head_dim * h
        attn_norms = m.kv_lora_rank + (m.q_lora_rank or 0)
    else:
        q_dim, kv_dim = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        attn = h * (q_dim + 2 * kv_dim) + q_dim * h
        attn_norms = (q_dim + 2 * kv_dim) if spec.qkv_bias else 0
    mlp_mats = 3 if spec.gated_mlp else 2
    dense_mlp = mlp_mats * h * spec.intermediate_size
    linear = n * attn
    other = n * (2 * h + attn_norms) + h  # two norms per layer, the final norm
    if spec.moe is not None:
        e = spec.moe
        moe_mlp = mlp_mats * h * (e.num_experts * e.expert_intermediate_size + e.shared_intermediate_size)
        linear += e.moe_layers * moe_mlp + (n - e.moe_layers) * dense_mlp
        other += e.moe_layers * h * e.num_experts  # routers
    else:
        linear += n * dense_mlp
    other += spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return linear, other


def estimate_weight_bytes(spec: ModelSpec) -> int:
    linear, other = parameter_counts(spec)
    linear_bits = spec.quant_bits if spec.quant_bits is not None else spec.dtype_bytes * 8
    return int(linear * linear_bits / 8 + other * spec.dtype_bytes)


def safetensors_bytes(model_dir: Path) -> tuple[int, str] | None:
    """Weight bytes from the checkpoint's own metadata: the index's total_size, else the headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
        if isinstance(total, int | float) and total > 0:
            return int(total), "safetensors-index"
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total_bytes = 0
    for path in files:
        with path.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        for key, tensor in header.items():
            if key != "__metadata__":
                start, end = tensor["data_offsets"]
                total_bytes += end - start
    return total_bytes, "safetensors-headers"


def resolve_model_dir(model: str, *, cache_dir: str | Path | None = None) -> Path | None:
    """A local directory, or the snapshot of a hub id in the local cache (never downloads)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.name == "config.json" and path.is_file():
        return path.parent
    if model.count("/") > 1 or model.startswith((".", "/", "~")):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(model, "config.json", cache_dir=cache_dir)
    except ValueError:  # not a valid hub id (HFValidationError)
        return None
    return Path(found).parent if isinstance(found, str) else None


def load_model(model: str, *, cache_dir: str | Path | None = None) -> ModelInfo:
    """Read a model's config and weight metadata from disk or the local hub cache."""
    model_dir = resolve_model_dir(model, cache_dir=cache_dir)
    if model_dir is None or not (model_dir / "config.json").is_file():
        raise _model_error(
            f"No config.json for model {model!r}: give a local directory, or a hub id already in the "
            "local cache (the planner never downloads)"
        )
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise _model_error(f"{model_dir / 'config.json'} is not valid JSON: {exc}") from exc
    spec = spec_from_config(config, name=model)
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():  # vLLM caps the derived length with the tokenizer's model_max_length
        limit = json.loads(tok_cfg.read_text(encoding="utf-8")).get("model_max_length")
        if isinstance(limit, int) and 0 < limit < spec.max_model_len:
            spec = replace(spec, max_model_len=limit)
    linear, other = parameter_counts(spec)
    measured = safetensors_bytes(model_dir)
    if measured is not None:
        weights = WeightInfo(bytes=measured[0], parameters=linear + other, source=measured[1])
    else:
        weights = WeightInfo(bytes=estimate_weight_bytes(spec), parameters=linear + other, source="estimate")
    return ModelInfo(spec=spec, weights=weights, path=str(model_dir))
