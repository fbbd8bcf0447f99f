"""Admission: admit, queue or shed each request against the engine's KV budget.

The model
---------
A request's *need* is the most KV blocks it can make the engine allocate:
``n x ceil((prompt_tokens + max_tokens) / block_size)`` (see ``capacity.request_need``). The *budget* is
``B = floor(kv_target x capacity_blocks)``. The *ledger* sums the needs of the requests in flight
(``committed``).

``strict``
    Admit while ``committed + need <= B``. Every reservation is an upper bound, so the engine can never
    run short of blocks for the gateway's requests: no preemption, even if every request runs to its
    ``max_tokens``. The price: requests that stop early hold blocks they never use.

``adaptive`` (default)
    Admit whenever strict would. Besides, while the engine's metrics are fresh, admit while
    ``projected + growth(new) <= B``, where ``projected`` is the smaller of two bounds on where the in-flight
    requests end up: ``live_used + sum over in-flight r of growth(r)`` (what each adds on top of what the
    engine holds now), and ``max(live_used, sum over in-flight r of final(r))`` (their expected final sizes
    together; ``final`` is ``growth`` without credit). The second keeps a request whose progress is unknown
    (not streamed, not yet started) from being counted twice, once in live usage and once whole:

    - ``live_used`` = ``kv_cache_usage_perc x capacity``: what the engine holds now, prefix sharing included;
    - ``credited(r)``: the blocks ``r`` surely held when that usage was measured, known from its streamed
      progress (prompt blocks of each sequence plus the tokens generated). Only a request seen making
      progress shortly before the measurement is credited: one not yet scheduled, or preempted, is not in
      ``live_used`` and gets no credit;
    - ``worst(r) = need(r) - credited(r)``; ``expected(r) = need of r with max_tokens lowered to
      min(max_tokens, max(L, 2 x generated so far)) - credited(r)``, where ``L`` is the longest output per
      sequence among the last 64 requests that completed (once 8 have);
    - ``growth(r) = worst(r) - o x (worst(r) - expected(r))``, with the optimism ``o`` in [0, 1].

    ``o`` starts at 1, is halved on every snapshot that shows new preemptions (to 0 below 1/16) and
    regains 0.02 per second of snapshots without. At ``o = 0`` the projection is the ledger corrected by
    live usage: it admits past the ledger only as far as the engine really shares blocks. Stale or absent
    metrics (``--disable-log-stats``, failed scrapes) switch the live path off: only the ledger admits.

Both policies honour ``--max-concurrency``. Without a known capacity only the concurrency limit and the
queue apply.

The queue
---------
Bounded by ``--max-queue`` (0: no queue, shed at once with 429); each request waits at most
``--queue-timeout`` (then 503). Higher priority first, FIFO within a priority. When the head cannot be
admitted, a smaller request behind it that fits may pass it, at most ``--starvation-bound`` times; then
the head is served first. The queue is re-examined on every release, on each new engine snapshot, and on
resume. ``Retry-After`` is the queue position divided by the releases per second seen over the last minute,
bounded to 1..60 s.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from gateway import errors
from gateway.admission.ledger import (
    DEFAULT_BLOCK_SIZE,
    Capacity,
    Ledger,
    blocks_in_use_at_least,
    capacity_from,
    request_need,
)
from gateway.config import Settings
from gateway.engine.live import EngineSnapshot, EngineView, counter_increase
from gateway.metrics import Metrics

log = logging.getLogger(__name__)

OUTPUT_WINDOW = 64  # completed requests remembered for the output-length estimate
MIN_OUTPUT_SAMPLES = 8  # fewer than this: no estimate, the adaptive projection stays at the worst case
BACKOFF = 0.5  # optimism factor kept on a snapshot with new preemptions
OPTIMISM_FLOOR = 1.0 / 16  # below this the optimism drops to zero
RECOVERY_PER_SECOND = 0.02  # optimism regained per second of snapshots without preemptions
MAX_RECOVERY_STEP_SECONDS = 2.0  # a long gap between snapshots (outage) does not count as clean time
CHECKPOINTS = 8  # progress checkpoints kept per request
DRAIN_WINDOW_SECONDS = 60.0
RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1.0, 60.0
RETRY_AFTER_UNKNOWN = 5.0  # no release seen yet: nothing to estimate from


class _Phase(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    ADMITTED = "admitted"
    RELEASED = "released"
    REJECTED = "rejected"


class Reservation:
    """One request's claim on KV blocks. Use as ``async with``; released exactly once on every path."""

    def __init__(
        self, admission: Admission, *, prompt_tokens: int, max_tokens: int, n: int, priority: int,
        request_id: str, block_size: int,
    ) -> None:
        self._admission = admission
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.n = n
        self.priority = priority
        self.blocks = request_need(prompt_tokens, max_tokens, n, block_size)
        self.queue_ms = 0.0
        self._phase = _Phase.NEW
        self._future: asyncio.Future[None] | None = None
        self._seq = 0
        self._enqueued_at = 0.0
        self._deadline = math.inf
        self._waited = False
        self._passed = 0
        self._failed = False
        self._generated = 0
        self._observed = False
        # (time, generated) pairs spaced a fraction of the scrape interval apart: what the engine surely
        # held at a past instant, to compare with a snapshot taken then.
        self._checkpoints: deque[tuple[float, int]] = deque(maxlen=CHECKPOINTS)
        self._credited: int | None = None  # generated tokens the latest fresh snapshot surely includes

    @property
    def admitted(self) -> bool:
        return self._phase is _Phase.ADMITTED

    @property
    def generated(self) -> int:
        return self._generated

    async def __aenter__(self) -> Reservation:
        await self._admission._enter(self)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._failed = True
        self.release()

    def release(self, *, completed: bool = True) -> None:
        """Give the blocks back (idempotent). On a queued reservation: withdraw it; its wait is cancelled.

        ``completed=False`` (a cut stream, an upstream error) keeps the request's output length out of the
        adaptive policy's estimate, which a truncated output would bias low."""
        if not completed:
            self._failed = True
        self._admission._release(self)

    def observe_output_tokens(self, generated: int) -> None:
        """Completion tokens produced so far, summed over the ``n`` choices (streamed progress or final usage)."""
        if generated < self._generated:
            return
        self._generated = generated
        self._observed = True
        now = self._admission._clock()
        spacing = self._admission._checkpoint_spacing
        if not self._checkpoints or now - self._checkpoints[-1][0] >= spacing:
            self._checkpoints.append((now, generated))

    def _order(self) -> tuple[int, int]:
        return (-self.priority, self._seq)


class Admission:
    def __init__(
        self,
        settings: Settings,
        engine: EngineView | None,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self._ledger = Ledger()
        self._queue: list[Reservation] = []  # sorted by (-priority, arrival)
        self._keys: list[tuple[int, int]] = []  # the queue's sort keys, for bisect
        self._in_flight: set[Reservation] = set()
        self._seq = itertools.count()
        self._paused = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._releases: deque[float] = deque()
        self._outputs: deque[int] = deque(maxlen=OUTPUT_WINDOW)
        self._optimism = 1.0
        self._last_preemptions: float | None = None
        self._timer: asyncio.Task[None] | None = None
        self._checkpoint_spacing = settings.scrape_interval / 4
        self._credit_window = 2 * settings.scrape_interval
        self._projected: int | None = None
        self._published_depth: dict[int, int] | None = None
        cap = self._capacity_now()
        self._block_size = cap.block_size if cap else (settings.block_size or DEFAULT_BLOCK_SIZE)
        if engine is not None:
            engine.on_snapshot(self._on_snapshot)

    # -- public surface ---------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def committed(self) -> int:
        return self._ledger.committed

    @property
    def optimism(self) -> float:
        return self._optimism

    def fit(self, prompt_tokens: int, max_tokens: int, n: int, *, clamp: bool) -> int:
        cap = self._capacity()
        if cap is None:
            return max_tokens
        budget = self._budget(cap)
        bs = cap.block_size
        need = request_need(prompt_tokens, max_tokens, n, bs)
        if need <= budget:
            return max_tokens
        if clamp:
            fitted = min(max_tokens, (budget // n) * bs - prompt_tokens)
            if fitted >= 1:
                return fitted
        raise errors.KVBudgetExceeded(self._too_large_message(prompt_tokens, max_tokens, n, need, cap))

    def reservation(
        self, *, prompt_tokens: int, max_tokens: int, n: int, priority: int, request_id: str
    ) -> Reservation:
        self._capacity()  # settles the block size the need is counted in
        return Reservation(
            self, prompt_tokens=prompt_tokens, max_tokens=max_tokens, n=n, priority=priority,
            request_id=request_id, block_size=self._block_size,
        )

    def pause(self) -> None:
        self._paused = True
        self._publish()

    def resume(self) -> None:
        self._paused = False
        self._pump()

    def tick(self) -> None:
        """Expire queued requests whose deadline has passed and re-examine the queue."""
        self._pump()

    async def wait_idle(self, timeout: float) -> bool:
        if not self._in_flight:
            return True
        idle = asyncio.ensure_future(self._idle.wait())
        timer = asyncio.ensure_future(self._sleep(timeout))
        try:
            await asyncio.wait({idle, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (idle, timer):
                task.cancel()
            await asyncio.gather(idle, timer, return_exceptions=True)
        return not self._in_flight

    async def close(self) -> None:
        """Stop the deadline timer and turn the waiting requests away (shutdown)."""
        for r in list(self._queue):
            self._fail(r, errors.UpstreamUnavailable("The gateway is shutting down.", retry_after=1.0))
        await self._stop_timer()

    def status(self) -> dict[str, Any]:
        cap = self._capacity()
        budget = self._budget(cap) if cap else None
        by_prio = self._depth_by_priority()
        snap = self._engine.snapshot if self._engine else None
        rate = self._drain_rate()
        if cap is not None and self._settings.admission_policy == "adaptive" and self._live_usable():
            self._projected = self._project(cap)
        self._publish()
        if self._engine is not None:
            self._engine.publish_freshness()
        return {
            "policy": self._settings.admission_policy,
            "paused": self._paused,
            "block_size": self._block_size,
            "capacity_blocks": cap.blocks if cap else None,
            "capacity_source": cap.source if cap else None,
            "kv_target": self._settings.kv_target,
            "budget_blocks": budget,
            "committed_blocks": self._ledger.committed,
            "live_used_blocks": self._live_used(cap),
            "projected_blocks": self._projected,
            "admit_limit_blocks": self._admit_limit(budget),
            "in_flight": len(self._in_flight),
            "max_concurrency": self._settings.max_concurrency,
            "queued": len(self._queue),
            "queued_by_priority": {str(p): c for p, c in sorted(by_prio.items(), reverse=True)},
            "max_queue": self._settings.max_queue,
            "optimism": round(self._optimism, 4),
            "output_estimate_tokens": self._output_estimate(),
            "drain_rate_per_s": None if rate is None else round(rate, 3),
            "engine": None if snap is None or self._engine is None else {
                "ok": snap.ok, "has_metrics": snap.has_metrics, "stale": self._engine.is_stale(),
                "age_s": self._engine.age(), "kv_usage": snap.kv_usage, "running": snap.running,
                "waiting": snap.waiting, "preemptions_total": snap.preemptions_total,
            },
        }

    # -- entering and leaving ---------------------------------------------------------------------
    async def _enter(self, r: Reservation) -> None:
        if r._phase is not _Phase.NEW:
            raise RuntimeError(f"reservation {r.request_id} was already entered or released")
        cap = self._capacity()
        r.blocks = request_need(r.prompt_tokens, r.max_tokens, r.n, self._block_size)
        if cap is not None and r.blocks > self._budget(cap):
            r._phase = _Phase.REJECTED
            raise errors.KVBudgetExceeded(self._too_large_message(r.prompt_tokens, r.max_tokens, r.n, r.blocks, cap))
        now = self._clock()
        r._seq = next(self._seq)
        r._enqueued_at = now
        r._deadline = now + self._settings.queue_timeout
        r._future = asyncio.get_running_loop().create_future()
        r._phase = _Phase.QUEUED
        key = r._order()
        at = bisect.bisect(self._keys, key)
        self._keys.insert(at, key)
        self._queue.insert(at, r)
        self._pump()
        if r._phase is _Phase.ADMITTED:
            return
        if len(self._queue) > self._settings.max_queue:
            position = self._queue.index(r)
            self._remove(r)
            r._phase = _Phase.REJECTED
            full = errors.QueueFull(
                f"The gateway's queue is full ({self._settings.max_queue} requests waiting for KV capacity, "
                f"{len(self._in_flight)} in flight); retry later.",
                retry_after=self._retry_after(position),
            )
            raise full
        r._waited = True
        self._ensure_timer()
        try:
            await r._future
        except asyncio.CancelledError:
            if r._future.done() and not r._future.cancelled():
                r._future.exception()  # failed in the same instant: mark it seen, the cancellation wins
            if r._phase is _Phase.QUEUED:
                self._remove(r)
                r._phase = _Phase.RELEASED
                self._pump()
            elif r.admitted:
                # Admitted in the same instant the waiter was cancelled: nobody will use the blocks.
                self._release(r)
            raise

    def _release(self, r: Reservation) -> None:
        if r._phase is _Phase.ADMITTED:
            r._phase = _Phase.RELEASED
            self._ledger.release(r.blocks)
            self._in_flight.discard(r)
            now = self._clock()
            self._releases.append(now)
            if r._observed and not r._failed:
                self._outputs.append(math.ceil(r._generated / r.n))
            if not self._in_flight:
                self._idle.set()
            self._pump()
        elif r._phase is _Phase.QUEUED:
            self._remove(r)
            r._phase = _Phase.RELEASED
            if r._future is not None and not r._future.done():
                r._future.cancel()
            self._pump()
        elif r._phase is _Phase.NEW:
            r._phase = _Phase.RELEASED

    # -- the queue --------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Expire, then admit from the queue as far as the policy allows."""
        self._expire()
        self._projected = None
        cap = self._capacity()
        if not self._paused:
            budget = self._budget(cap) if cap else 0
            while self._queue:
                head = self._queue[0]
                if cap is not None and head.blocks > budget:
                    # Capacity shrank under a queued request (engine restarted smaller): it can never fit.
                    msg = self._too_large_message(head.prompt_tokens, head.max_tokens, head.n, head.blocks, cap)
                    self._fail(head, errors.KVBudgetExceeded(msg))
                    continue
                if self._fits(head, cap, budget):
                    self._admit(head, cap)
                    continue
                if head._passed >= self._settings.starvation_bound:
                    break
                passer = next(
                    (w for w in self._queue[1:] if w.blocks < head.blocks and self._fits(w, cap, budget)),
                    None,
                )
                if passer is None:
                    break
                head._passed += 1
                self._admit(passer, cap)

    def _fits(self, r: Reservation, cap: Capacity | None, budget: int) -> bool:
        limit = self._settings.max_concurrency
        if limit is not None and len(self._in_flight) >= limit:
            return False
        if cap is None:
            return True
        if r.blocks > budget:
            return False
        if self._ledger.committed + r.blocks <= budget:
            return True
        if self._settings.admission_policy != "adaptive" or not self._live_usable():
            return False
        if self._projected is None:
            self._projected = self._project(cap)
        return self._projected + self._growth(r, cap.block_size) <= budget

    def _admit(self, r: Reservation, cap: Capacity | None) -> None:
        self._remove(r)
        if self._projected is not None and cap is not None:
            self._projected += self._growth(r, cap.block_size)
        now = self._clock()
        r._phase = _Phase.ADMITTED
        waited = max(0.0, now - r._enqueued_at)
        r.queue_ms = waited * 1000.0
        self._ledger.commit(r.blocks)
        self._in_flight.add(r)
        self._idle.clear()
        self._metrics.record_admission("queued" if r._waited else "immediate", waited)
        if r._future is not None and not r._future.done():
            r._future.set_result(None)

    def _remove(self, r: Reservation) -> None:
        at = bisect.bisect_left(self._keys, r._order())
        if at < len(self._queue) and self._queue[at] is r:
            del self._queue[at]
            del self._keys[at]
        if not self._queue and self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()
            self._timer = None

    def _fail(self, r: Reservation, err: errors.GatewayError) -> None:
        self._remove(r)
        r._phase = _Phase.REJECTED
        if r._future is not None and not r._future.done():
            r._future.set_exception(err)

    def _expire(self) -> None:
        now = self._clock()
        expired = [r for r in self._queue if r._deadline <= now]
        for r in expired:
            position = self._queue.index(r)
            self._fail(r, errors.QueueTimeout(
                f"Waited {now - r._enqueued_at:.1f} s for KV capacity, the queue timeout is "
                f"{self._settings.queue_timeout:g} s ({len(self._in_flight)} requests in flight, "
                f"{len(self._queue)} queued); retry later.",
                retry_after=self._retry_after(position),
            ))

    def _ensure_timer(self) -> None:
        if self._timer is None or self._timer.done():
            self._timer = asyncio.create_task(self._expire_loop(), name="admission-deadlines")

    async def _expire_loop(self) -> None:
        while self._queue:
            nearest = min(r._deadline for r in self._queue)
            await self._sleep(max(0.0, nearest - self._clock()))
            self._pump()

    async def _stop_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
            await asyncio.gather(timer, return_exceptions=True)

    def _depth_by_priority(self) -> dict[int, int]:
        depth: dict[int, int] = {}
        for r in self._queue:
            depth[r.priority] = depth.get(r.priority, 0) + 1
        return depth

    # -- capacity and the live view ---------------------------------------------------------------
    def _capacity_now(self) -> Capacity | None:
        return capacity_from(self._engine.snapshot if self._engine else None, self._settings)

    def _capacity(self) -> Capacity | None:
        cap = self._capacity_now()
        if cap is not None and cap.block_size != self._block_size:
            self._rebase(cap.block_size)
        return cap

    def _rebase(self, block_size: int) -> None:
        """Recount every need in a new block size (the engine published a different one than assumed)."""
        self._block_size = block_size
        for r in self._in_flight:
            new = request_need(r.prompt_tokens, r.max_tokens, r.n, block_size)
            self._ledger.resize(r.blocks, new)
            r.blocks = new
        for r in self._queue:
            r.blocks = request_need(r.prompt_tokens, r.max_tokens, r.n, block_size)

    def _budget(self, cap: Capacity) -> int:
        # The epsilon keeps 0.3 x 10 from flooring to 2.
        return math.floor(self._settings.kv_target * cap.blocks + 1e-9)

    def _live_usable(self) -> bool:
        if self._engine is None or self._engine.is_stale():
            return False
        snap = self._engine.snapshot
        return snap.ok and snap.has_metrics and snap.kv_usage is not None

    def _live_used(self, cap: Capacity | None) -> int | None:
        if cap is None or self._engine is None:
            return None
        usage = self._engine.snapshot.kv_usage
        return None if usage is None else math.ceil(usage * cap.blocks - 1e-9)

    def _project(self, cap: Capacity) -> int:
        live = self._live_used(cap) or 0
        bs = cap.block_size
        # Two views of where the in-flight requests end up; both bound it, the smaller is kept.
        # On top of live usage: each request's growth past what the snapshot surely holds of it (its streamed
        # progress). A request with no progress seen (not streamed, or not yet started) is counted whole,
        # so what it already holds counts twice.
        on_top = live + sum(self._growth(r, bs) for r in self._in_flight)
        # Their final sizes together, never below what the engine holds now: exact for requests whose
        # progress is unknown, as long as the gateway is the engine's client (--kv-target leaves room for others).
        final = max(live, sum(self._growth(r, bs, use_credit=False) for r in self._in_flight))
        return min(on_top, final)

    def _growth(self, r: Reservation, block_size: int, *, use_credit: bool = True) -> int:
        """Blocks ``r`` may still add to the live usage (see the module docstring); without ``use_credit``,
        the blocks it will hold at its (expected) end."""
        credited = 0
        if use_credit and r._credited is not None:
            credited = blocks_in_use_at_least(r.prompt_tokens, r._credited, r.n, block_size)
        worst = max(0, r.blocks - credited)
        longest = self._output_estimate()
        if self._optimism <= 0.0 or longest is None:
            return worst
        per_sequence = math.ceil(r._generated / r.n)
        expected_out = min(r.max_tokens, max(longest, 2 * per_sequence))
        expected = max(0, request_need(r.prompt_tokens, expected_out, r.n, block_size) - credited)
        return worst - math.floor(self._optimism * max(0, worst - expected))

    def _output_estimate(self) -> int | None:
        if len(self._outputs) < MIN_OUTPUT_SAMPLES:
            return None
        return max(self._outputs)

    def _admit_limit(self, budget: int | None) -> int | None:
        """The committed total the policy would accept now: the budget, plus what live usage frees."""
        if budget is None:
            return None
        if self._settings.admission_policy == "adaptive" and self._projected is not None:
            return budget + max(0, self._ledger.committed - self._projected)
        return budget

    def _on_snapshot(self, old: EngineSnapshot, new: EngineSnapshot) -> None:
        if new.ok and new.has_metrics:
            increase = counter_increase(self._last_preemptions, new.preemptions_total)
            if new.preemptions_total is not None:
                self._last_preemptions = new.preemptions_total
            if increase > 0:
                self._optimism *= BACKOFF
                if self._optimism < OPTIMISM_FLOOR:
                    self._optimism = 0.0
                log.warning("engine reported %g new preemptions; admission optimism now %.3f",
                            increase, self._optimism)
            elif old.ok:
                step = min(MAX_RECOVERY_STEP_SECONDS, max(0.0, new.taken_at - old.taken_at))
                self._optimism = min(1.0, self._optimism + RECOVERY_PER_SECOND * step)
            self._credit(new.taken_at)
        else:
            for r in self._in_flight:
                r._credited = None
        self._pump()

    def _credit(self, taken_at: float) -> None:
        """Credit each in-flight request with the progress the snapshot surely contains."""
        since = taken_at - self._credit_window
        for r in self._in_flight:
            seen = [g for t, g in r._checkpoints if since < t <= taken_at]
            # Streamed progress can run ahead of the cache: a role-only first chunk per choice, the usage
            # chunk, [DONE], and each choice's last sampled token, which is not cached yet.
            r._credited = max(0, max(seen) - (2 + 2 * r.n)) if seen else None

    # -- Retry-After ------------------------------------------------------------------------------
    def _drain_rate(self) -> float | None:
        now = self._clock()
        while self._releases and self._releases[0] < now - DRAIN_WINDOW_SECONDS:
            self._releases.popleft()
        if not self._releases:
            return None
        return len(self._releases) / max(1.0, now - self._releases[0])

    def _retry_after(self, position: int) -> float:
        rate = self._drain_rate()
        estimate = RETRY_AFTER_UNKNOWN if rate is None else (position + 1) / rate
        return min(RETRY_AFTER_MAX, max(RETRY_AFTER_MIN, estimate))

    # -- messages and metrics ---------------------------------------------------------------------
    def _too_large_message(self, prompt_tokens: int, max_tokens: int, n: int, need: int, cap: Capacity) -> str:
        budget = self._budget(cap)
        return (
            f"This request needs {need} KV blocks ({need * cap.block_size} tokens: n={n} x "
            f"({prompt_tokens} prompt + {max_tokens} max_tokens) in blocks of {cap.block_size}), more than "
            f"the engine's whole KV budget of {budget} blocks ({budget * cap.block_size} tokens = "
            f"kv_target {self._settings.kv_target:g} x {cap.blocks} blocks). Lower max_tokens, n or the prompt."
        )

    def _publish(self) -> None:
        """Set the KV and queue gauges. Run when they are read (status(), which /metrics calls) rather than on
        every admission and release: per request it cost ~3% of the gateway's CPU for values nobody read."""
        cap = self._capacity_now()
        if cap is not None:
            budget = self._budget(cap)
            self._metrics.record_kv(
                capacity=cap.blocks, budget=budget, committed=self._ledger.committed,
                live_used=self._live_used(cap), admit_limit=self._admit_limit(budget) or budget,
            )
        depth = self._depth_by_priority()
        if depth != self._published_depth:
            self._metrics.record_queue_depth(depth)
            self._published_depth = depth
