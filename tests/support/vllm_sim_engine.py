"""The engine half of the vLLM simulator: a V1-style scheduler over paged KV blocks, with vLLM's metrics.

The model it follows is vLLM 0.32's V1 scheduler:
- a running sequence holds ``ceil((prompt + generated) / block_size)`` blocks; the ``n`` choices of one
  request share the full blocks of their common prompt (prefix caching), each holds its own tail;
- a waiting sequence is admitted (FIFO) when blocks for its prompt (+ tokens already generated, + 1) are
  free and fewer than ``max_num_seqs`` run; nothing is admitted in a step that preempted;
- when a decode step needs a block and none is free, the most recently started running sequence is
  preempted by recompute: its blocks are freed, its generated tokens kept, and it goes back to the front
  of the waiting queue, counted in ``vllm:num_preemptions_total``.

With no delays and enough free blocks a request completes synchronously (no scheduler round trip), so a
benchmark measures the gateway, not the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

VLLM_VERSION = "0.32.0"
REQUESTS_SEEN_LIMIT = 1000

# vLLM's own bucket bounds (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class Fault(Enum):
    """Misbehaviour of the generation endpoints (``/v1/chat/completions``, ``/v1/completions``).

    HANG: accept the request and never answer (until the client goes away).
    RESET: drop the TCP connection (RST) without a response.
    GARBAGE: 200 with a non-JSON body; a streaming request gets a broken SSE event.
    ERROR_500: 500 with vLLM's internal-error body.
    SLOW_FIRST_BYTE: answer normally after ``SimConfig.fault_delay`` seconds.
    DIE_MID_STREAM: stream ``SimConfig.fault_after_chunks`` chunks, then drop the connection
        (a non-streaming request is dropped like RESET).
    ENGINE_DEAD: what vLLM does once its engine core died: ``/health`` 503, generation 500.
    """

    HANG = "hang"
    RESET = "reset"
    GARBAGE = "garbage"
    ERROR_500 = "error_500"
    SLOW_FIRST_BYTE = "slow_first_byte"
    DIE_MID_STREAM = "die_mid_stream"
    ENGINE_DEAD = "engine_dead"


@dataclass
class SimConfig:
    model: str = "tiny"
    root: str | None = None
    max_model_len: int = 2048
    num_blocks: int = 32
    block_size: int = 16
    token_delay: float = 0.0
    prefill_delay_per_token: float = 0.0
    tokenizer: Any | None = None
    api_key: str | None = None
    error_style: Literal["nested", "flat"] = "nested"
    reject_prompt_plus_max_tokens: bool = False
    disable_log_stats: bool = False
    max_num_seqs: int = 256
    stop_early: Callable[[int, int], int] | None = None
    fault: Fault | None = None
    fault_delay: float = 1.0
    fault_after_chunks: int = 2
    # vLLM refuses tool_choice "auto" unless started with --enable-auto-tool-choice --tool-call-parser.
    enable_auto_tool_choice: bool = False


@dataclass(eq=False)
class _Group:
    """The sequences of one request: they share the full blocks of their common prompt."""

    shared_blocks: int
    holders: int = 0


@dataclass(eq=False)
class Sequence:
    """One choice of one prompt of a request, as the engine schedules it."""

    index: int
    prompt_tokens: int
    max_tokens: int
    target: int
    group: _Group | None
    on_token: Callable[[Sequence], None]
    arrival: float
    generated: int = 0
    own_blocks: int = 0
    running: bool = False
    finish_reason: str | None = None
    aborted: bool = False
    first_token_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.aborted


class _Metrics:
    """vLLM's ``vllm:`` series on a registry of the simulator's own."""

    def __init__(self, config: SimConfig) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = [config.model, "0"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in ("stop", "length", "abort")}
        token_buckets = _one_two_five_buckets(config.max_model_len)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                        token_buckets)
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        info = _cache_config_info(config)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=r).labels(**info).set(1)


def _one_two_five_buckets(limit: int) -> tuple[float, ...]:
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


def _cache_config_info(config: SimConfig) -> dict[str, str]:
    # The label set of vLLM 0.32's CacheConfig.metrics_info(), plus "engine".
    tokens = config.num_blocks * config.block_size
    return {
        "block_size": str(config.block_size), "user_specified_block_size": "True", "kv_cache_layout": "None",
        "prefix_match_unit": "None", "gpu_memory_utilization": "0.92", "cache_dtype": "auto",
        "is_attention_free": "False", "num_gpu_blocks_override": "None", "sliding_window": "None",
        "enable_prefix_caching": "True", "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None", "skip_page_size_padded": "None", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16",
        # num_blocks is what requests can hold; vLLM reports one more, the null block it keeps out of the pool.
        "use_replayssm": "False", "use_kda_recoverssm": "False", "num_gpu_blocks": str(config.num_blocks + 1),
        "num_cpu_blocks": "None", "effective_attention_block_size": "None",
        "kv_cache_size_tokens": str(tokens), "kv_cache_max_concurrency": str(round(tokens / config.max_model_len, 2)),
        "hash_block_size": "None", "cache_hit_alignment_tokens": "None", "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None", "kv_offloading_size": "None",
        "kv_offloading_backend": "native", "engine": "0",
    }


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Simulator:
    """The engine: sequences, KV blocks, the scheduler loop and the counters tests assert on."""

    def __init__(self, config: SimConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.preemptions_total = 0
        self.used_blocks = 0
        self.peak_used_blocks = 0
        self.cancelled = 0
        self.requests_seen: deque[dict[str, Any]] = deque(maxlen=REQUESTS_SEEN_LIMIT)
        self.request_count = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # While paused the loop does not step; tests drive the engine with step().
        self.paused = False
        self._running: list[Sequence] = []
        self._waiting: deque[Sequence] = deque()
        self._metrics = None if config.disable_log_stats else _Metrics(config)
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- state seen by tests and /metrics -------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def capacity_tokens(self) -> int:
        return self.config.num_blocks * self.config.block_size

    @property
    def free_blocks(self) -> int:
        return self.config.num_blocks - self.used_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.used_blocks / self.config.num_blocks

    def metrics_text(self) -> bytes:
        if self._metrics is None:
            return b""
        m = self._metrics
        m.running.set(self.running)
        m.waiting.set(self.waiting)
        m.kv_usage.set(self.kv_cache_usage)
        return generate_latest(m.registry)

    def record_request(self, body: dict[str, Any]) -> int:
        """Remember a request body for tests; returns its index (the ``stop_early`` argument)."""
        self.requests_seen.append(body)
        index = self.request_count
        self.request_count += 1
        return index

    def output_length(self, request_index: int, max_tokens: int, ignore_eos: bool) -> int:
        stop_early = self.config.stop_early
        if stop_early is None or ignore_eos:
            return max_tokens
        return max(1, min(max_tokens, stop_early(request_index, max_tokens)))

    # -- submission ------------------------------------------------------------------------------------

    def submit(
        self,
        prompt_tokens: int,
        n: int,
        max_tokens: int,
        target: int,
        on_token: Callable[[Sequence], None],
        *,
        first_index: int = 0,
    ) -> list[Sequence]:
        """Queue the ``n`` sequences of one prompt; ``on_token`` runs after each token and at the end.

        When nothing needs time and the blocks suffice, every sequence completes before this returns.
        """
        now = self.clock()
        bs = self.config.block_size
        # vLLM refuses to start with a cache smaller than one max_model_len request; the simulator accepts
        # such configs and stops a sequence (finish_reason "length") when it would outgrow the whole cache.
        target = min(target, self.capacity_tokens - prompt_tokens)
        if target < 1:
            raise ValueError(f"a prompt of {prompt_tokens} tokens does not fit into the KV cache "
                             f"({self.capacity_tokens} tokens)")
        group = _Group(prompt_tokens // bs) if n > 1 and prompt_tokens >= bs else None
        seqs = [Sequence(first_index + i, prompt_tokens, max_tokens, target, group, on_token, now)
                for i in range(n)]
        if self._can_finish_now(seqs):
            self._finish_now(seqs, now)
            return seqs
        self._waiting.extend(seqs)
        self._kick()
        return seqs

    def _can_finish_now(self, seqs: list[Sequence]) -> bool:
        cfg = self.config
        if cfg.token_delay or cfg.prefill_delay_per_token or self.paused or self._waiting:
            return False
        if len(self._running) + len(seqs) > cfg.max_num_seqs:
            return False
        return self._full_need(seqs) <= self.free_blocks

    def _full_need(self, seqs: list[Sequence]) -> int:
        first = seqs[0]
        shared = first.group.shared_blocks if first.group else 0
        per_seq = _ceil_div(first.prompt_tokens + first.target, self.config.block_size) - shared
        return shared + per_seq * len(seqs)

    def _finish_now(self, seqs: list[Sequence], now: float) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.used_blocks + self._full_need(seqs))
        for seq in seqs:
            self._count_prompt(seq)
            seq.first_token_at = now
            seq.generated = seq.target
            self._count_generated(seq.target)
            seq.finish_reason = self._finish_reason(seq)
            self._record_finish(seq, now)
            seq.on_token(seq)

    def _finish_reason(self, seq: Sequence) -> str:
        stopped_by_eos = seq.generated < seq.max_tokens and seq.prompt_tokens + seq.generated < self.capacity_tokens
        return "stop" if stopped_by_eos else "length"

    def abort(self, seqs: list[Sequence]) -> None:
        """The client went away: stop these sequences and free their blocks."""
        stopped = False
        for seq in seqs:
            if seq.done:
                continue
            seq.aborted = True
            stopped = True
            if seq.running:
                self._running.remove(seq)
                self._free(seq)
            else:
                self._waiting.remove(seq)
            if self._metrics is not None:
                self._metrics.success["abort"].inc()
        if stopped:
            self.cancelled += 1

    # -- blocks ---------------------------------------------------------------------------------------

    def _blocks_to_hold(self, seq: Sequence, tokens: int) -> int:
        shared = seq.group.shared_blocks if seq.group else 0
        return _ceil_div(tokens, self.config.block_size) - shared

    def _admission_need(self, seq: Sequence) -> int:
        own = self._blocks_to_hold(seq, seq.prompt_tokens + seq.generated + 1)
        group = seq.group
        return own + (group.shared_blocks if group is not None and group.holders == 0 else 0)

    def _allocate(self, blocks: int) -> None:
        self.used_blocks += blocks
        self.peak_used_blocks = max(self.peak_used_blocks, self.used_blocks)

    def _free(self, seq: Sequence) -> None:
        self.used_blocks -= seq.own_blocks
        seq.own_blocks = 0
        seq.running = False
        group = seq.group
        if group is not None:
            group.holders -= 1
            if group.holders == 0:
                self.used_blocks -= group.shared_blocks

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self._free(seq)
        self._waiting.appendleft(seq)
        self.preemptions_total += 1
        if self._metrics is not None:
            self._metrics.preemptions.inc()

    # -- scheduling -----------------------------------------------------------------------------------

    def step(self) -> int:
        """One engine step: schedule, then emit a token for every scheduled sequence.

        Returns the number of prompt tokens prefilled in the step.
        """
        scheduled, prefill = self._schedule()
        self._emit(scheduled)
        return prefill

    def _schedule(self) -> tuple[list[Sequence], int]:
        scheduled: list[Sequence] = []
        preempted = False
        for seq in list(self._running):
            if not seq.running:
                continue  # preempted earlier in this step
            grow = self._blocks_to_hold(seq, seq.prompt_tokens + seq.generated + 1) - seq.own_blocks
            while grow > self.free_blocks:
                victim = self._running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if not seq.running:
                break
            if grow > 0:
                self._allocate(grow)
                seq.own_blocks += grow
            scheduled.append(seq)
        prefill = 0
        if not preempted:
            while self._waiting and len(self._running) < self.config.max_num_seqs:
                seq = self._waiting[0]
                need = self._admission_need(seq)
                if need > self.free_blocks:
                    break
                self._waiting.popleft()
                self._allocate(need)
                seq.own_blocks = self._blocks_to_hold(seq, seq.prompt_tokens + seq.generated + 1)
                if seq.group is not None:
                    seq.group.holders += 1
                seq.running = True
                self._running.append(seq)
                if seq.generated == 0:
                    self._count_prompt(seq)
                prefill += seq.prompt_tokens + seq.generated
                scheduled.append(seq)
        return scheduled, prefill

    def _emit(self, scheduled: list[Sequence]) -> None:
        now = self.clock()
        emitted = 0
        for seq in scheduled:
            if not seq.running:
                continue  # aborted while the step ran
            seq.generated += 1
            emitted += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
            if seq.generated >= seq.target:
                seq.finish_reason = self._finish_reason(seq)
                self._running.remove(seq)
                self._free(seq)
                self._record_finish(seq, now)
            seq.on_token(seq)
        self._count_generated(emitted)

    def _count_prompt(self, seq: Sequence) -> None:
        self.prompt_tokens_total += seq.prompt_tokens
        if self._metrics is not None:
            self._metrics.prompt_tokens.inc(seq.prompt_tokens)

    def _count_generated(self, tokens: int) -> None:
        self.generation_tokens_total += tokens
        if self._metrics is not None and tokens:
            self._metrics.generation_tokens.inc(tokens)

    def _record_finish(self, seq: Sequence, now: float) -> None:
        m = self._metrics
        if m is None or seq.finish_reason is None:
            return
        m.success[seq.finish_reason].inc()
        m.request_prompt.observe(seq.prompt_tokens)
        m.request_generation.observe(seq.generated)
        m.ttft.observe((seq.first_token_at or now) - seq.arrival)
        m.e2e.observe(now - seq.arrival)

    # -- the loop -------------------------------------------------------------------------------------

    def _kick(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # driven without a loop: the caller steps the engine itself
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        assert self._wake is not None
        self._wake.set()

    def resume(self) -> None:
        """Let the scheduler loop step again after ``paused`` was set."""
        self.paused = False
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        wake = self._wake
        assert wake is not None
        cfg = self.config
        while True:
            if self.paused or not (self._running or self._waiting):
                wake.clear()
                await wake.wait()
                continue
            scheduled, prefill = self._schedule()
            # The step's compute time passes before its tokens exist; sleep(0) still yields to I/O.
            await asyncio.sleep(cfg.token_delay + cfg.prefill_delay_per_token * prefill)
            self._emit(scheduled)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


__all__ = ["VLLM_VERSION", "Fault", "Sequence", "SimConfig", "Simulator"]
