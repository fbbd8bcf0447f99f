"""Data parallelism in the vLLM simulator: one API server in front of ``data_parallel_size`` engine cores, each
request placed on one of them as vLLM 0.32 places it.

- Every engine (a ``Simulator`` with its ``rank``) has its own pool of ``num_blocks`` KV blocks, prefix cache,
  scheduler and running/waiting queues. All publish on one registry, every series labelled ``engine="<rank>"``
  and ``vllm:cache_config_info`` once per engine (``PrometheusStatLogger`` in ``v1/metrics/loggers.py``).
- ``X-data-parallel-rank: r`` pins a request to rank r (``_get_data_parallel_rank`` in
  ``entrypoints/generate/base/serving.py``): a value ``int()`` cannot read counts as no header, and a rank
  outside ``[0, size)`` is refused by the input processor (``requested_rank``). Only the chat and completions
  routes read the header; ``/v1/responses`` is always balanced.
- Otherwise every engine request goes to the least loaded engine, as ``DPLBAsyncMPClient``'s
  ``get_core_engine_for_request`` chooses (``v1/engine/core_client.py``, ``load_score``); the ``n`` choices of
  a request are ``n`` engine requests there (AsyncLLM fans them out), so each is placed on its own. vLLM reads
  waiting/running from a coordinator snapshot up to 100 ms old and floors them with its own in-flight count;
  the simulator's counts are exact, so both are one figure here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import generate_latest

from .engine import RequestLog, Simulator
from .metrics import SimMetrics
from .types import Sequence, SimConfig

RANK_HEADER = "X-data-parallel-rank"
# vLLM's waiting penalty: from 0 at half the KV cache used to 3 x waiting at all of it.
WAITING_PENALTY = 6.0
WAITING_PENALTY_FROM_USAGE = 0.5


class RankOutOfRange(ValueError):
    """vLLM's ``VLLMValidationError`` for a rank the server does not have: 400 ``BadRequestError``, no param."""


def requested_rank(header: str | None, size: int) -> int | None:
    """The rank an ``X-data-parallel-rank`` header asks for; None when it is absent or not an integer."""
    if header is None:
        return None
    try:
        rank = int(header)
    except ValueError:
        return None
    if not 0 <= rank < size:
        raise RankOutOfRange(f"data_parallel_rank {rank} is out of range [0, {size}).")
    return rank


def load_score(waiting: int, running: int, kv_usage: float) -> float:
    """How loaded an engine looks to vLLM's balancer: its requests, and waiting ones weighed more the fuller its
    KV cache is (a queue on a KV-bound engine drains slowly)."""
    score = float(waiting + running)
    if waiting:
        score += waiting * WAITING_PENALTY * max(0.0, kv_usage - WAITING_PENALTY_FROM_USAGE)
    return score


class DataParallelSimulator(RequestLog):
    """The engines of one data-parallel vLLM server (``ranks``), and the server-wide counters tests assert on."""

    def __init__(self, config: SimConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config)
        metrics = None if config.disable_log_stats else SimMetrics(config)
        self._registry = None if metrics is None else metrics.registry
        self.ranks = [Simulator(config, clock=clock, rank=rank, metrics=metrics)
                      for rank in range(config.data_parallel_size)]
        # vLLM's eng_start_index: where the next balanced choice starts its scan.
        self.scan_start = 0
        self.cancelled = 0
        self.frozen_page: bytes | None = None

    # -- server-wide figures --------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def capacity_tokens(self) -> int:
        """One engine's KV cache in tokens: what one request can at most hold."""
        return self.ranks[0].capacity_tokens

    @property
    def running(self) -> int:
        return sum(engine.running for engine in self.ranks)

    @property
    def waiting(self) -> int:
        return sum(engine.waiting for engine in self.ranks)

    @property
    def preemptions_total(self) -> int:
        return sum(engine.preemptions_total for engine in self.ranks)

    @property
    def peak_used_blocks(self) -> int:
        """The most blocks any one engine held at once."""
        return max(engine.peak_used_blocks for engine in self.ranks)

    @property
    def prefix_cache_hits_total(self) -> int:
        return sum(engine.prefix_cache_hits_total for engine in self.ranks)

    @property
    def paused(self) -> bool:
        return all(engine.paused for engine in self.ranks)

    @paused.setter
    def paused(self, value: bool) -> None:
        for engine in self.ranks:
            engine.paused = value

    # -- placement ------------------------------------------------------------------------------------

    def balance(self) -> int:
        """The rank vLLM's balancer picks for an engine request without a rank: the lowest score, ties to the
        first from the scan start, which moves one rank on after every choice."""
        best, least = 0, float("inf")
        for offset in range(self.size):
            index = (self.scan_start + offset) % self.size
            engine = self.ranks[index]
            score = load_score(engine.waiting, engine.running, engine.kv_cache_usage)
            if score < least:
                best, least = index, score
        self.scan_start = (self.scan_start + 1) % self.size
        return best

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
        """``Simulator.submit`` for the server: each of the ``n`` choices on ``rank``, or where the balancer puts
        it, with its own ``target`` when one is given per choice. A prompt given as a number of tokens is made up
        anew for each choice."""
        seqs: list[Sequence] = []
        for i in range(n):
            engine = self.ranks[self.balance() if rank is None else rank]
            choice_target = target[i] if isinstance(target, list) else target
            seqs += engine.submit(prompt, 1, max_tokens, choice_target, on_token, first_index=first_index + i,
                                  lora=lora, cache_salt=cache_salt)
        return seqs

    def abort(self, seqs: list[Sequence]) -> None:
        """The client went away: each engine stops its sequences of the request."""
        before = sum(engine.cancelled for engine in self.ranks)
        for engine in self.ranks:
            engine.abort([seq for seq in seqs if seq.rank == engine.rank])
        if sum(engine.cancelled for engine in self.ranks) > before:
            self.cancelled += 1

    def step(self) -> int:
        """One step of every engine; returns the tokens they prefilled together."""
        return sum(engine.step() for engine in self.ranks)

    # -- metrics and the loop -------------------------------------------------------------------------

    def metrics_text(self) -> bytes:
        if self.frozen_page is not None:
            return self.frozen_page
        if self._registry is None:
            return b""
        for engine in self.ranks:
            engine.publish()
        return generate_latest(self._registry)

    def freeze(self) -> None:
        """Frozen engine cores: nothing steps, and the metrics keep their last values."""
        self.frozen_page = self.metrics_text()
        for engine in self.ranks:
            engine.freeze()

    def thaw(self) -> None:
        self.frozen_page = None
        for engine in self.ranks:
            engine.thaw()

    def resume(self) -> None:
        for engine in self.ranks:
            engine.resume()

    async def aclose(self) -> None:
        for engine in self.ranks:
            await engine.aclose()


__all__ = ["RANK_HEADER", "DataParallelSimulator", "RankOutOfRange", "load_score", "requested_rank"]
