"""Checks ``doctor`` and ``plan`` on a real NVIDIA GPU host (PyTorch and nvidia-ml-py there; vLLM not needed).

1. ``vllm-guard doctor --json`` on the idle GPU.
2. A stale CUDA context: a process named as vLLM's engine core names itself (``VLLM::EngineCore``), holding
   ``--hold`` of the GPU's memory, orphaned (its parent exits), as a crashed vLLM leaves one. ``doctor`` must name it,
   say it is orphaned and what a new vLLM would be short of; then it is killed and ``doctor`` must see the
   memory back.
3. ``vllm-guard plan --gpu-memory detected`` for each model config under ``tests/fixtures/model_configs``.
4. Each plan that fits, allocated on the card: weights, the plan's overhead and its KV cache, as vLLM would
   hold them at ``gpu_memory_utilization``; the memory left must be what the plan leaves to others. Beside it,
   what PyTorch cannot see (CUDA context, cuBLAS workspace: vLLM's "non-torch" memory) and the peak of one
   decoder layer's forward pass over ``max_num_batched_tokens`` tokens, against the plan's estimates.

Run by ``python -m bench run gpu-check`` on the GPU host (from the repository root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "fixtures" / "model_configs"

HOLDER = r"""
import ctypes, os, sys, time
import torch
ctypes.CDLL(None).prctl(15, b"VLLM::EngineCor", 0, 0, 0)  # PR_SET_NAME, as vLLM's setproctitle does
x = torch.empty(int(float(sys.argv[1]) * torch.cuda.mem_get_info()[1]), dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
with open(sys.argv[2], "w") as f:
    f.write(str(os.getpid()))
time.sleep(900)
"""


def guard(*args: str) -> dict[str, Any]:
    """``vllm-guard`` with ``--json``: its exit code and parsed output."""
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", *args, "--json"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, check=False)
    try:
        body: Any = json.loads(proc.stdout)
    except json.JSONDecodeError:
        body = {"stdout": proc.stdout[-2000:], "stderr": proc.stderr[-2000:]}
    return {"rc": proc.returncode, "report": body}


def findings(doc: dict[str, Any]) -> list[str]:
    return [f"{f['severity']}: {f['message']}" for f in doc["report"].get("findings", [])]


def start_orphan(hold: float, pid_file: Path) -> int:
    """The holder, started by a shell that exits at once: its parent becomes init (or a subreaper)."""
    script = pid_file.with_suffix(".py")
    script.write_text(HOLDER)
    subprocess.run(["sh", "-c", f'"{sys.executable}" {script} {hold} {pid_file} >{script}.log 2>&1 &'],
                   check=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if pid_file.exists() and pid_file.read_text().strip():
            return int(pid_file.read_text())
        if "Error" in Path(f"{script}.log").read_text():
            break
        time.sleep(0.5)
    log = Path(f"{script}.log")
    raise RuntimeError("the VRAM holder did not start: " + (log.read_text()[-1000:] if log.exists() else ""))


def stale_context(hold: float) -> dict[str, Any]:
    pid_file = Path("/tmp/vllm-guard-holder.pid")
    pid_file.unlink(missing_ok=True)
    pid = start_orphan(hold, pid_file)
    out: dict[str, Any] = {"holder_pid": pid, "holder_comm": Path(f"/proc/{pid}/comm").read_text().strip()}
    stat = Path(f"/proc/{pid}/stat").read_text()
    out["holder_ppid"] = int(stat.rsplit(")", 1)[1].split()[1])
    out["doctor_held"] = guard("doctor")
    out["doctor_held_dead_upstream"] = guard("doctor", "--upstream", "http://127.0.0.1:9", "--timeout", "1")
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    while time.monotonic() - t0 < 60:
        if pynvml.nvmlDeviceGetMemoryInfo(handle).used < total * hold / 2:
            break
        time.sleep(0.2)
    out["released_after_s"] = round(time.monotonic() - t0, 2)
    pynvml.nvmlShutdown()
    out["doctor_after_kill"] = guard("doctor")
    return out


def plans() -> dict[str, Any]:
    return {d.name: guard("plan", "--model", str(d), "--gpu-memory", "detected")
            for d in sorted(MODELS.iterdir()) if (d / "config.json").exists()}


def nvml_used_by_me() -> int | None:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and isinstance(p.usedGpuMemory, int):
                return int(p.usedGpuMemory)
        return None
    finally:
        pynvml.nvmlShutdown()


def layer_peak(config: dict[str, Any], tokens: int) -> int:
    """Peak bytes above the weights of one llama-style decoder layer's forward pass over ``tokens`` tokens."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hd = h // heads
    dev, dt = "cuda", torch.bfloat16
    w = {n: torch.randn(*s, device=dev, dtype=dt) * 0.02 for n, s in {
        "qkv": ((heads + 2 * kv) * hd, h), "o": (h, heads * hd), "gate_up": (2 * inter, h), "down": (h, inter)}.items()}
    x = torch.randn(tokens, h, device=dev, dtype=dt)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        qkv = x @ w["qkv"].T
        q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], dim=-1)
        q = q.view(1, tokens, heads, hd).transpose(1, 2)
        k = k.view(1, tokens, kv, hd).transpose(1, 2)
        v = v.view(1, tokens, kv, hd).transpose(1, 2)
        # vLLM's attention never holds the score matrix: flash attention, as on its GPU backends.
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        a = a.transpose(1, 2).reshape(tokens, heads * hd)
        y = x + a @ w["o"].T
        gate, up = (y @ w["gate_up"].T).chunk(2, dim=-1)
        y = y + (F.silu(gate) * up) @ w["down"].T
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del w, x, qkv, q, k, v, a, y, gate, up
    torch.cuda.empty_cache()
    return int(peak)


def allocate_plan(name: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Hold the plan's weights, overhead and KV cache on the card; what is left must be the unclaimed share."""
    import torch

    free0, total = torch.cuda.mem_get_info()
    parts = {"weights": plan["weight_bytes_per_gpu"], "overhead": plan["overhead_bytes"],
             "kv_cache": plan["kv_cache_bytes"]}
    held = []
    try:
        for size in parts.values():
            held.append(torch.empty(int(size), dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        free1, _ = torch.cuda.mem_get_info()
        fitted = True
    except torch.OutOfMemoryError as exc:
        free1, fitted = torch.cuda.mem_get_info()[0], False
        parts["error"] = str(exc).splitlines()[0]
    finally:
        held.clear()
        torch.cuda.empty_cache()
    unclaimed = total * (1 - plan["gpu_memory_utilization"])
    return {"model": name, "fitted": fitted, "parts": parts, "free_before": free0, "free_after": free1,
            "total": total, "unclaimed_by_plan": int(unclaimed), "left_minus_unclaimed": int(free1 - unclaimed)}


def torch_checks(plan_docs: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    torch.ones(1, device="cuda")
    # The CUDA context is there before vLLM takes its baseline; what comes after (cuBLAS workspaces) is the
    # "non-torch" increase its profile charges to the budget.
    out["context_bytes"] = (nvml_used_by_me() or 0) - torch.cuda.memory_reserved()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    out["non_torch_increase_bytes"] = (nvml_used_by_me() or 0) - torch.cuda.memory_reserved() - out["context_bytes"]
    del a
    torch.cuda.empty_cache()
    layers: dict[str, Any] = {}
    for name in ("llama-3-8b", "mistral-7b-v0.1"):
        doc = plan_docs.get(name, {}).get("report", {})
        cfg = json.loads((MODELS / name / "config.json").read_text())
        tokens = 8192
        try:
            layers[name] = {"tokens": tokens, "layer_peak_bytes": layer_peak(cfg, tokens),
                            "plan_activations_bytes": doc.get("overhead_detail", {}).get("activations")}
        except Exception as exc:
            layers[name] = {"error": repr(exc)}
    out["layer_forward"] = layers
    out["allocations"] = [allocate_plan(n, d["report"]) for n, d in plan_docs.items()
                          if d["report"].get("verdict") == "fits"]
    return out


def check(hold: float, say: Callable[[str], None]) -> dict[str, Any]:
    """Every step, each one's failure recorded as its result rather than stopping the rest."""
    smi = shutil.which("nvidia-smi")
    result: dict[str, Any] = {"nvidia_smi": subprocess.run([smi], capture_output=True, text=True, check=False).stdout
                              if smi else "nvidia-smi not found"}
    for step, fn in (("doctor_idle", lambda: guard("doctor")), ("stale", lambda: stale_context(hold)),
                     ("plans", plans)):
        t0 = time.monotonic()
        try:
            result[step] = fn()
        except Exception as exc:
            result[step] = {"error": repr(exc)}
        say(f"{step}: {time.monotonic() - t0:.1f} s")
    try:
        result["torch"] = torch_checks(result.get("plans", {}))
    except Exception as exc:
        result["torch"] = {"error": repr(exc)}
    return result


def summary(result: dict[str, Any]) -> str:
    lines = ["idle: " + "; ".join(findings(result["doctor_idle"])) if "report" in result["doctor_idle"] else
             f"idle: {result['doctor_idle']}"]
    stale = result["stale"]
    if "doctor_held" in stale:
        lines.append(f"holder pid {stale['holder_pid']} comm {stale['holder_comm']!r} ppid {stale['holder_ppid']}")
        for key in ("doctor_held", "doctor_held_dead_upstream", "doctor_after_kill"):
            lines.append(f"{key} (rc {stale[key]['rc']}): " + "; ".join(findings(stale[key])))
    for name, doc in result.get("plans", {}).items():
        r = doc.get("report", {})
        lines.append(f"plan {name}: {r.get('verdict')} kv_tokens={r.get('kv_tokens')} budget={r.get('budget_bytes')} "
                     f"gpu={r.get('gpu_memory_bytes')}")
    return "\n".join(f"- {line}" for line in lines)
