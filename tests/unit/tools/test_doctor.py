from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.engine.vllm_api import parse_metrics
from gateway.gpu import GpuDevice, GpuProcess, GpuReport
from gateway.tools import doctor
from gateway.tools.doctor import (
    UpstreamFacts,
    config_findings,
    diagnose,
    gpu_findings,
    main_doctor,
    render_report,
)
from tests.support.paths import FIXTURES

GIB = 1024**3
URL = "http://vllm.test:8000"
NO_GPU = GpuReport(available=False, reason="the NVML library (libnvidia-ml.so) was not found: no NVIDIA driver")

CACHE_LABELS = (
    'block_size="128",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",'
    'kv_cache_size_tokens="4096",num_cpu_blocks="None",num_gpu_blocks="32"'
)
METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{""" + CACHE_LABELS + """} 1.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} %s
"""


def vllm_routes(max_model_len: int = 2048, preemptions: float = 0.0) -> dict[str, httpx.Response]:
    return {
        "/health": httpx.Response(200),
        "/version": httpx.Response(200, json={"version": "0.32.0"}),
        "/v1/models": httpx.Response(
            200, json={"object": "list", "data": [{"id": "tiny", "root": "/m", "max_model_len": max_model_len}]}
        ),
        "/metrics": httpx.Response(200, text=METRICS % preemptions),
    }


def transport(routes: dict[str, httpx.Response], seen: list[httpx.Request] | None = None) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return routes.get(request.url.path, httpx.Response(404, json={"detail": "Not Found"}))

    return httpx.MockTransport(handler)


def severities(report: Any, check: str) -> list[str]:
    return [f.severity for f in report.findings if f.check == check]


async def test_a_healthy_vllm_with_room_for_two_sequences_passes() -> None:
    report = await diagnose(URL, gpu_report=NO_GPU, transport=transport(vllm_routes()))
    assert report.exit_code == 0
    assert report.upstream == UpstreamFacts(
        url=URL, reachable=True, healthy=True, version="0.32.0", model="tiny", max_model_len=2048,
        block_size=128, num_gpu_blocks=32, kv_cache_size_tokens=4096, preemptions=0.0, metrics_available=True,
    )
    assert "holds 2.00 sequences of max_model_len 2048" in render_report(report)


SCENARIOS: list[tuple[str, Callable[[], dict[str, httpx.Response]], str, str, str]] = [
    ("context longer than the cache", lambda: vllm_routes(max_model_len=32768), "config", "error",
     "--max-model-len 4096"),
    ("engine dead", lambda: {**vllm_routes(), "/health": httpx.Response(503)}, "upstream", "error", "Read vLLM's log"),
    ("api key needed", lambda: {**vllm_routes(), "/v1/models": httpx.Response(401)}, "models", "error",
     "--upstream-api-key"),
    ("stats disabled", lambda: {**vllm_routes(), "/metrics": httpx.Response(200, text="# nothing\n")}, "metrics",
     "warning", "--kv-blocks"),
    ("V0 engine", lambda: {**vllm_routes(), "/version": httpx.Response(200, json={"version": "0.8.5"})},
     "version", "warning", "Upgrade vLLM"),
    ("preemptions seen", lambda: vllm_routes(preemptions=9.0), "config", "warning", "--engine-watermark 0.05"),
    ("not vLLM", lambda: {**vllm_routes(), "/version": httpx.Response(200, text="<html>")}, "version", "info",
     ""),
    ("no model served", lambda: {**vllm_routes(), "/v1/models": httpx.Response(200, json={"data": []})},
     "models", "error", "OpenAI server"),
]


@pytest.mark.parametrize(("case", "routes", "check", "severity", "fix"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
async def test_each_upstream_problem_is_a_finding_with_its_fix(
    case: str, routes: Callable[[], dict[str, httpx.Response]], check: str, severity: str, fix: str
) -> None:
    report = await diagnose(URL, gpu_report=NO_GPU, transport=transport(routes()))
    matching = [f for f in report.findings if f.check == check and f.severity == severity]
    assert matching, render_report(report)
    assert fix in (matching[0].fix or "")
    assert report.exit_code == (1 if any(f.severity == "error" for f in report.findings) else 0)


async def test_an_unreachable_upstream_is_an_error_and_stops_the_upstream_checks() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    report = await diagnose(URL, gpu_report=NO_GPU, transport=httpx.MockTransport(refuse))
    assert report.exit_code == 1
    assert severities(report, "upstream") == ["error"] and severities(report, "models") == []
    assert report.upstream is not None and not report.upstream.reachable


async def test_the_upstream_api_key_is_sent() -> None:
    seen: list[httpx.Request] = []
    await diagnose(URL, gpu_report=NO_GPU, transport=transport(vllm_routes(), seen), api_key="sk-up")
    assert {r.headers.get("authorization") for r in seen} == {"Bearer sk-up"}
    assert {r.url.path for r in seen} == {"/health", "/version", "/v1/models", "/metrics"}


async def test_without_an_upstream_only_the_gpu_is_checked() -> None:
    report = await diagnose(None, gpu_report=NO_GPU)
    assert [f.check for f in report.findings] == ["gpu", "upstream"]
    assert report.exit_code == 0


def test_engine_metrics_are_read_from_prometheus_text() -> None:
    page = parse_metrics(METRICS % 3.0)
    assert (page.has_metrics, page.block_size, page.num_gpu_blocks, page.kv_cache_size_tokens,
            page.preemptions_total) == (True, 128, 32, 4096, 3.0)


async def test_a_v0_engine_is_read_by_the_same_parser() -> None:
    fixtures = FIXTURES / "vllm" / "v0-0.8.5"
    routes = {
        **vllm_routes(),
        "/version": httpx.Response(200, content=(fixtures / "version.json").read_bytes()),
        "/v1/models": httpx.Response(200, content=(fixtures / "models.json").read_bytes()),
        "/metrics": httpx.Response(200, content=(fixtures / "metrics.txt").read_bytes()),
    }
    report = await diagnose(URL, gpu_report=NO_GPU, transport=transport(routes))
    assert report.upstream is not None
    assert (report.upstream.version, report.upstream.block_size, report.upstream.num_gpu_blocks,
            report.upstream.kv_cache_size_tokens, report.upstream.max_model_len) == ("0.8.5", 16, 2000, None, 2048)
    assert severities(report, "version") == ["warning"] and severities(report, "config") == ["ok"]


def test_capacity_falls_back_to_blocks_times_block_size() -> None:
    facts = UpstreamFacts(url=URL, max_model_len=8192, block_size=16, num_gpu_blocks=256, metrics_available=True)
    (finding,) = config_findings(facts)
    assert finding.severity == "error" and "KV cache (4096 tokens)" in finding.message


def gpu(free_gib: float, processes: tuple[GpuProcess, ...] = (), cuda: str = "12.4") -> GpuReport:
    dev = GpuDevice(0, "NVIDIA L4", "GPU-0", 24 * GIB, int(free_gib * GIB), int((24 - free_gib) * GIB), processes)
    return GpuReport(available=True, driver_version="550.54.15", cuda_version=cuda, devices=(dev,))


VLLM_PROC = GpuProcess(pid=4242, name="VLLM::EngineCore", used_bytes=20 * GIB, gpu_index=0)
OTHER_PROC = GpuProcess(pid=777, name="python", used_bytes=1 * GIB, gpu_index=0)

GPU_CASES: list[tuple[str, GpuReport, dict[str, Any], str, str, str]] = [
    ("no driver at all", NO_GPU, {}, "gpu", "info", "CPU build"),
    ("driver not loaded", GpuReport(available=False, reason="the NVIDIA kernel driver is not loaded"), {},
     "gpu", "error", "NVIDIA driver"),
    ("old CUDA driver", gpu(23.0, cuda="11.8"), {}, "driver", "error", "Upgrade"),
    ("memory taken, nothing running", gpu(3.0, (OTHER_PROC,)), {"upstream_up": False}, "vram", "warning",
     "lower --gpu-memory-utilization"),
    ("orphaned vLLM process", gpu(3.0, (VLLM_PROC,)), {"parent_of": lambda pid: 1}, "process", "warning",
     "kill 4242"),
    ("vLLM process while the upstream is down", gpu(3.0, (VLLM_PROC,)),
     {"upstream_up": False, "parent_of": lambda pid: 100}, "process", "warning", "kill 4242"),
    ("process from another namespace", gpu(3.0, (OTHER_PROC,)), {"is_alive": lambda pid: False}, "process",
     "info", "nvidia-smi on the host"),
]


@pytest.mark.parametrize(("case", "report", "kwargs", "check", "severity", "fix"), GPU_CASES,
                         ids=[c[0] for c in GPU_CASES])
def test_gpu_problems_are_findings_with_their_fix(
    case: str, report: GpuReport, kwargs: dict[str, Any], check: str, severity: str, fix: str
) -> None:
    options: dict[str, Any] = {"is_alive": lambda pid: True, "parent_of": lambda pid: 100, **kwargs}
    findings = gpu_findings(report, **options)
    matching = [f for f in findings if f.check == check and f.severity == severity]
    assert matching and fix in (matching[0].fix or ""), findings


def test_memory_held_by_the_running_upstream_is_not_a_warning() -> None:
    findings = gpu_findings(gpu(3.0, (VLLM_PROC,)), upstream_up=True, is_alive=lambda pid: True,
                            parent_of=lambda pid: 100)
    assert [f.severity for f in findings] == ["ok", "info", "info"]
    assert "pid 4242 VLLM::EngineCore 20480 MiB" in findings[1].message


def test_a_gpu_with_room_is_ok() -> None:
    assert [f.severity for f in gpu_findings(gpu(23.0))] == ["ok", "ok"]


def test_doctor_command_prints_json_and_exits_non_zero_on_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(doctor, "query_gpus", lambda nvml=None: NO_GPU)
    assert main_doctor(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exit_code"] == 0
    assert main_doctor(["--upstream", "http://127.0.0.1:9", "--timeout", "0.5"]) == 1
    out = capsys.readouterr().out
    assert "Cannot reach http://127.0.0.1:9" in out and "1 error(s)" in out
