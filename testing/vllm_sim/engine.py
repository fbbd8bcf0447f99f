"""The engine half of the vLLM simulator: a V1-style scheduler over paged KV blocks with prefix caching.

The model it follows is vLLM 0.32's V1 scheduler and KV cache manager (``v1/core/sched/scheduler.py``,
``v1/core/kv_cache_manager.py``). Blocks are blocks.py's, metrics metrics.py's, and the
configuration and sequences types.py's.
- A step computes the KV of every token a sequence has (prompt + generated so far) and samples one more,
  so a scheduled sequence holds ``ceil((prompt + generated) / block_size)`` blocks. They are allocated as
  the step is scheduled, and the blocks those tokens fill are cached (findable) right then.
- A waiting sequence first looks up its longest cached prefix, at most all its tokens but the last (vLLM
  always computes the last one), takes those blocks and allocates the rest. It is admitted (FIFO) when
  those blocks are free and fewer than ``max_num_seqs`` run; nothing is admitted in a step that preempted.
- The ``n`` choices of a request are ``n`` sequences of one prompt: the first caches the prompt's full
  blocks as it is scheduled and the others hit them in the same step, so they hold those blocks once.
- When a decode step needs a block and none is free, the most recently started running sequence is
  preempted by recompute: its blocks are freed (still cached), its generated tokens kept, and it goes back
  to the front of the waiting queue, counted in ``vllm:num_preemptions_total``. Resumed, it hits its own
  blocks unless they were evicted meanwhile.
- ``SimConfig.watermark`` (vLLM's ``--watermark``): a waiting or preempted sequence is admitted beside running
  ones only when its blocks leave ``watermark x num_blocks`` blocks free.
- A request generates ``output_length`` tokens: ``max_tokens``, or fewer where EOS comes first
  (``SimConfig.stop_early``, the request's ``min_tokens`` and ``logit_bias`` on EOS, as vLLM's sampler).
- Generated tokens get ids no prompt has, unique to their sequence: only that sequence can hit them.
- With ``prefix_caching`` off nothing is looked up or cached, so nothing is shared, siblings included.

With no delays and enough free blocks a request completes synchronously (no scheduler round trip), so a
benchmark measures the gateway, not the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import generate_latest

from .blocks import KvCache
from .metrics import EngineMetrics, SimMetrics
from .types import Fault, Prompt, Sequence, SimConfig

VLLM_VERSION = "0.32.0"
REQUESTS_SEEN_LIMIT = 1000
# A logit bias on EOS at least this large (vLLM clamps biases to +-100) decides every draw of the tiny models.
EOS_WINS = 10.0
# What the tiny random-weight model (gateway/tools/tinymodel.py) draws at each token, sampled at temperature 1 on
# vLLM's CPU build, as fitted to the lengths of 100-400 chat answers at EOS biases of -100, -1, 0, 1, 2 and 4
# (0: a geometric mean of 257 tokens): its EOS, and its other stop token (<|im_end|>), each a token's chance.
# A bias b on EOS makes EOS ``TINY_EOS_P x e^b`` of the draw's softmax before the renormalisation.
TINY_EOS_P = 0.0022
TINY_OTHER_STOP_P = 0.0018


def stop_chance(eos_bias: float) -> float:
    """The chance that one draw of the tiny model at temperature 1 ends the answer, EOS biased by ``eos_bias``."""
    eos = TINY_EOS_P * math.exp(min(100.0, max(-100.0, eos_bias)))
    return min(1.0, (eos + TINY_OTHER_STOP_P) / (1.0 - TINY_EOS_P + eos))


class RequestLog:
    """What the API server saw, for tests (request bodies, their X-data-parallel-rank headers), and each
    request's output length (``SimConfig.stop_early``)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.requests_seen: deque[dict[str, Any]] = deque(maxlen=REQUESTS_SEEN_LIMIT)
        self.rank_headers_seen: deque[str | None] = deque(maxlen=REQUESTS_SEEN_LIMIT)
        self.request_count = 0

    def record_request(self, body: dict[str, Any], rank_header: str | None = None) -> int:
        """Remember a request body and its rank header (None where it had none); returns its index (the
        ``stop_early`` argument)."""
        self.requests_seen.append(body)
        self.rank_headers_seen.append(rank_header)
        index = self.request_count
        self.request_count += 1
        return index

    def output_length(self, request_index: int, max_tokens: int, ignore_eos: bool, min_tokens: int = 0,
                      eos_bias: float = 0.0, choice: int = 0) -> int:
        """How many tokens a request's ``choice`` generates, its EOS (if any) being the last of them.

        The model would draw EOS as token ``SimConfig.stop_early(index, max_tokens)`` (never, without it), or
        ``SimConfig.stop_early_choice(index, choice, max_tokens)`` where each choice draws its own.
        As in vLLM's sampler, ``ignore_eos`` never stops, EOS is masked for the first ``min_tokens`` tokens,
        and a ``logit_bias`` on EOS of at least ``EOS_WINS`` makes it the first draw it is allowed in (a
        random-weight model's logits are small: ``min_tokens: L - 1`` with +100 gives L tokens), one of at most
        -``EOS_WINS`` the last it is never drawn. A bias in between makes each draw past ``min_tokens`` end the
        answer with the tiny model's ``stop_chance``, the same draws for the same request and choice: lengths
        geometric as the real model's at temperature 1 (the realistic benchmark's answers end so, unread by
        the gateway).
        """
        if ignore_eos or eos_bias <= -EOS_WINS:
            return max_tokens
        if eos_bias >= EOS_WINS:
            return min(max_tokens, min_tokens + 1)
        if eos_bias:
            chance = stop_chance(eos_bias)
            drawn = random.Random(f"{request_index}:{choice}").random()
            # The first of the geometric draws that ends it: ceil(log(1 - u) / log(1 - p)).
            after = 1 if chance >= 1.0 else max(1, math.ceil(math.log1p(-drawn) / math.log1p(-chance)))
            return min(max_tokens, min_tokens + after)
        stop_early, per_choice = self.config.stop_early, self.config.stop_early_choice
        if per_choice is not None:
            drawn = per_choice(request_index, choice, max_tokens)
        elif stop_early is not None:
            drawn = stop_early(request_index, max_tokens)
        else:
            return max_tokens
        return max(1, min(max_tokens, drawn if drawn > min_tokens else min_tokens + 1))


class Simulator(RequestLog):
    """The engine: sequences, KV blocks, the scheduler loop and the counters tests assert on.

    With data parallelism (dp.py) it is one engine core, ``rank``, publishing its series on the
    server's shared ``metrics``.
    """

    def __init__(self, config: SimConfig, *, clock: Callable[[], float] = time.monotonic, rank: int = 0,
                 metrics: SimMetrics | None = None) -> None:
        super().__init__(config)
        self.clock = clock
        self.rank = rank
        self.kv = KvCache(config.num_blocks, config.block_size, config.prefix_caching)
        self.preemptions_total = 0
        self.cancelled = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # vllm:prefix_cache_queries_total and _hits_total: tokens looked up and found at first schedulings.
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        # While paused the loop does not step; tests drive the engine with step().
        self.paused = False
        # While frozen (freeze()), /metrics repeats this page, as a SIGSTOPped vLLM engine core's API server does.
        self.frozen_page: bytes | None = None
        self._running: list[Sequence] = []
        self._waiting: deque[Sequence] = deque()
        if metrics is None and not config.disable_log_stats:
            metrics = SimMetrics(config)
        self._registry = None if metrics is None else metrics.registry
        self._metrics: EngineMetrics | None = None if metrics is None else metrics.engines[rank]
        # Token ids the simulator makes up are negative, so no tokenizer's id equals one of them.
        self._next_made_up_id = -1
        self._finished = 0
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
    def used_blocks(self) -> int:
        """Blocks some sequence holds (a block shared by several counts once)."""
        return self.kv.pool.used

    @property
    def peak_used_blocks(self) -> int:
        return self.kv.peak_used

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included."""
        return self.kv.pool.free

    @property
    def cached_blocks(self) -> int:
        """Blocks a lookup can find, held or free."""
        return self.kv.pool.cached_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.used_blocks / self.config.num_blocks

    def metrics_text(self) -> bytes:
        if self.frozen_page is not None:
            return self.frozen_page
        if self._registry is None:
            return b""
        self.publish()
        return generate_latest(self._registry)

    def publish(self) -> None:
        """Set this engine's gauges to its present state (vLLM's scheduler stats of its latest step)."""
        if self._metrics is not None:
            self._metrics.running.set(self.running)
            self._metrics.waiting.set(self.waiting)
            self._metrics.kv_usage.set(self.kv_cache_usage)

    # -- submission ------------------------------------------------------------------------------------

    def submit(
        self,
        prompt: int | list[int],
        n: int,
        max_tokens: int,
        target: int | list[int],
        on_token: Callable[[Sequence], None],
        *,
        first_index: int = 0,
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
        rank: int | None = None,
    ) -> list[Sequence]:
        """Queue the ``n`` sequences of one prompt; ``on_token`` runs after each token and at the end.

        ``prompt`` is its token ids, or a number of tokens: ids no other prompt has; ``target``: the tokens each
        sequence generates (one for all, or one per sequence). ``lora`` is the adapter
        (name, path) and ``cache_salt`` the request's salt; both key the prompt's blocks apart. ``rank``: the
        data-parallel rank the request asked for, which can only be this engine's. When nothing needs time and
        the blocks suffice, every sequence completes before this returns.
        """
        if rank is not None and rank != self.rank:
            raise ValueError(f"engine {self.rank} was asked to run a request of rank {rank}")
        now = self.clock()
        ids = self._made_up_ids(prompt) if isinstance(prompt, int) else list(prompt)
        # vLLM refuses to start with a cache smaller than one max_model_len request; the simulator accepts
        # such configs and stops a sequence (finish_reason "length") when it would outgrow the whole cache.
        wanted = target if isinstance(target, list) else [target] * n
        targets = [min(t, self.capacity_tokens - len(ids)) for t in wanted]
        if min(targets) < 1:
            raise ValueError(f"a prompt of {len(ids)} tokens does not fit into the KV cache "
                             f"({self.capacity_tokens} tokens)")
        shared = Prompt(ids, lora, cache_salt)
        seqs = [Sequence(first_index + i, shared, max_tokens, t, on_token, now,
                         self._made_up_ids(t)[0], rank=self.rank) for i, t in enumerate(targets)]
        if self.kv.caching:
            keys = self.kv.keys(seqs[0], len(ids) // self.config.block_size)
            for seq in seqs[1:]:
                seq.keys = list(keys)
        if self._can_finish_now(seqs):
            self._finish_now(seqs, now)
            return seqs
        self._waiting.extend(seqs)
        self._kick()
        return seqs

    def _made_up_ids(self, count: int) -> list[int]:
        start = self._next_made_up_id
        self._next_made_up_id -= count
        return list(range(start, start - count, -1))

    def _can_finish_now(self, seqs: list[Sequence]) -> bool:
        cfg = self.config
        if cfg.token_delay or cfg.prefill_delay_per_token or self.paused or self._waiting:
            return False
        if len(self._running) + len(seqs) > cfg.max_num_seqs:
            return False
        reserve = self.watermark_blocks if self._running or len(seqs) > 1 else 0
        return self.kv.most_to_finish(seqs) + reserve <= self.kv.pool.free

    def _finish_now(self, seqs: list[Sequence], now: float) -> None:
        # As the scheduler would: all admitted in one step (so siblings hit the first one's blocks), then
        # every step's blocks at once; the last generated token needs no slot.
        for seq in seqs:
            admitted = self._admit(seq)
            assert admitted is not None, "checked by _can_finish_now"
            self.kv.grow(seq, seq.prompt_tokens + seq.target - 1)
            self._count_prompt(seq)
        for seq in seqs:
            seq.first_token_at = now
            seq.generated = seq.target
            self._count_generated(seq.target)
            self._retire(seq, now)
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
                self._release(seq)
            else:
                self._waiting.remove(seq)
            if self._metrics is not None:
                self._metrics.success["abort"].inc()
        if stopped:
            self.cancelled += 1

    # -- blocks ---------------------------------------------------------------------------------------

    @property
    def watermark_blocks(self) -> int:
        """Blocks ``--watermark`` keeps free: a waiting sequence is admitted beside running ones only if its
        blocks leave that many free (``KVCacheManager.allocate_slots``)."""
        return int(self.config.watermark * self.config.num_blocks)

    def _admit(self, seq: Sequence, reserve: int = 0) -> int | None:
        found = self.kv.admit(seq, reserve)
        if found is None or not self.kv.caching or seq.preemptions:
            return found  # vLLM's counters skip disabled lookups and those of resumed sequences
        tokens = seq.prompt_tokens + seq.generated
        self.prefix_cache_queries_total += tokens
        self.prefix_cache_hits_total += found
        if self._metrics is not None:
            self._metrics.prefix_queries.inc(tokens)
            if found:
                self._metrics.prefix_hits.inc(found)
        return found

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq)
        seq.running = False

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self._release(seq)
        seq.preemptions += 1
        self._waiting.appendleft(seq)
        self.preemptions_total += 1
        if self._metrics is not None:
            self._metrics.preemptions.inc()

    def _retire(self, seq: Sequence, now: float) -> None:
        seq.finish_reason = self._finish_reason(seq)
        self._finished += 1
        seq.finish_order = self._finished
        self._release(seq)
        self._record_finish(seq, now)

    # -- scheduling -----------------------------------------------------------------------------------

    def step(self) -> int:
        """One engine step: schedule, then emit a token for every scheduled sequence.

        Returns the number of tokens prefilled in the step: those of admitted sequences (prompt, and the
        tokens generated before a preemption) less those found cached.
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
            tokens = seq.prompt_tokens + seq.generated
            while self.kv.growth(seq, tokens) > self.kv.pool.free:
                victim = self._running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if not seq.running:
                break
            self.kv.grow(seq, tokens)
            scheduled.append(seq)
        prefill = 0
        if not preempted:
            while self._waiting and len(self._running) < self.config.max_num_seqs:
                seq = self._waiting[0]
                found = self._admit(seq, self.watermark_blocks if self._running else 0)
                if found is None:
                    break
                self._waiting.popleft()
                seq.running = True
                self._running.append(seq)
                if seq.generated == 0:
                    self._count_prompt(seq)
                prefill += seq.prompt_tokens + seq.generated - found
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
                self._running.remove(seq)
                self._retire(seq, now)
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

    def freeze(self) -> None:
        """A frozen engine core: nothing steps, and the metrics keep their last values."""
        self.frozen_page = self.metrics_text()
        self.paused = True

    def thaw(self) -> None:
        """Step again; callable from any thread (tests run the simulator's server in a thread of its own)."""
        self.frozen_page = None
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.resume)
        else:
            self.resume()

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


__all__ = ["VLLM_VERSION", "Fault", "Prompt", "RequestLog", "Sequence", "SimConfig", "Simulator"]
