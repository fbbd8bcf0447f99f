"""``vllm-guard doctor``: checks a GPU host and a vLLM upstream, each finding with its fix.

GPU: driver and CUDA versions, memory, processes holding VRAM (stale vLLM leftovers above all).
Upstream: reachability and health, version, served model and ``max_model_len``, and whether the
KV cache it reports (``vllm:cache_config_info``) can hold the context it promises. Any finding of
severity "error" makes the exit code non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import httpx

from gateway.engine.vllm_api import parse_metrics, parse_models, parse_version
from gateway.errors import BadUpstreamResponse
from gateway.gpu import GpuReport, parent_pid, pid_alive, query_gpus
from gateway.redact import redact_url, redact_urls_in

Severity = Literal["ok", "info", "warning", "error"]
GIB = 1024**3
MIB = 1024**2
# The gateway supports vLLM's V1 engine (0.10+) first; older engines lack its metrics and errors.
MIN_VLLM = (0, 10)
MIN_CUDA_MAJOR = 12  # vLLM's CUDA wheels have been built for CUDA 12 and newer since 0.4


@dataclass(frozen=True)
class Finding:
    check: str
    severity: Severity
    message: str
    fix: str | None = None


@dataclass(frozen=True)
class UpstreamFacts:
    url: str
    reachable: bool = False
    healthy: bool | None = None
    version: str | None = None
    model: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    kv_cache_size_tokens: int | None = None
    preemptions: float | None = None
    metrics_available: bool = False


@dataclass(frozen=True)
class DoctorReport:
    findings: tuple[Finding, ...]
    upstream: UpstreamFacts | None = None
    gpu: GpuReport | None = field(default=None, repr=False)

    @property
    def exit_code(self) -> int:
        return 1 if any(f.severity == "error" for f in self.findings) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "findings": [asdict(f) for f in self.findings],
            "upstream": asdict(self.upstream) if self.upstream else None,
        }


# -- GPU -------------------------------------------------------------------------------------------
def _looks_like_vllm(name: str) -> bool:
    return "vllm" in name.lower()


def gpu_findings(
    report: GpuReport,
    *,
    gpu_memory_utilization: float = 0.9,
    upstream_up: bool | None = None,
    is_alive: Callable[[int], bool] = pid_alive,
    parent_of: Callable[[int], int | None] = parent_pid,
) -> list[Finding]:
    """Findings about the driver, memory and processes of every GPU."""
    if not report.available:
        reason = report.reason or "unknown reason"
        # No GPU at all is a fine state for the CPU build; a driver that is there but broken is not.
        broken = any(w in reason for w in ("not loaded", "do not match", "permission", "NVML error", "failed"))
        return [Finding(
            "gpu", "error" if broken else "info", f"No NVIDIA GPU usable: {reason}",
            "Install or reload the NVIDIA driver (nvidia-smi must work)" if broken
            else "Nothing to do for vLLM's CPU build; a GPU host needs the NVIDIA driver",
        )]
    out = [Finding("driver", "ok", f"NVIDIA driver {report.driver_version}, CUDA {report.cuda_version or '?'}")]
    if report.cuda_version and int(report.cuda_version.split(".")[0]) < MIN_CUDA_MAJOR:
        out.append(Finding(
            "driver", "error",
            f"The driver supports CUDA {report.cuda_version}; vLLM needs CUDA {MIN_CUDA_MAJOR} or newer",
            "Upgrade the NVIDIA driver",
        ))
    for dev in report.devices:
        want = int(dev.usable_bytes * gpu_memory_utilization)
        holders = ", ".join(
            f"pid {p.pid} {p.name or '?'} {p.used_mib if p.used_mib is not None else '?'} MiB"
            for p in dev.processes
        )
        reserve = f" ({dev.reserved_bytes / GIB:.2f} GiB more reserved by the driver)" if dev.reserved_bytes else ""
        summary = (f"GPU {dev.index} {dev.name}: {dev.used_bytes / GIB:.2f} of {dev.usable_bytes / GIB:.2f} GiB "
                   f"used{reserve}, {dev.free_bytes / GIB:.2f} GiB free")
        if dev.free_bytes >= want:
            out.append(Finding("vram", "ok", summary))
        else:
            # A running upstream holds its own memory: only a vLLM about to start needs it free.
            out.append(Finding(
                "vram", "info" if upstream_up else "warning",
                f"{summary}; a new vLLM at gpu_memory_utilization {gpu_memory_utilization} needs "
                f"{want / GIB:.2f} GiB free and would refuse to start"
                + (f" (held by {holders})" if holders else ""),
                None if upstream_up else "Stop the processes holding the memory, or lower --gpu-memory-utilization",
            ))
        for proc in dev.processes:
            out.extend(_process_findings(proc.pid, proc.name, proc.used_mib, dev.index, upstream_up,
                                         is_alive, parent_of))
    return out


def _process_findings(
    pid: int, name: str, mib: int | None, gpu: int, upstream_up: bool | None,
    is_alive: Callable[[int], bool], parent_of: Callable[[int], int | None],
) -> list[Finding]:
    held = f"{mib} MiB" if mib is not None else "memory"
    label = f"pid {pid} ({name or 'name unknown'}) holds {held} on GPU {gpu}"
    if not is_alive(pid):
        return [Finding("process", "info", f"{label}; the process is not visible here (another container "
                        "or the host)", "Check it with nvidia-smi on the host")]
    if _looks_like_vllm(name) and parent_of(pid) == 1:
        return [Finding("process", "warning", f"{label}; it is an orphaned vLLM process (its server is gone)",
                        f"kill {pid}")]
    if _looks_like_vllm(name) and upstream_up is False:
        return [Finding("process", "warning", f"{label} while the upstream does not answer: likely left over "
                        "from a crashed vLLM", f"kill {pid} if no other server should run")]
    return [Finding("process", "info", label)]


# -- upstream --------------------------------------------------------------------------------------
async def probe_upstream(client: httpx.AsyncClient, url: str) -> tuple[UpstreamFacts, list[Finding]]:
    """Ask the upstream for /health, /version, /v1/models and /metrics; the report never shows the URL's
    credentials (a doctor report is pasted into issues and CI logs)."""
    facts, findings = await _probe_upstream(client, url.rstrip("/"))
    shown = [replace(f, message=redact_urls_in(f.message)) for f in findings]
    return replace(facts, url=redact_url(facts.url)), shown


async def _probe_upstream(client: httpx.AsyncClient, base: str) -> tuple[UpstreamFacts, list[Finding]]:
    try:
        health = await client.get(f"{base}/health")
    except httpx.HTTPError as exc:
        return UpstreamFacts(url=base), [Finding(
            "upstream", "error", f"Cannot reach {base}: {type(exc).__name__} {exc}".rstrip(),
            "Start vLLM, or pass the right --upstream URL",
        )]
    facts: dict[str, Any] = {"url": base, "reachable": True, "healthy": health.status_code == 200}
    out: list[Finding] = []
    if health.status_code == 200:
        out.append(Finding("upstream", "ok", f"{base}/health answers 200"))
    else:
        out.append(Finding("upstream", "error", f"{base}/health answers {health.status_code}: the engine is dead "
                           "or not ready", "Read vLLM's log; restart it (managed mode restarts it itself)"))
    out.extend(await _probe_version(client, base, facts))
    out.extend(await _probe_models(client, base, facts))
    out.extend(await _probe_metrics(client, base, facts))
    return UpstreamFacts(**facts), out


async def _get(client: httpx.AsyncClient, url: str) -> httpx.Response | None:
    try:
        return await client.get(url)
    except httpx.HTTPError:
        return None


async def _probe_version(client: httpx.AsyncClient, base: str, facts: dict[str, Any]) -> list[Finding]:
    resp = await _get(client, f"{base}/version")
    version = parse_version(resp.content) if resp is not None and resp.status_code == 200 else None
    if version is None:
        return [Finding("version", "info", f"{base}/version gives no version; not a vLLM server, or a very old one")]
    facts["version"] = version.text
    if version.release < MIN_VLLM:
        return [Finding("version", "warning", f"vLLM {version} predates the V1 engine (0.10): capacity metrics and "
                        "error texts differ", "Upgrade vLLM to 0.10 or newer")]
    return [Finding("version", "ok", f"vLLM {version}")]


async def _probe_models(client: httpx.AsyncClient, base: str, facts: dict[str, Any]) -> list[Finding]:
    resp = await _get(client, f"{base}/v1/models")
    if resp is None:
        return [Finding("models", "error", f"{base}/v1/models did not answer", "Read vLLM's log")]
    if resp.status_code == 401:
        return [Finding("models", "error", f"{base}/v1/models answers 401: the upstream wants an API key",
                        "Pass --upstream-api-key (the key vLLM was started with)")]
    first = None
    if resp.status_code == 200:
        # A body that is no model list is a missing fact, reported as a finding, not a traceback.
        with contextlib.suppress(BadUpstreamResponse):
            first = parse_models(resp.content).first
    if first is None:
        return [Finding("models", "error", f"{base}/v1/models answers {resp.status_code} without a model",
                        "Check that the upstream is a vLLM OpenAI server")]
    facts["model"] = first.id
    facts["max_model_len"] = first.max_model_len
    return [Finding("models", "ok", f"serves {facts['model']!r}, max_model_len {facts['max_model_len']}")]


async def _probe_metrics(client: httpx.AsyncClient, base: str, facts: dict[str, Any]) -> list[Finding]:
    resp = await _get(client, f"{base}/metrics")
    page = parse_metrics(resp.text) if resp is not None and resp.status_code == 200 else None
    if page is None or not page.has_metrics:
        return [Finding("metrics", "warning", f"{base}/metrics has no vllm: metrics (--disable-log-stats?)",
                        "Drop --disable-log-stats, or give the gateway --kv-blocks and --block-size")]
    facts.update(
        metrics_available=True, block_size=page.block_size, num_gpu_blocks=page.num_gpu_blocks,
        kv_cache_size_tokens=page.kv_cache_size_tokens, preemptions=page.preemptions_total,
    )
    return [Finding("metrics", "ok", "engine metrics available")]


def config_findings(facts: UpstreamFacts) -> list[Finding]:
    """Does the KV cache the engine reports hold the context it promises?"""
    out: list[Finding] = []
    capacity = facts.kv_cache_size_tokens
    if capacity is None and facts.num_gpu_blocks is not None and facts.block_size is not None:
        capacity = facts.num_gpu_blocks * facts.block_size
    mml = facts.max_model_len
    if capacity is None:
        if facts.metrics_available:
            out.append(Finding("config", "warning", "vllm:cache_config_info gives no KV capacity",
                               "Give the gateway --kv-blocks and --block-size"))
        return out
    if mml is not None and mml > capacity:
        out.append(Finding(
            "config", "error",
            f"max_model_len {mml} is larger than the KV cache ({capacity} tokens): a full-length request "
            "can never run", f"Start vLLM with --max-model-len {capacity} or more GPU memory; or give the "
            f"gateway --max-model-len {capacity}",
        ))
    elif mml is not None:
        fits = capacity / mml
        out.append(Finding(
            "config", "ok" if fits >= 2 else "info",
            f"KV cache {capacity} tokens holds {fits:.2f} sequences of max_model_len {mml}",
            None if fits >= 2 else "Long requests will wait for each other; the gateway queues them",
        ))
    if facts.preemptions:
        out.append(Finding(
            "config", "warning", f"vLLM preempted {int(facts.preemptions)} sequences since it started: its KV "
            "cache overflowed", "Send traffic through vllm-guard (KV admission). For traffic that bypasses it, start "
            "vLLM 0.32+ with --watermark 0.05 (it then admits only while 5% of the blocks stay free: no preemption "
            "on the realistic benchmark) and give the gateway --engine-watermark 0.05; else lower --max-num-seqs",
        ))
    return out


async def diagnose(
    upstream: str | None,
    *,
    gpu_report: GpuReport | None = None,
    nvml: Any | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    api_key: str | None = None,
    timeout: float = 3.0,
    gpu_memory_utilization: float = 0.9,
) -> DoctorReport:
    """Run every check; ``gpu_report`` and ``transport`` let tests supply the world."""
    report = gpu_report if gpu_report is not None else await asyncio.to_thread(query_gpus, nvml)
    findings: list[Finding] = []
    facts: UpstreamFacts | None = None
    if upstream:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        async with httpx.AsyncClient(timeout=timeout, transport=transport, headers=headers) as client:
            facts, upstream_findings = await probe_upstream(client, upstream)
        findings += upstream_findings + config_findings(facts)
    else:
        findings.append(Finding("upstream", "info", "No --upstream given: upstream checks skipped"))
    up = None if facts is None else bool(facts.reachable and facts.healthy)
    findings = gpu_findings(report, gpu_memory_utilization=gpu_memory_utilization, upstream_up=up) + findings
    return DoctorReport(findings=tuple(findings), upstream=facts, gpu=report)


_MARKS = {"ok": " ok  ", "info": "info ", "warning": "WARN ", "error": "ERROR"}


def render_report(report: DoctorReport) -> str:
    lines = []
    for f in report.findings:
        lines.append(f"[{_MARKS[f.severity]}] {f.check:<8} {f.message}")
        if f.fix:
            lines.append(f"{'':17}fix: {f.fix}")
    errors = sum(f.severity == "error" for f in report.findings)
    warnings = sum(f.severity == "warning" for f in report.findings)
    lines.append(f"\n{errors} error(s), {warnings} warning(s)")
    return "\n".join(lines) + "\n"


# -- command line ----------------------------------------------------------------------------------
def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", default=None, help="Base URL of the vLLM server to check.")
    parser.add_argument("--upstream-api-key", default=None, help="API key the vLLM server expects.")
    parser.add_argument("--timeout", type=float, default=3.0, help="Seconds per HTTP check (default 3).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="Fraction of a GPU a new vLLM would claim, for the free-memory check.")
    parser.add_argument("--json", action="store_true", help="Print the findings as JSON.")


def run_doctor(args: argparse.Namespace) -> int:
    report = asyncio.run(diagnose(
        args.upstream, api_key=args.upstream_api_key, timeout=args.timeout,
        gpu_memory_utilization=args.gpu_memory_utilization,
    ))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render_report(report), end="")
    return report.exit_code


def main_doctor(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-guard doctor", description=__doc__.split("\n")[0])
    add_doctor_arguments(parser)
    return run_doctor(parser.parse_args(argv))
