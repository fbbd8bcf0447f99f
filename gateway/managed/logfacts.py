"""vLLM's log lines read as facts: capacity, start-up failures, engine deaths, and each line's log level.

Free of I/O so that every rule can be table-tested: the supervisor feeds each line the managed engine prints and
reads back its KV capacity (the log is the only place some versions state it) and the reason a start-up failed,
so that auto-fit acts on vLLM's own numbers. Texts follow vLLM 0.7 .. 0.33 (V0 and V1) and PyTorch's CUDA
out-of-memory message; older spellings stay as fallbacks because the user picks the vLLM version.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from gateway.engine.vllm_api.defaults import default_block_size

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
