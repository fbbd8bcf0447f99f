"""NVIDIA GPU facts through NVML (``pynvml`` from nvidia-ml-py): memory, versions, processes.

A machine without a GPU, without the driver or without the NVML library is a normal, stated
condition: ``query_gpus`` returns ``GpuReport(available=False, reason=...)`` and never raises.
Every function takes the NVML module as an argument so that tests can hand in a fake.
NVML calls are blocking (milliseconds): async callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1024**2

# Why NVML refused, by its error code (pynvml.NVML_ERROR_*), in words a user can act on.
_INIT_REASONS = {
    12: "the NVML library (libnvidia-ml.so) was not found: no NVIDIA driver is installed here",
    9: "the NVIDIA kernel driver is not loaded",
    4: "no permission to query the NVIDIA driver",
    18: "the NVIDIA driver and its library versions do not match (reboot or reinstall the driver)",
}


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int | None  # None where the driver does not say (some containers, MIG)
    gpu_index: int

    @property
    def used_mib(self) -> int | None:
        return None if self.used_bytes is None else self.used_bytes // MIB


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    processes: tuple[GpuProcess, ...] = ()
    # Held by the driver and never given to CUDA: 615 MiB on an H200 (NVML's total 150,754,820,096 B,
    # cudaMemGetInfo's 150,109,880,320 B). vLLM sizes its share of the card from what CUDA sees.
    reserved_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        """The memory CUDA reports as the card's total: what ``gpu_memory_utilization`` is a share of."""
        return self.total_bytes - self.reserved_bytes


@dataclass(frozen=True)
class GpuReport:
    available: bool
    reason: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None  # the highest CUDA version the driver supports, e.g. "12.4"
    devices: tuple[GpuDevice, ...] = ()

    def total_memory_bytes(self, count: int = 1) -> int | None:
        """The smallest memory CUDA sees among the first ``count`` GPUs (what a parallel plan can use)."""
        if not self.available or len(self.devices) < count:
            return None
        return min(d.usable_bytes for d in self.devices[:count])


def load_nvml() -> Any | None:
    """The real ``pynvml`` module, or None when nvidia-ml-py is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _text(value: Any) -> str:
    # Older pynvml returns bytes, newer returns str.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _error_code(exc: Exception) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


@contextlib.contextmanager
def _session(nvml: Any) -> Iterator[None]:
    nvml.nvmlInit()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def proc_name(pid: int, proc_root: Path = Path("/proc")) -> str:
    """A process's command name from /proc, or "" where it is not visible (another pid namespace).

    vLLM names its engine processes (``VLLM::EngineCore``, ``VLLM::Worker``) through setproctitle; an older one
    or one started as ``python -m vllm...`` is known by its command line, given when the name does not say it.
    """
    try:
        comm = (proc_root / str(pid) / "comm").read_text(encoding="utf-8").strip()
    except OSError:
        return ""
    try:
        argv = (proc_root / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return comm
    command = " ".join(a.decode("utf-8", "replace") for a in argv if a)
    return f"{comm} ({command[:120]})" if "vllm" in command.lower() and "vllm" not in comm.lower() else comm


def _processes(nvml: Any, handle: Any, index: int, name_of: Callable[[int], str]) -> tuple[GpuProcess, ...]:
    seen: dict[int, GpuProcess] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        fn = getattr(nvml, getter, None)
        if fn is None:
            continue
        try:
            entries = fn(handle)
        except nvml.NVMLError:
            continue
        for entry in entries:
            pid = int(entry.pid)
            used = getattr(entry, "usedGpuMemory", None)
            # NVML reports "not available" as None (pynvml) or as the all-ones sentinel.
            used_bytes = int(used) if isinstance(used, int) and 0 <= used < 2**63 else None
            if pid in seen and seen[pid].used_bytes is not None:
                continue
            # NVML names the executable (/usr/bin/python3 for every vLLM on an H200 host): /proc says which.
            name = name_of(pid)
            if not name:
                with contextlib.suppress(Exception):
                    name = _text(nvml.nvmlSystemGetProcessName(pid))
            seen[pid] = GpuProcess(pid=pid, name=name, used_bytes=used_bytes, gpu_index=index)
    return tuple(seen.values())


def _memory(nvml: Any, handle: Any) -> tuple[int, int, int, int]:
    """Total, reserved, free and used bytes. NVML's version 2 (drivers 510+) parts the driver's reserve from
    what processes use; version 1 counts it as used and has no reserve of its own."""
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        with contextlib.suppress(Exception):
            mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
            return int(mem.total), int(mem.reserved), int(mem.free), int(mem.used)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    return int(mem.total), 0, int(mem.free), int(mem.used)


def query_gpus(nvml: Any | None = None, *, name_of: Callable[[int], str] = proc_name) -> GpuReport:
    """Every GPU's memory and processes, the driver and CUDA versions; never raises."""
    nvml = nvml if nvml is not None else load_nvml()
    if nvml is None:
        return GpuReport(available=False, reason="nvidia-ml-py (pynvml) is not installed")
    try:
        with _session(nvml):
            driver = _text(nvml.nvmlSystemGetDriverVersion())
            cuda: str | None = None
            with contextlib.suppress(nvml.NVMLError):
                raw = int(nvml.nvmlSystemGetCudaDriverVersion())
                cuda = f"{raw // 1000}.{raw % 1000 // 10}"
            devices = []
            for index in range(int(nvml.nvmlDeviceGetCount())):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                total, reserved, free, used = _memory(nvml, handle)
                devices.append(
                    GpuDevice(
                        index=index,
                        name=_text(nvml.nvmlDeviceGetName(handle)),
                        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                        total_bytes=total,
                        free_bytes=free,
                        used_bytes=used,
                        processes=_processes(nvml, handle, index, name_of),
                        reserved_bytes=reserved,
                    )
                )
    except nvml.NVMLError as exc:
        code = _error_code(exc)
        reason = _INIT_REASONS.get(code or -1) or f"NVML error: {exc}"
        return GpuReport(available=False, reason=reason)
    except Exception as exc:  # an old or broken pynvml must not turn a status query into a traceback
        return GpuReport(available=False, reason=f"NVML query failed: {type(exc).__name__}: {exc}")
    if not devices:
        return GpuReport(available=False, reason="the NVIDIA driver sees no GPU", driver_version=driver,
                         cuda_version=cuda)
    return GpuReport(available=True, driver_version=driver, cuda_version=cuda, devices=tuple(devices))


def memory_of_pids(pids: Iterable[int], nvml: Any | None = None) -> int | None:
    """GPU memory held by these processes on all GPUs, in bytes; None where NVML cannot tell.

    A vLLM server holds its memory in child processes (EngineCore, workers): pass their pids too.
    NVML reports host pids, so inside a container the numbers may not match local pids.
    """
    wanted = set(pids)
    report = query_gpus(nvml, name_of=lambda _pid: "")
    if not report.available:
        return None
    held = [p.used_bytes for d in report.devices for p in d.processes if p.pid in wanted]
    if any(b is None for b in held):
        return None
    return sum(b for b in held if b is not None)


def memory_of_pid(pid: int, nvml: Any | None = None) -> int | None:
    return memory_of_pids([pid], nvml)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def parent_pid(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """The parent of ``pid`` from /proc/PID/stat, or None where it is not visible."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text(encoding="utf-8")
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields after the last ')' are fixed.
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 else None
