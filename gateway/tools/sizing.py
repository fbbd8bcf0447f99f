"""The plan: from a model and the engine settings to what fits on each GPU and vLLM's verdict.

The memory vLLM gets on a GPU is ``gpu_memory * gpu_memory_utilization``; weights and the overhead
its profiling run measures come off that, and the rest is KV cache (``gateway.tools.kvcache``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gateway.engine.vllm_api.defaults import DEFAULT_BLOCK_SIZE
from gateway.errors import InvalidRequest
from gateway.tools.kvcache import (
    KVLayout,
    kv_bytes_per_token,
    kv_dtype_bytes,
    kv_layout,
    max_model_len_for_bytes,
)
from gateway.tools.memsize import GIB
from gateway.tools.modelspec import ModelInfo, ModelSpec

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# vLLM 0.20 raised its default; plans for newer engines should use this one.
GPU_MEMORY_UTILIZATION_FROM_0_20 = 0.92
# CUDA graph capture of vLLM's default batch sizes takes ~0.3-1 GiB on a single GPU (its start-up log
# "Graph capturing finished ... took X GiB"); the plan states the figure it used.
CUDA_GRAPH_BYTES = GIB // 2
# CUDA context, cuBLAS workspaces and allocator slack that vLLM counts as non-torch memory.
NON_TORCH_BYTES = GIB // 4
# NCCL buffers and custom all-reduce workspaces when the model is split over several GPUs.
MULTI_GPU_BYTES = GIB // 2
DEFAULT_CONTEXT_LENGTHS = (1024, 4096, 8192, 32768, 131072)


@dataclass(frozen=True)
class PlanInput:
    gpu_memory_bytes: int | None = None  # per GPU
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int | None = None  # None: vLLM's default for the GPU size
    max_num_seqs: int | None = None  # None: vLLM's default (256; 1024 on >= 70 GiB GPUs)
    overhead_bytes: int | None = None  # None: estimated
    kv_cache_memory_bytes: int | None = None  # vLLM's --kv-cache-memory-bytes: skips the budget
    context_lengths: tuple[int, ...] = ()
    typical_tokens: int | None = None  # sequence length --max-num-seqs is sized for


@dataclass(frozen=True)
class Concurrency:
    context_tokens: int
    blocks_per_sequence: int
    max_sequences: float  # vLLM's "Maximum concurrency" figure


@dataclass(frozen=True)
class Plan:
    model: str
    weights_source: str
    parameters: int
    weight_bytes: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token: int  # per GPU, every layer counted
    kv_dtype_bytes: float
    block_size: int
    bytes_per_block: int
    max_model_len: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    budget_bytes: int | None = None
    overhead_bytes: int | None = None
    overhead_detail: dict[str, int] = field(default_factory=dict)
    kv_cache_bytes: int | None = None
    num_blocks: int | None = None
    kv_tokens: int | None = None
    max_model_len_fit: int | None = None
    suggested_max_num_seqs: int | None = None
    concurrency: tuple[Concurrency, ...] = ()
    verdict: str = "no-gpu-memory"
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Engine:
    """The engine settings a plan is made for, vLLM's defaults filled in."""

    layout: KVLayout
    max_len: int
    batched: int  # --max-num-batched-tokens
    max_seqs: int  # --max-num-seqs
    in_flight: int  # tokens a sliding window must hold beyond itself
    weights_per_gpu: int


def default_gpu_memory_utilization(vllm_version: str | None) -> float:
    """vLLM's default for a given engine version (0.9, 0.92 from 0.20)."""
    if not vllm_version:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    parts = [int(p) for p in vllm_version.split("+")[0].split(".")[:2] if p.isdigit()]
    return GPU_MEMORY_UTILIZATION_FROM_0_20 if tuple(parts) >= (0, 20) else DEFAULT_GPU_MEMORY_UTILIZATION


def estimate_overhead(
    spec: ModelSpec, *, tp: int, pp: int, max_num_batched_tokens: int, max_num_seqs: int
) -> dict[str, int]:
    """Memory vLLM uses besides weights and KV cache, per GPU (its profiling run measures it)."""
    if spec.moe is not None:
        e = spec.moe
        inter = max(spec.intermediate_size, e.experts_per_token * e.expert_intermediate_size)
    else:
        inter = spec.intermediate_size
    # Peak of one forward pass over max_num_batched_tokens: the gate/up output, its activation, and a
    # few hidden-sized buffers, in the model dtype; fp32 logits and probabilities of sampled rows.
    per_token = (3 * inter // tp + 6 * spec.hidden_size) * spec.dtype_bytes
    activations = int(max_num_batched_tokens * per_token)
    logits = min(max_num_seqs, max_num_batched_tokens) * spec.vocab_size * 4 * 2 // tp
    detail = {"activations": activations + logits, "cuda_graphs": CUDA_GRAPH_BYTES, "non_torch": NON_TORCH_BYTES}
    if tp * pp > 1:
        detail["multi_gpu"] = MULTI_GPU_BYTES
    return detail


def make_plan(model: ModelInfo, inp: PlanInput) -> Plan:
    """The plan for ``model`` under ``inp``; without GPU memory or a KV cache size, only the per-token figures."""
    _check_input(inp)
    engine = _engine_settings(model, inp)
    plan = replace(_base_plan(model, inp, engine), notes=_setup_notes(model, inp, engine))
    if inp.kv_cache_memory_bytes is not None:
        kv_bytes = inp.kv_cache_memory_bytes
        plan = replace(plan, notes=(
            *plan.notes, "KV cache size set directly (--kv-cache-memory-bytes); GPU budget not computed"
        ))
    elif inp.gpu_memory_bytes is not None:
        plan, kv_bytes = _with_gpu_budget(plan, model.spec, inp, engine, inp.gpu_memory_bytes)
    else:
        return plan
    return _with_kv_cache(plan, kv_bytes, inp, engine)


def _check_input(inp: PlanInput) -> None:
    tp, pp = inp.tensor_parallel_size, inp.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise InvalidRequest(f"Parallel sizes must be >= 1; got tensor {tp}, pipeline {pp}", param="tp")
    if inp.block_size < 1:
        raise InvalidRequest(f"block size must be >= 1; got {inp.block_size}", param="block_size")


def _engine_settings(model: ModelInfo, inp: PlanInput) -> _Engine:
    tp, pp = inp.tensor_parallel_size, inp.pipeline_parallel_size
    big_gpu = (inp.gpu_memory_bytes or 0) >= 70 * GIB
    batched = inp.max_num_batched_tokens or (8192 if big_gpu else 2048)
    return _Engine(
        layout=kv_layout(model.spec, block_size=inp.block_size, tp=tp, pp=pp, kv_cache_dtype=inp.kv_cache_dtype),
        max_len=inp.max_model_len or model.spec.max_model_len,
        batched=batched,
        max_seqs=inp.max_num_seqs or (1024 if big_gpu else 256),
        # Async scheduling keeps two batches in flight; sliding windows must hold their tokens too.
        in_flight=2 * batched,
        weights_per_gpu=-(-model.weights.bytes // (tp * pp)),
    )


def _base_plan(model: ModelInfo, inp: PlanInput, engine: _Engine) -> Plan:
    """The figures that need no memory size: weights, KV bytes per token and per block."""
    spec, tp, pp = model.spec, inp.tensor_parallel_size, inp.pipeline_parallel_size
    return Plan(
        model=spec.name, weights_source=model.weights.source, parameters=model.weights.parameters,
        weight_bytes=model.weights.bytes, weight_bytes_per_gpu=engine.weights_per_gpu,
        kv_bytes_per_token=kv_bytes_per_token(spec, tp=tp, pp=pp, kv_cache_dtype=inp.kv_cache_dtype),
        kv_dtype_bytes=kv_dtype_bytes(spec, inp.kv_cache_dtype),
        block_size=inp.block_size, bytes_per_block=engine.layout.bytes_per_block, max_model_len=engine.max_len,
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
    )


def _setup_notes(model: ModelInfo, inp: PlanInput, engine: _Engine) -> tuple[str, ...]:
    spec, tp = model.spec, inp.tensor_parallel_size
    notes: list[str] = []
    if spec.mla is None and spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        notes.append(f"vLLM needs {spec.num_kv_heads} KV heads and tensor parallel {tp} to divide one another")
    if model.weights.source == "estimate":
        notes.append("weights estimated from config.json (no safetensors metadata found)")
    if engine.layout.hybrid:
        notes.append(
            f"sliding-window layers hold at most window + {engine.in_flight} in-flight tokens of blocks per sequence"
        )
    return tuple(notes)


def _with_gpu_budget(
    plan: Plan, spec: ModelSpec, inp: PlanInput, engine: _Engine, gpu_memory_bytes: int
) -> tuple[Plan, int]:
    """The plan with vLLM's budget and overhead filled in, and the bytes that leaves for the KV cache."""
    overhead = (
        {"given": inp.overhead_bytes} if inp.overhead_bytes is not None
        else estimate_overhead(spec, tp=inp.tensor_parallel_size, pp=inp.pipeline_parallel_size,
                               max_num_batched_tokens=engine.batched, max_num_seqs=engine.max_seqs)
    )
    budget = int(gpu_memory_bytes * inp.gpu_memory_utilization)
    notes = plan.notes
    if inp.overhead_bytes is None:
        notes += (
            f"overhead is an estimate: activations for {engine.batched} batched tokens, "
            f"{CUDA_GRAPH_BYTES / GIB:.2f} GiB CUDA graphs (0 with --enforce-eager), "
            f"{NON_TORCH_BYTES / GIB:.2f} GiB non-torch; vLLM measures it at start-up",
        )
    plan = replace(
        plan, gpu_memory_bytes=gpu_memory_bytes, gpu_memory_utilization=inp.gpu_memory_utilization,
        budget_bytes=budget, overhead_bytes=sum(overhead.values()), overhead_detail=overhead, notes=notes,
    )
    return plan, budget - engine.weights_per_gpu - sum(overhead.values())


def _with_kv_cache(plan: Plan, kv_bytes: int, inp: PlanInput, engine: _Engine) -> Plan:
    """The plan completed from the KV cache's size: blocks, longest sequence, concurrency and verdict."""
    layout, max_len, in_flight = engine.layout, engine.max_len, engine.in_flight
    if kv_bytes < 2 * layout.bytes_per_block:
        return replace(plan, kv_cache_bytes=kv_bytes, verdict="does-not-fit")
    blocks = kv_bytes // layout.bytes_per_block
    fit = max_model_len_for_bytes(kv_bytes, layout, max_len, in_flight_tokens=in_flight)
    typical = min(inp.typical_tokens or min(max_len, 4096), max_len)
    suggested = max(1, min((blocks - 1) // layout.blocks_per_request(typical, in_flight), engine.max_seqs))
    return replace(
        plan, kv_cache_bytes=kv_bytes, num_blocks=blocks,
        kv_tokens=int(blocks / layout.blocks_per_request(max_len, in_flight) * max_len),
        max_model_len_fit=fit, suggested_max_num_seqs=suggested,
        concurrency=_concurrency(layout, blocks, inp.context_lengths or DEFAULT_CONTEXT_LENGTHS, max_len, in_flight),
        verdict="fits" if fit >= max_len else "context-too-long",
        notes=(*plan.notes,
               f"--max-num-seqs {suggested}: sequences of up to {typical} tokens never preempt one another"),
    )


def _concurrency(
    layout: KVLayout, blocks: int, lengths: tuple[int, ...], max_len: int, in_flight: int
) -> tuple[Concurrency, ...]:
    """vLLM's "Maximum concurrency" at each context length up to ``max_len``, and at ``max_len`` itself."""
    return tuple(
        Concurrency(c, layout.blocks_per_request(c, in_flight), blocks / layout.blocks_per_request(c, in_flight))
        for c in sorted({c for c in lengths if c <= max_len} | {max_len})
    )
