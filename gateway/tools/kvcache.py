"""KV cache arithmetic: bytes per token and per block, blocks per request, and what a byte budget holds.

Everything here mirrors vLLM's V1 engine (``vllm/v1/core/kv_cache_utils.py`` and
``vllm/v1/kv_cache_interface.py`` of 0.32): a KV block holds ``block_size`` tokens of every layer
in a cache group; ``num_blocks = kv_bytes // bytes_per_block``; a request at length L takes
``cdiv(L, block_size)`` blocks per full-attention group and
``cdiv(min(window - 1 + in_flight, L), block_size) + 1`` per sliding-window group; one block is the
null block that BlockPool holds back. The model itself comes from ``gateway.tools.modelspec``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.engine.vllm_api.defaults import DEFAULT_BLOCK_SIZE
from gateway.errors import InvalidRequest
from gateway.tools.modelspec import DTYPE_BYTES, ModelInfo, ModelSpec

# DeepSeek's fp8 MLA cache stores 512 fp8 latents, 4 float32 scales and 64 bf16 rope values per token.
_FP8_DS_MLA_BYTES = 656


def kv_dtype_bytes(spec: ModelSpec, kv_cache_dtype: str = "auto") -> float:
    if kv_cache_dtype in ("auto", "", None):
        return spec.dtype_bytes
    if kv_cache_dtype.startswith("fp8") or kv_cache_dtype == "int8":
        return 1
    if kv_cache_dtype not in DTYPE_BYTES:
        raise InvalidRequest(
            f"Unknown --kv-cache-dtype {kv_cache_dtype!r}; use auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16 or float16",
            param="kv_cache_dtype",
        )
    return DTYPE_BYTES[kv_cache_dtype]


def kv_bytes_per_token_per_layer(spec: ModelSpec, *, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """One layer's KV bytes for one token on one tensor-parallel rank."""
    if spec.mla is not None:  # one latent, replicated on every rank
        if kv_cache_dtype == "fp8_ds_mla":
            return _FP8_DS_MLA_BYTES
        width = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
        return int(width * kv_dtype_bytes(spec, kv_cache_dtype))
    heads_per_rank = max(1, spec.num_kv_heads // tp)
    return int(2 * heads_per_rank * spec.head_dim * kv_dtype_bytes(spec, kv_cache_dtype))


def _stage_windows(spec: ModelSpec, pp: int) -> tuple[int | None, ...]:
    # The largest pipeline stage holds ceil(layers / pp) layers and sets the block budget.
    return spec.layer_windows[: math.ceil(spec.num_layers / pp)]


def kv_bytes_per_token(spec: ModelSpec, *, tp: int = 1, pp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """KV bytes one token costs on one GPU, every layer of its pipeline stage counted in full."""
    per_layer = kv_bytes_per_token_per_layer(spec, tp=tp, kv_cache_dtype=kv_cache_dtype)
    return per_layer * len(_stage_windows(spec, pp))


@dataclass(frozen=True)
class KVLayout:
    """vLLM's KV cache groups on one GPU: a block id costs ``bytes_per_block`` from the shared pool."""

    block_size: int
    bytes_per_block: int
    group_windows: tuple[int | None, ...]  # one entry per cache group

    def blocks_per_request(self, tokens: int, in_flight_tokens: int = 0) -> int:
        total = 0
        for window in self.group_windows:
            if window is None:
                total += -(-tokens // self.block_size)
            else:
                held = min(window - 1 + in_flight_tokens, tokens)
                total += -(-held // self.block_size) + 1
        return total

    @property
    def hybrid(self) -> bool:
        return any(w is not None for w in self.group_windows)


def kv_layout(
    spec: ModelSpec, *, block_size: int = DEFAULT_BLOCK_SIZE, tp: int = 1, pp: int = 1,
    kv_cache_dtype: str = "auto",
) -> KVLayout:
    page = block_size * kv_bytes_per_token_per_layer(spec, tp=tp, kv_cache_dtype=kv_cache_dtype)
    buckets: dict[int | None, int] = {}
    for window in _stage_windows(spec, pp):
        buckets[window] = buckets.get(window, 0) + 1
    counts = list(buckets.values())
    # vLLM's _get_kv_cache_groups_uniform_page_size: equal-sized groups, the smaller type's count.
    group_size = min(counts)
    if max(counts) < group_size * 1.5:
        group_size = max(counts)
    windows: list[int | None] = []
    for window, count in buckets.items():
        windows.extend([window] * -(-count // group_size))
    return KVLayout(block_size=block_size, bytes_per_block=group_size * page, group_windows=tuple(windows))


def kv_tokens_for_bytes(
    kv_bytes: int, model: ModelSpec | ModelInfo, *, block_size: int = DEFAULT_BLOCK_SIZE, tp: int = 1,
    pp: int = 1, kv_cache_dtype: str = "auto", max_model_len: int | None = None, in_flight_tokens: int = 0,
) -> int:
    """The KV cache size in tokens that vLLM reports for ``--kv-cache-memory-bytes kv_bytes``.

    vLLM logs ``int(num_blocks / blocks_per_request(L) * L)`` for its max_model_len L: for full
    attention with L a multiple of the block size that is ``num_blocks * block_size``.
    """
    spec = model.spec if isinstance(model, ModelInfo) else model
    layout = kv_layout(spec, block_size=block_size, tp=tp, pp=pp, kv_cache_dtype=kv_cache_dtype)
    blocks = kv_bytes // layout.bytes_per_block
    if max_model_len is None and not layout.hybrid:
        return blocks * block_size
    length = max_model_len or spec.max_model_len
    return int(blocks / layout.blocks_per_request(length, in_flight_tokens) * length)


def max_model_len_for_bytes(
    kv_bytes: int, layout: KVLayout, upper: int, *, in_flight_tokens: int = 0
) -> int:
    """vLLM's estimate of the longest sequence that fits (0: none), null block held back."""
    usable = kv_bytes - layout.bytes_per_block

    def fits(length: int) -> bool:
        return layout.bytes_per_block * layout.blocks_per_request(length, in_flight_tokens) <= usable

    if upper < 1 or not fits(1):
        return 0
    lo, hi, best = 1, upper, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best
