"""Reading vLLM: its log lines, its command line, its progress counters, and what to do about them.

Free of I/O so that every rule can be table-tested: the supervisor feeds each line the managed engine
prints and reads back its KV capacity (the log is the only place some versions state it) and the reason a
start-up failed, so that auto-fit acts on vLLM's own numbers; the watchdog turns observations stamped by
the caller into restart decisions. Texts follow vLLM 0.7 .. 0.33 (V0 and V1) and PyTorch's CUDA
out-of-memory message; older spellings stay as fallbacks because the user picks the vLLM version.
"""

from __future__ import annotations

import logging
import math
import re
import shlex
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config import Settings

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_GPU_UTILIZATION = 0.9
MAX_GPU_UTILIZATION = 0.95
GPU_UTILIZATION_STEP = 0.03
STORM_WINDOW = 60.0
_PYTHON = re.compile(r"python[\d.]*$")

_NUM = r"[\d,]+"
_FLOAT = r"\d+(?:\.\d+)?"

# 0.28+: "<dev> KV cache size: N tokens, Maximum concurrency ..." on one line; <=0.27 on two lines.
_KV_SIZE = re.compile(rf"\b(?P<dev>[A-Z]{{2,5}})(?: \+ host)? KV cache size: (?P<tok>{_NUM}) tokens")
_CONCURRENCY = re.compile(
    rf"Maximum concurrency for (?P<len>{_NUM}) tokens per request: (?P<x>{_FLOAT})x"
)
# V0: "# GPU blocks: N, # CPU blocks: M" (0.7-0.8: "# cuda blocks"); the V0 CPU backend: "# CPU blocks: N".
_V0_BLOCKS = re.compile(r"# (?P<dev>GPU|cuda|CUDA|npu|xpu) blocks: (?P<dev_blocks>\d+), # CPU blocks: (?P<cpu>\d+)")
_V0_CPU_ONLY = re.compile(r"# CPU blocks: (?P<cpu>\d+)")
_AVAILABLE_KV = re.compile(rf"Available KV cache memory: (?P<gib>-?{_FLOAT}) GiB")
_PLATFORM = re.compile(r"Automatically detected platform (?P<name>\w+)\.")

# V1 (0.8 .. 0.33); 0.10-0.20 spell it "models's"; the estimate sentence is absent when it is 0.
_V1_MAX_SEQ = re.compile(
    rf"To serve at least one request with the models?'s max seq len \((?P<len>\d+)\), "
    rf"\((?P<need>{_FLOAT}) GiB KV cache is needed, which is larger than the available KV cache "
    rf"memory \((?P<avail>-?{_FLOAT}) GiB\)"
)
_ESTIMATE = re.compile(r"estimated maximum model length is (?P<est>\d+)")
_V0_MAX_SEQ = re.compile(
    r"The model's max seq len \((?P<len>\d+)\) is larger than the maximum number of tokens that can be "
    r"stored in KV cache \((?P<kv>\d+)\)"
)
_NO_CACHE_MEMORY = re.compile(r"No available memory for the cache blocks")
# 0.11+: "Free memory on device cuda:0 (a/b GiB) ..."; before: no device name.
_FREE_MEMORY = re.compile(
    rf"Free memory on device(?: (?P<dev>[^\s(]+))? \((?P<free>{_FLOAT})/(?P<total>{_FLOAT}) GiB\) on startup "
    rf"is less than desired GPU memory utilization \((?P<util>{_FLOAT}), (?P<req>{_FLOAT}) GiB\)"
)
_CPU_MEMORY = re.compile(
    rf"Available memory on node (?P<dev>\S+) \((?P<free>{_FLOAT})/(?P<total>{_FLOAT}) GiB\) on startup "
    rf"is less than desired CPU memory utilization \((?P<util>{_FLOAT}), (?P<req>{_FLOAT}) GiB\)"
)
_CUDA_OOM = re.compile(
    rf"CUDA out of memory\.(?: Tried to allocate (?P<amt>{_FLOAT}) (?P<unit>[KMGT]i?B))?"
)
_RESERVED_UNALLOCATED = re.compile(
    rf"(?P<amt>{_FLOAT}) (?P<unit>[KMGT]i?B) is reserved by PyTorch but unallocated"
)
# PyTorch 2.1+ and its older wording (max_split_size_mb) both point at allocator fragmentation.
_FRAGMENTATION_HINT = re.compile(
    r"If reserved but unallocated memory is large|If reserved memory is >> allocated memory"
)

# The engine process died under a live API server, which then fails every request and exits.
_ENGINE_DEAD = re.compile(r"\bEngineDeadError\b|\bWorker proc \S+ died unexpectedly")
# What a live API server answers requests with once its engine is dead: 0.10+ relays EngineDeadError's
# text (0.32: 500 "EngineCore encountered an issue. ..."), V0 AsyncEngineDeadError's.
_ENGINE_DEAD_REPLY = re.compile(r"EngineDead|EngineCore encountered an issue|Background loop has errored")

_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_PROBE_ACCESS = re.compile(r'"GET /(?:health|metrics|v1/models) HTTP/[\d.]+" 200')

_UNIT_MIB = {"K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0 * 1024.0}


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _mib(amount: str, unit: str) -> float:
    return float(amount) * _UNIT_MIB[unit[0]]


# -- events ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KvCacheSize:
    device: str
    tokens: int


@dataclass(frozen=True)
class MaxConcurrency:
    tokens_per_request: int
    factor: float


@dataclass(frozen=True)
class BlockCounts:
    device: str
    device_blocks: int
    cpu_blocks: int | None


@dataclass(frozen=True)
class AvailableKvMemory:
    gib: float


@dataclass(frozen=True)
class PlatformDetected:
    name: str


@dataclass(frozen=True)
class MaxSeqLenTooLarge:
    """The model's context does not fit the KV cache (V1: with vLLM's estimate; V0: with the token count)."""

    max_seq_len: int
    estimated_max_len: int | None = None
    kv_tokens: int | None = None
    needed_gib: float | None = None
    available_gib: float | None = None


@dataclass(frozen=True)
class NoCacheMemory:
    pass


@dataclass(frozen=True)
class InsufficientFreeMemory:
    """Another process holds device memory, so vLLM's budget cannot be met at start-up."""

    device: str | None
    free_gib: float
    total_gib: float
    utilization: float
    requested_gib: float
    cpu: bool = False


@dataclass(frozen=True)
class CudaOutOfMemory:
    tried_mib: float | None
    reserved_unallocated_mib: float | None
    fragmentation_hint: bool


@dataclass(frozen=True)
class FragmentationHint:
    """PyTorch's advice printed on its own line after an out-of-memory error."""

    reserved_unallocated_mib: float | None


@dataclass(frozen=True)
class EngineDead:
    line: str


StartupFailure = MaxSeqLenTooLarge | NoCacheMemory | InsufficientFreeMemory | CudaOutOfMemory
LogEvent = (
    KvCacheSize
    | MaxConcurrency
    | BlockCounts
    | AvailableKvMemory
    | PlatformDetected
    | MaxSeqLenTooLarge
    | NoCacheMemory
    | InsufficientFreeMemory
    | CudaOutOfMemory
    | FragmentationHint
    | EngineDead
)


def parse_line(line: str) -> list[LogEvent]:
    """Every fact one log line states, in the order they appear; [] for the noise."""
    events: list[LogEvent] = []
    if "KV cache" in line or "concurrency" in line or "blocks:" in line:
        events.extend(_capacity_events(line))
    if m := _PLATFORM.search(line):
        events.append(PlatformDetected(m["name"].lower()))
    if m := _V1_MAX_SEQ.search(line):
        est = _ESTIMATE.search(line, m.end())
        events.append(
            MaxSeqLenTooLarge(
                max_seq_len=int(m["len"]),
                estimated_max_len=int(est["est"]) if est and int(est["est"]) > 0 else None,
                needed_gib=float(m["need"]),
                available_gib=float(m["avail"]),
            )
        )
    elif m := _V0_MAX_SEQ.search(line):
        events.append(MaxSeqLenTooLarge(max_seq_len=int(m["len"]), kv_tokens=int(m["kv"])))
    if _NO_CACHE_MEMORY.search(line):
        events.append(NoCacheMemory())
    if m := _FREE_MEMORY.search(line) or _CPU_MEMORY.search(line):
        events.append(
            InsufficientFreeMemory(
                device=m["dev"],
                free_gib=float(m["free"]),
                total_gib=float(m["total"]),
                utilization=float(m["util"]),
                requested_gib=float(m["req"]),
                cpu=m.re is _CPU_MEMORY,
            )
        )
    reserved = _RESERVED_UNALLOCATED.search(line)
    reserved_mib = _mib(reserved["amt"], reserved["unit"]) if reserved else None
    hint = _FRAGMENTATION_HINT.search(line) is not None
    if m := _CUDA_OOM.search(line):
        tried = _mib(m["amt"], m["unit"]) if m["amt"] else None
        events.append(CudaOutOfMemory(tried, reserved_mib, hint))
    elif hint:
        events.append(FragmentationHint(reserved_mib))
    if _ENGINE_DEAD.search(line):
        events.append(EngineDead(line.strip()))
    return events


def _capacity_events(line: str) -> list[LogEvent]:
    events: list[LogEvent] = []
    if m := _KV_SIZE.search(line):
        events.append(KvCacheSize(m["dev"].upper(), _int(m["tok"])))
    if m := _CONCURRENCY.search(line):
        events.append(MaxConcurrency(_int(m["len"]), float(m["x"])))
    if m := _V0_BLOCKS.search(line):
        dev = "GPU" if m["dev"].lower() in {"gpu", "cuda"} else m["dev"].upper()
        events.append(BlockCounts(dev, int(m["dev_blocks"]), int(m["cpu"])))
    elif m := _V0_CPU_ONLY.search(line):
        events.append(BlockCounts("CPU", int(m["cpu"]), None))
    if m := _AVAILABLE_KV.search(line):
        events.append(AvailableKvMemory(float(m["gib"])))
    return events


def default_block_size(device: str | None) -> int:
    """vLLM's block size when --block-size is not given: 128 on the CPU backend, 16 elsewhere."""
    return 128 if device is not None and device.lower() == "cpu" else 16


# -- accumulated facts of one engine run ----------------------------------------------------------
@dataclass
class LogFacts:
    """What one run of the engine has said about itself so far."""

    device: str | None = None
    kv_tokens: int | None = None
    device_blocks: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    available_kv_gib: float | None = None
    failure: StartupFailure | None = None
    oom: CudaOutOfMemory | None = None
    events: list[LogEvent] = field(default_factory=list)

    def feed(self, line: str) -> list[LogEvent]:
        """Parse one line, fold its facts in, and return its events."""
        found = parse_line(line)
        for ev in found:
            self._apply(ev)
        # Keep the failure-relevant history short: only events, never the whole log.
        self.events.extend(found)
        del self.events[:-64]
        return found

    def _apply(self, ev: LogEvent) -> None:
        match ev:
            case KvCacheSize(device=dev, tokens=tok):
                self.device, self.kv_tokens = dev, tok
            case MaxConcurrency(tokens_per_request=n, factor=x):
                self.max_model_len, self.max_concurrency = n, x
            case BlockCounts(device=dev, device_blocks=n):
                self.device = self.device or dev
                self.device_blocks = n
            case AvailableKvMemory(gib=g):
                self.available_kv_gib = g
            case PlatformDetected(name=name):
                self.device = self.device or ("CPU" if name == "cpu" else "GPU")
            case CudaOutOfMemory():
                self.oom = ev
                self.failure = ev
            case FragmentationHint(reserved_unallocated_mib=mib):
                # PyTorch prints the hint as part of the OOM text; fold it into the error before it.
                if self.oom is not None:
                    self.oom = CudaOutOfMemory(
                        self.oom.tried_mib, mib or self.oom.reserved_unallocated_mib, True
                    )
                    self.failure = self.oom
            case MaxSeqLenTooLarge() | NoCacheMemory() | InsufficientFreeMemory():
                self.failure = ev

    def capacity(self, block_size: int | None) -> tuple[int, int] | None:
        """(KV tokens, KV blocks) from the log; block size from the args, else vLLM's default."""
        bs = block_size or default_block_size(self.device)
        if self.kv_tokens is not None:
            blocks = self.device_blocks if self.device_blocks is not None else self.kv_tokens // bs
            return self.kv_tokens, blocks
        if self.device_blocks is not None:
            return self.device_blocks * bs, self.device_blocks
        return None


def describe_failure(failure: StartupFailure) -> str:
    """One sentence for logs and error reports, with vLLM's own numbers."""
    match failure:
        case MaxSeqLenTooLarge(max_seq_len=n, estimated_max_len=est, kv_tokens=kv):
            if est is not None:
                return f"max_model_len {n} does not fit the KV cache; vLLM estimates {est} would"
            if kv is not None:
                return f"max_model_len {n} does not fit the KV cache of {kv} tokens"
            return f"max_model_len {n} does not fit the KV cache, and vLLM estimates no length would"
        case NoCacheMemory():
            return "no memory is left for the KV cache blocks after loading the model"
        case InsufficientFreeMemory(device=dev, free_gib=free, total_gib=total, utilization=u, requested_gib=r):
            where = f"device {dev}" if dev else "the device"
            return (
                f"{where} has {free:g}/{total:g} GiB free at start-up, less than the "
                f"{r:g} GiB asked for by memory utilization {u:g}"
            )
        case CudaOutOfMemory(tried_mib=tried, reserved_unallocated_mib=reserved):
            text = "CUDA out of memory"
            if tried is not None:
                text += f" allocating {tried:g} MiB"
            if reserved is not None:
                text += f" with {reserved:g} MiB reserved but unallocated (allocator fragmentation)"
            return text


def log_level(line: str) -> int:
    """The logging level to relay one line of vLLM's output at: its own, INFO when it names none."""
    if _PROBE_ACCESS.search(line):
        return logging.DEBUG  # the gateway's own probes and scrapes, several a second
    m = _LEVEL.search(line, 0, 80)
    return logging.getLevelNamesMapping().get(m[1], logging.INFO) if m else logging.INFO


def engine_death_reply(message: str) -> bool:
    """Whether an error message from vLLM's API server says that its engine died (not the request's fault)."""
    return _ENGINE_DEAD_REPLY.search(message) is not None


# -- vLLM's command line --------------------------------------------------------------------------
def arg_value(args: Sequence[str], name: str) -> str | None:
    """The last value of ``--name`` (vLLM also accepts ``--name=v`` and underscores), else None."""
    wanted = {name, name.replace("-", "_").replace("__", "--")}
    value: str | None = None
    for i, a in enumerate(args):
        key, eq, val = a.partition("=")
        if key in wanted:
            if eq:
                value = val
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


def with_arg(args: Sequence[str], name: str, value: str) -> list[str]:
    """``args`` with every ``--name`` removed and ``--name value`` appended."""
    wanted = {name, name.replace("-", "_").replace("__", "--")}
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        key, eq, _ = a.partition("=")
        if key in wanted:
            skip = not eq
            continue
        out.append(a)
    return [*out, name, value]


def base_command(settings: Settings, vllm_script: str | None) -> list[str]:
    """The command that starts vLLM's API server for ``settings.model``, without gateway-set flags.

    ``--vllm-command`` may name a whole command (``{model}`` is substituted; a trailing ``serve``
    takes the model positionally, anything else gets ``--model``) or just another environment's python.
    """
    model = settings.model or ""
    if settings.vllm_command:
        parts = shlex.split(settings.vllm_command)
        if any("{model}" in p for p in parts):
            return [p.replace("{model}", model) for p in parts]
        if len(parts) == 1 and _PYTHON.search(Path(parts[0]).name):
            return [parts[0], "-m", API_SERVER_MODULE, "--model", model]
        if parts and parts[-1] == "serve":
            return [*parts, model]
        return [*parts, "--model", model]
    if vllm_script is not None:
        return [vllm_script, "serve", model]
    return [sys.executable, "-m", API_SERVER_MODULE, "--model", model]



def engine_args(settings: Settings, overrides: Mapping[str, str], port: int) -> list[str]:
    """vLLM's arguments after the model: the user's, what the gateway's settings imply, the auto-fit
    overrides, and the private address the gateway reaches it at."""
    s = settings
    args = list(s.vllm_args)
    if s.served_model_name and arg_value(args, "--served-model-name") is None:
        args += ["--served-model-name", s.served_model_name]
    if s.upstream_api_key and arg_value(args, "--api-key") is None:
        args += ["--api-key", s.upstream_api_key]
    if s.max_model_len and arg_value(args, "--max-model-len") is None:
        # The gateway never lets longer requests through, so vLLM need not reserve for them.
        args += ["--max-model-len", str(s.max_model_len)]
    for name, value in overrides.items():
        args = with_arg(args, name, value)
    args = with_arg(args, "--host", "127.0.0.1")
    return with_arg(args, "--port", str(port))


def redact(command: Sequence[str]) -> list[str]:
    """The command with its API key hidden, for logs and /guard/status."""
    out = list(command)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out


# -- start-up auto-fit ----------------------------------------------------------------------------
@dataclass(frozen=True)
class FitStep:
    changes: dict[str, str]
    reason: str


def plan_autofit(
    failure: StartupFailure | None, args: Sequence[str], device: str | None, holders: Sequence[str] = ()
) -> FitStep | str:
    """The next start-up attempt for a failed one, or the reason to give up (a str)."""
    if failure is None:
        return "it printed no start-up failure the gateway knows how to fix (see the log above)"
    what = describe_failure(failure)
    if isinstance(failure, MaxSeqLenTooLarge):
        block = int(arg_value(args, "--block-size") or default_block_size(device))
        limit = failure.estimated_max_len if failure.estimated_max_len is not None else failure.kv_tokens
        current = int(arg_value(args, "--max-model-len") or failure.max_seq_len)
        fitted = (limit // block) * block if limit is not None else 0
        if fitted <= 0 or fitted >= current:
            return f"{what}; no shorter max_model_len in whole blocks of {block} tokens fits"
        source = "vLLM's estimate" if failure.estimated_max_len is not None else "the KV cache"
        return FitStep(
            {"--max-model-len": str(fitted)},
            f"{what}: max_model_len {current} -> {fitted} ({source} {limit} rounded down to blocks of {block})",
        )
    if isinstance(failure, NoCacheMemory):
        if arg_value(args, "--kv-cache-memory-bytes") is not None:
            return f"{what}, and --kv-cache-memory-bytes fixes the KV cache size; lower it or the model size"
        util = float(arg_value(args, "--gpu-memory-utilization") or DEFAULT_GPU_UTILIZATION)
        if util >= MAX_GPU_UTILIZATION - 1e-9:
            return (
                f"{what}, even at gpu_memory_utilization {util:g} (the most the gateway sets is "
                f"{MAX_GPU_UTILIZATION:g}); use a smaller model, quantization, or more tensor parallelism"
            )
        new = min(MAX_GPU_UTILIZATION, round(util + GPU_UTILIZATION_STEP, 2))
        return FitStep({"--gpu-memory-utilization": f"{new:g}"}, f"{what}: gpu_memory_utilization {util:g} -> {new:g}")
    if isinstance(failure, InsufficientFreeMemory):
        held = "; ".join(holders) if holders else "no process list available"
        return f"{what}. Processes holding GPU memory: {held}. Stop them or lower --gpu-memory-utilization"
    assert isinstance(failure, CudaOutOfMemory)
    return f"{what} while starting; lower --max-model-len, --max-num-seqs or --gpu-memory-utilization"



_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN)\s*$", re.MULTILINE)


def parse_progress(text: str) -> tuple[float | None, float | None, float | None]:
    """(running requests, generated tokens, preemptions) summed over engines from vLLM's /metrics."""
    sums: dict[str, float] = {}
    for m in _METRIC.finditer(text):
        value = float(m[2])
        if not math.isnan(value):
            sums[m[1]] = sums.get(m[1], 0.0) + value
    return (
        sums.get("vllm:num_requests_running"),
        sums.get("vllm:generation_tokens_total"),
        sums.get("vllm:num_preemptions_total"),
    )



# -- the watchdog's decisions, free of I/O so they can be tested with made-up times -----------------
@dataclass(frozen=True)
class Trouble:
    reason: str  # exit | oom | hang | memory_growth | preemption_storm
    detail: str


class Watchdog:
    """Decides when a serving engine must be restarted, from observations stamped by the caller."""

    def __init__(
        self, now: float, *, hang_timeout: float, growth_mib: float, storm: int, storm_window: float = STORM_WINDOW
    ) -> None:
        self.hang_timeout = hang_timeout
        self.growth_mib = growth_mib
        self.storm = storm
        self.storm_window = storm_window
        self._last_alive = now
        self._last_progress = now
        self._tokens: float | None = None
        self._was_running = False
        self._preemptions: deque[tuple[float, float]] = deque()
        self.baseline_mib: float | None = None

    def observe_health(self, now: float, ok: bool) -> Trouble | None:
        if ok:
            self._last_alive = now
            return None
        silent = now - self._last_alive
        if silent >= self.hang_timeout:
            return Trouble(
                "hang", f"/health failed or did not answer for {silent:.1f} s (limit {self.hang_timeout:g} s)"
            )
        return None

    def observe_engine(
        self, now: float, running: float | None, tokens: float | None, preemptions: float | None
    ) -> Trouble | None:
        if running is not None and tokens is not None:
            # /health stays 200 in a hung engine: only generated tokens prove progress.
            # A stall counts from the first observation with work, since it may have just arrived.
            stalled = running > 0 and self._was_running and tokens == self._tokens
            self._was_running = running > 0
            if not stalled:
                self._last_progress = now
                self._tokens = tokens
            elif now - self._last_progress >= self.hang_timeout:
                return Trouble(
                    "hang",
                    f"{running:g} requests running but vllm:generation_tokens_total stayed at {tokens:g} for "
                    f"{now - self._last_progress:.1f} s (limit {self.hang_timeout:g} s)",
                )
        if preemptions is not None and self.storm > 0:
            q = self._preemptions
            if q and preemptions < q[-1][1]:
                q.clear()  # a new engine restarted its counter
            q.append((now, preemptions))
            while len(q) > 1 and q[1][0] <= now - self.storm_window:
                q.popleft()
            burst = preemptions - q[0][1]
            if burst >= self.storm:
                return Trouble(
                    "preemption_storm",
                    f"{burst:g} preemptions within {self.storm_window:g} s (limit {self.storm})",
                )
        return None

    def observe_memory(self, mib: float | None) -> Trouble | None:
        if mib is None or self.growth_mib <= 0:
            return None
        if self.baseline_mib is None:
            self.baseline_mib = mib
            return None
        growth = mib - self.baseline_mib
        if growth >= self.growth_mib:
            return Trouble(
                "memory_growth",
                f"GPU memory grew {growth:.0f} MiB past its post-start {self.baseline_mib:.0f} MiB "
                f"(limit {self.growth_mib:g} MiB)",
            )
        return None
