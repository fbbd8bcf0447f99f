from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway import gpu
from gateway.gpu import (
    GpuReport,
    memory_of_pid,
    memory_of_pids,
    parent_pid,
    pid_alive,
    proc_name,
    query_gpus,
)

GIB = 1024**3
MIB = 1024**2


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNVML:
    """The slice of pynvml that gateway.gpu calls, with two GPUs and a few processes."""

    NVMLError = FakeNVMLError

    def __init__(self, *, init_error: int | None = None, devices: int = 2, old_bytes: bool = False) -> None:
        self.init_error = init_error
        self.count = devices
        self.old_bytes = old_bytes
        self.shutdowns = 0
        self.compute: dict[int, list[Any]] = {
            0: [SimpleNamespace(pid=101, usedGpuMemory=70 * 1024 * MIB),
                SimpleNamespace(pid=102, usedGpuMemory=None)],
            1: [SimpleNamespace(pid=101, usedGpuMemory=2 * 1024 * MIB)],
        }
        self.graphics: dict[int, list[Any]] = {0: [SimpleNamespace(pid=101, usedGpuMemory=None)], 1: []}

    def _s(self, text: str) -> str | bytes:
        return text.encode() if self.old_bytes else text

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self._s("550.54.15")

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:
        return self._s("NVIDIA H100 80GB HBM3")

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        return self._s(f"GPU-{handle}")

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        used = (72 if handle == 0 else 2) * GIB
        return SimpleNamespace(total=80 * GIB, used=used, free=80 * GIB - used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return self.compute[handle]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[Any]:
        return self.graphics[handle]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        if pid == 102:
            raise FakeNVMLError(3)
        return "/usr/bin/python3"  # the executable, as a real driver names a vLLM engine


@pytest.mark.parametrize("old_bytes", [False, True])
def test_a_fake_nvml_gives_memory_versions_and_processes(old_bytes: bool) -> None:
    fake = FakeNVML(old_bytes=old_bytes)
    report = query_gpus(fake, name_of=lambda pid: "VLLM::EngineCore" if pid == 101 else "")
    assert report.available and report.reason is None
    assert (report.driver_version, report.cuda_version) == ("550.54.15", "12.4")
    first, second = report.devices
    assert (first.name, first.uuid, first.total_bytes, first.free_bytes) == (
        "NVIDIA H100 80GB HBM3", "GPU-0", 80 * GIB, 8 * GIB)
    by_pid = {p.pid: p for p in first.processes}
    # pid 101 appears as compute (with memory) and graphics (without): the figure with memory wins. Its name
    # comes from /proc; where /proc does not show a process, NVML's name for it (none for 102).
    assert by_pid[101].used_mib == 70 * 1024 and by_pid[101].name == "VLLM::EngineCore"
    assert by_pid[102].used_bytes is None and by_pid[102].name == ""
    assert second.processes[0].gpu_index == 1
    assert fake.shutdowns == 1


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (12, "was not found"),
        (9, "driver is not loaded"),
        (4, "no permission"),
        (18, "versions do not match"),
        (999, "NVML error"),
    ],
)
def test_nvml_init_failures_are_stated_conditions(code: int, reason: str) -> None:
    report = query_gpus(FakeNVML(init_error=code))
    assert not report.available and report.devices == ()
    assert report.reason is not None and reason in report.reason


def test_a_driver_without_gpus_is_unavailable_but_keeps_its_versions() -> None:
    report = query_gpus(FakeNVML(devices=0))
    assert not report.available and report.driver_version == "550.54.15"
    assert report.reason == "the NVIDIA driver sees no GPU"


def test_an_unexpected_nvml_failure_is_a_reason_not_a_traceback() -> None:
    broken = FakeNVML()
    broken.nvmlDeviceGetMemoryInfo = None  # type: ignore[assignment,method-assign]
    report = query_gpus(broken)
    assert not report.available and report.reason is not None and "TypeError" in report.reason


def test_without_nvidia_ml_py_the_reason_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "load_nvml", lambda: None)
    assert query_gpus() == GpuReport(available=False, reason="nvidia-ml-py (pynvml) is not installed")


def test_the_real_nvml_call_path_never_raises() -> None:
    report = query_gpus()
    if report.available:  # a GPU host
        assert report.devices and all(d.total_bytes > 0 for d in report.devices)
    else:
        assert report.reason and report.devices == ()
        assert memory_of_pid(os.getpid()) is None


def test_memory_of_pids_sums_the_pids_asked_for() -> None:
    fake = FakeNVML()
    assert memory_of_pids([101], fake) == 72 * 1024 * MIB  # on both GPUs
    assert memory_of_pid(999, fake) == 0
    assert memory_of_pids([101, 102], fake) is None  # 102's memory is not reported
    assert memory_of_pid(101, FakeNVML(init_error=12)) is None


def test_total_memory_is_the_smallest_of_the_gpus_needed() -> None:
    report = query_gpus(FakeNVML())
    assert report.total_memory_bytes(2) == 80 * GIB
    assert report.total_memory_bytes(3) is None
    assert GpuReport(available=False, reason="x").total_memory_bytes() is None


def test_a_process_proc_does_not_show_is_named_by_nvml() -> None:
    report = query_gpus(FakeNVML(), name_of=lambda pid: "")
    assert report.devices[0].processes[0].name == "/usr/bin/python3"


@pytest.mark.parametrize(
    ("comm", "cmdline", "name"),
    [
        ("VLLM::EngineCor", "VLLM::EngineCore", "VLLM::EngineCor"),
        ("python3", "/usr/bin/python3\0-m\0vllm.entrypoints.openai.api_server\0--model\0m",
         "python3 (/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model m)"),
        ("python3", "python3\0train.py", "python3"),
    ],
)
def test_a_vllm_started_as_python_is_known_by_its_command_line(
    tmp_path: Path, comm: str, cmdline: str, name: str
) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "comm").write_text(comm + "\n")
    (tmp_path / "7" / "cmdline").write_bytes(cmdline.encode() + b"\0")
    assert proc_name(7, tmp_path) == name


def test_process_names_and_parents_come_from_proc(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "comm").write_text("VLLM::Worker\n")
    (tmp_path / "42" / "stat").write_text("42 (VLLM::Worker (tp 0)) S 1 42 42 0 -1 4194560\n")
    assert proc_name(42, tmp_path) == "VLLM::Worker"
    assert parent_pid(42, tmp_path) == 1
    assert proc_name(43, tmp_path) == "" and parent_pid(43, tmp_path) is None


def test_pid_alive_tells_live_from_gone() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(2**22 + 12345)


class FakeNVMLv2(FakeNVML):
    """A driver with NVML's memory info version 2, which parts its own reserve from what processes use."""

    nvmlMemory_v2 = 0x02000028

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> Any:
        if version is None:  # version 1 counts the reserve as used
            return SimpleNamespace(total=150_754_820_096, used=644_939_776, free=150_109_880_320)
        return SimpleNamespace(total=150_754_820_096, reserved=644_939_776, used=0, free=150_109_880_320)


def test_the_drivers_reserve_is_not_memory_a_plan_or_a_process_can_use() -> None:
    # The figures an H200 gave: CUDA's own total (cudaMemGetInfo) is NVML's total less the reserve.
    report = query_gpus(FakeNVMLv2(devices=1))
    device = report.devices[0]
    assert (device.reserved_bytes, device.used_bytes) == (644_939_776, 0)
    assert device.usable_bytes == 150_109_880_320 == report.total_memory_bytes()


def test_a_driver_without_memory_info_v2_has_no_reserve() -> None:
    device = query_gpus(FakeNVML(devices=1)).devices[0]
    assert device.reserved_bytes == 0 and device.usable_bytes == device.total_bytes == 80 * GIB
