"""The vLLM simulator's vocabulary: its configuration, its faults, and the sequences its engine schedules."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal


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
    # --max-num-queued-reqs (vLLM 0.29+): unfinished requests beyond it are refused with vLLM's 503.
    max_num_queued_reqs: int | None = None
    stop_early: Callable[[int, int], int] | None = None
    # Where each choice of a request with n > 1 draws EOS, by (request index, choice index, max_tokens): vLLM
    # samples each choice on its own, so they end apart. None: every choice draws the request's ``stop_early``.
    stop_early_choice: Callable[[int, int, int], int] | None = None
    fault: Fault | None = None
    # What /metrics answers other than its page (500: an API server whose metrics fail); None: the page.
    metrics_status: int | None = None
    # Seconds /metrics takes to answer (an API server busy serving): a scrape that is not over at once.
    metrics_delay: float = 0.0
    fault_delay: float = 1.0
    fault_after_chunks: int = 2
    # vLLM refuses tool_choice "auto" unless started with --enable-auto-tool-choice --tool-call-parser.
    enable_auto_tool_choice: bool = False
    # vLLM V1 caches prefixes unless started with --no-enable-prefix-caching.
    prefix_caching: bool = True
    # --enable-prompt-tokens-details: responses carry usage.prompt_tokens_details (cached_tokens).
    enable_prompt_tokens_details: bool = False
    # --lora-modules name=path: adapter names a request may give as ``model``; their KV is keyed apart.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # --data-parallel-size: engine cores behind the one API server, each with num_blocks blocks of its own.
    data_parallel_size: int = 1
    # --watermark: fraction of the blocks kept free when admitting beside running requests (0: off).
    watermark: float = 0.0
    # --stream-interval: tokens per stream chunk at most (a request's own stream_interval may raise it).
    stream_interval: int = 1
    # The system_fingerprint vLLM's default --fingerprint-mode full writes ("vllm-0.32.0-..."); None: mode none.
    system_fingerprint: str | None = None


def lognormal_lengths(mean: float, sigma: float, seed: int = 0) -> Callable[[int, int], int]:
    """A ``SimConfig.stop_early``: request ``index`` draws EOS as token L, L lognormal with this mean and
    sigma (of the log), the same L for the same seed and index, so a run repeats."""
    mu = math.log(mean) - sigma * sigma / 2

    def length(index: int, max_tokens: int) -> int:
        return max(1, round(random.Random(f"{seed}:{index}").lognormvariate(mu, sigma)))

    return length


@dataclass(eq=False)
class Prompt:
    """The token ids of one prompt and what else keys its blocks; the ``n`` sequences of a request share it."""

    ids: list[int]
    lora: tuple[str, str] | None = None
    cache_salt: str | None = None


@dataclass(eq=False)
class Sequence:
    """One choice of one prompt of a request, as the engine schedules it."""

    index: int
    prompt: Prompt
    max_tokens: int
    target: int
    on_token: Callable[[Sequence], None]
    arrival: float
    # The id of its first generated token; the next ones count down from it.
    output_base: int
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    # Keys of its full blocks, computed as far as needed; ``blocks[:cached_blocks]`` are cached.
    keys: list[int] = field(default_factory=list)
    cached_blocks: int = 0
    running: bool = False
    finish_reason: str | None = None
    aborted: bool = False
    first_token_at: float | None = None
    preemptions: int = 0
    # vLLM's prefill stats of its first scheduling: prompt tokens found cached, and those it cached anew.
    cached_tokens: int | None = None
    created_cache_tokens: int | None = None
    # 1 for the first sequence the engine finished, 2 for the next, ...
    finish_order: int = 0
    # The data-parallel engine (rank) it runs on.
    rank: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.aborted
