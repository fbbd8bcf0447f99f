"""``doctor`` and ``plan`` on a real NVIDIA GPU host (PyTorch and nvidia-ml-py there; vLLM not needed): a check of
the gateway's GPU sizing against the card, not a comparison of targets.

    python -m bench run gpu-check [--hold 0.6]

1. ``vllm-guard doctor --json`` on the idle GPU;
2. a stale CUDA context: a process named as vLLM's engine core names itself (``VLLM::EngineCore``), holding
   ``--hold`` of the GPU's memory, orphaned (its parent exits), as a crashed vLLM leaves one; ``doctor`` must
   name it, say it is orphaned and what a new vLLM would be short of; then it is killed and ``doctor`` must see
   the memory back;
3. ``vllm-guard plan --gpu-memory detected`` for each model config under ``tests/fixtures/model_configs``;
4. each plan that fits, allocated on the card: weights, the plan's overhead and its KV cache, as vLLM would hold
   them at ``gpu_memory_utilization``; the memory left must be what the plan leaves to others. Beside it, what
   PyTorch cannot see (CUDA context, cuBLAS workspace: vLLM's "non-torch" memory) and the peak of one decoder
   layer's forward pass over 8,192 tokens, against the plan's estimates.

Everything it saw goes beside the result as ``<result>-raw.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.workloads.gpu_check import check, summary

SUMMARY = "doctor and plan on a real NVIDIA GPU: a stale context found, plans allocated on the card (GPU host only)"
TARGETS = ["gpu"]
DEFAULT_TARGETS = ["gpu"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False, repeat=1)
    parser.add_argument("--hold", type=float, default=0.6, help="share of the GPU's memory the stale process holds")


def figures(result: dict[str, Any]) -> dict[str, float]:
    torch, stale = result.get("torch", {}), result.get("stale", {})
    out = {"released_after_s": float(stale.get("released_after_s", math.nan)),
           "context_mib": torch.get("context_bytes", math.nan) / 2**20,
           "non_torch_mib": torch.get("non_torch_increase_bytes", math.nan) / 2**20}  # fmt: skip
    for a in torch.get("allocations", []):
        out[f"left_minus_unclaimed_mib {a['model']}"] = a["left_minus_unclaimed"] / 2**20
    for name, layer in torch.get("layer_forward", {}).items():
        if "layer_peak_bytes" in layer:
            out[f"layer_peak_mib {name}"] = layer["layer_peak_bytes"] / 2**20
            out[f"plan_activations_mib {name}"] = (layer["plan_activations_bytes"] or math.nan) / 2**20
    return out


def run(ctx: Context) -> Result:
    raw: list[dict[str, Any]] = []

    def one(target: str, turn: int) -> dict[str, float]:
        raw.append(check(ctx.args.hold, ctx.say))
        return figures(raw[-1])

    runs = in_turns(["gpu"], ctx.args.repeat, one)
    where = ctx.out_dir / ctx.benchmark
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{ctx.stem}-raw.json").write_text(json.dumps(raw[-1], indent=1))
    keys = list(runs["gpu"][-1])
    device = raw[-1].get("torch", {}).get("device", "?")
    return ctx.result([Measure(k, k.replace("_", " "), ".1f", "none") for k in keys], runs, [],
                      notes=[f"device: {device}"], extra_markdown=summary(raw[-1]))
