"""Admission: admit, queue or shed each request against the engine's KV budget.

A request's *need* is the most KV blocks it can make the engine allocate:
``n x ceil((prompt_tokens + max_tokens) / block_size)`` (see ``ledger.request_need``). The *budget* is
``B = floor(kv_target x capacity_blocks)``. The *ledger* sums the needs of the requests in flight
(``committed``).

``strict``
    Admit while ``committed + need <= B``. Every reservation is an upper bound, so the engine can never
    run short of blocks for the gateway's requests: no preemption, even if every request runs to its
    ``max_tokens``. The price: requests that stop early hold blocks they never use.

``adaptive`` (default)
    Admit whenever strict would. Besides, while the engine's metrics are fresh, admit as far as the
    projection of what the admitted requests will still grow by leaves room (see ``projection``). Stale or
    absent metrics (``--disable-log-stats``, failed scrapes) switch the live path off: only the ledger admits.

Both policies honour ``--max-concurrency``. Without a known capacity only the concurrency limit and the
queue apply. The queue (see ``queue``) is re-examined on every release, on each new engine snapshot, and on
resume.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway import errors
from gateway.admission.kv_view import KvView
from gateway.admission.ledger import Capacity, Ledger, request_need, too_large_message
from gateway.admission.projection import Projector, growth, project
from gateway.admission.queue import DeadlineTimer, Drain, WaitQueue
from gateway.admission.reservation import Phase, Reservation
from gateway.config import Settings
from gateway.engine.live import EngineSnapshot, EngineView
from gateway.engine.vllm_api.defaults import DEFAULT_BLOCK_SIZE
from gateway.metrics import Metrics


class Admission:
    """The admission controller: one per gateway, shared by every request."""

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
        self._kv = KvView(engine, settings)
        self._metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self._ledger = Ledger()
        self._queue: WaitQueue[Reservation] = WaitQueue(settings.starvation_bound)
        self._timer = DeadlineTimer(self._queue, self._pump, clock=clock, sleep=sleep)
        self._in_flight: set[Reservation] = set()
        self._paused = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain = Drain()
        self._projector = Projector(credit_window=2 * settings.scrape_interval)
        self._checkpoint_spacing = settings.scrape_interval / 4
        self._projected: int | None = None  # the projection while a pass over the queue needs it
        self._published_committed: int | None = None
        self._published_depth: dict[int, int] | None = None
        cap = self._kv.capacity()
        self._block_size = cap.block_size if cap else (settings.block_size or DEFAULT_BLOCK_SIZE)
        if engine is not None:
            engine.on_snapshot(self._on_snapshot)
        self._publish_kv()

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
        return self._projector.optimism.value

    def fit(self, prompt_tokens: int, max_tokens: int, n: int, *, clamp: bool) -> int:
        """``max_tokens`` if the request fits the whole budget; with ``clamp``, lowered until it does.
        Raises ``KVBudgetExceeded`` when it cannot fit."""
        cap = self._capacity()
        if cap is None:
            return max_tokens
        budget = self._kv.budget(cap)
        bs = cap.block_size
        need = request_need(prompt_tokens, max_tokens, n, bs)
        if need <= budget:
            return max_tokens
        if clamp:
            fitted = min(max_tokens, (budget // n) * bs - prompt_tokens)
            if fitted >= 1:
                return fitted
        raise errors.KVBudgetExceeded(
            too_large_message(prompt_tokens, max_tokens, n, need, cap, self._settings.kv_target)
        )

    def reservation(
        self, *, prompt_tokens: int, max_tokens: int, n: int, priority: int, request_id: str
    ) -> Reservation:
        self._capacity()  # settles the block size the need is counted in
        return Reservation(
            self, prompt_tokens=prompt_tokens, max_tokens=max_tokens, n=n, priority=priority,
            request_id=request_id, block_size=self._block_size, clock=self._clock,
            checkpoint_spacing=self._checkpoint_spacing,
        )

    def pause(self) -> None:
        self._paused = True
        self.publish()

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
        for r in self._queue:
            self._fail(r, errors.UpstreamUnavailable("The gateway is shutting down.", retry_after=1.0))
        self._publish_load()
        await self._timer.stop()

    def status(self) -> dict[str, Any]:
        """The state as ``/guard/status`` shows it (a JSON document). Reads only: changes nothing."""
        cap = self._kv.capacity()
        budget = self._kv.budget(cap) if cap else None
        projected = self._projection_now(cap)
        rate = self._drain.rate(self._clock())
        return {
            "policy": self._settings.admission_policy,
            "paused": self._paused,
            "block_size": self._block_size,
            "capacity_blocks": cap.blocks if cap else None,
            "capacity_source": cap.source if cap else None,
            "kv_target": self._settings.kv_target,
            "budget_blocks": budget,
            "committed_blocks": self._ledger.committed,
            "live_used_blocks": self._kv.live_used(cap),
            "projected_blocks": projected,
            "admit_limit_blocks": self._admit_limit(budget, projected),
            "in_flight": len(self._in_flight),
            "max_concurrency": self._settings.max_concurrency,
            "queued": len(self._queue),
            "queued_by_priority": {str(p): c for p, c in sorted(self._queue.depth.items(), reverse=True)},
            "max_queue": self._settings.max_queue,
            "optimism": round(self._projector.optimism.value, 4),
            "output_estimate_tokens": self._projector.outputs.longest(),
            "drain_rate_per_s": None if rate is None else round(rate, 3),
            "engine": self._kv.engine_status(),
        }

    def publish(self) -> None:
        """Set every KV and queue gauge, and the engine's freshness, as of now.

        Runs on each engine snapshot, on pause and when ``/metrics`` is read: capacity, live usage and the
        adaptive limit move with the snapshots, and the freshness with the clock. The committed blocks and the
        queue depth change with every request, so those two are set as they change (``_publish_load``),
        without the projection, whose cost grows with the requests in flight."""
        self._publish_kv()
        self._publish_load()
        self._kv.publish_freshness()

    # -- the reservation's side (``Admitter``) ------------------------------------------------------
    async def enter(self, r: Reservation) -> None:
        """Admit ``r`` now, or queue it and return once it is admitted (``Reservation.__aenter__``)."""
        if r.phase is not Phase.NEW:
            raise RuntimeError(f"reservation {r.request_id} was already entered or released")
        cap = self._capacity()
        r.recount(self._block_size)
        if cap is not None and r.blocks > self._kv.budget(cap):
            r.reject()
            raise errors.KVBudgetExceeded(self._too_large_message(r, cap))
        now = self._clock()
        r.enqueue()
        self._queue.push(r, now, now + self._settings.queue_timeout)
        self._pump()
        if r.admitted:
            return
        if len(self._queue) > self._settings.max_queue:
            raise self._shed(r)
        self._timer.ensure()
        try:
            await r.wait()
        except asyncio.CancelledError:
            # Still queued: withdrawn. Admitted in the same instant the waiter was cancelled: nobody will use
            # the blocks, so they go back at once.
            self.leave(r)
            raise

    def leave(self, r: Reservation) -> None:
        """Give back ``r``'s blocks, or withdraw it from the queue (``Reservation.release``; idempotent)."""
        if r.phase is Phase.ADMITTED:
            r.finish()
            self._ledger.release(r.blocks)
            self._in_flight.discard(r)
            self._drain.note(self._clock())
            output = r.completed_output
            if output is not None:
                self._projector.outputs.add(output)
            if not self._in_flight:
                self._idle.set()
            self._pump()
        elif r.phase is Phase.QUEUED:
            self._dequeue(r)
            r.withdraw()
            self._pump()
        elif r.phase is Phase.NEW:
            r.withdraw()

    # -- the queue --------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Expire, then admit from the queue as far as the policy allows."""
        self._expire()
        self._projected = None
        cap = self._capacity()
        if not self._paused:
            budget = self._kv.budget(cap) if cap else 0
            while (head := self._queue.head()) is not None:
                if cap is not None and head.blocks > budget:
                    # Capacity shrank under a queued request (engine restarted smaller): it can never fit.
                    self._fail(head, errors.KVBudgetExceeded(self._too_large_message(head, cap)))
                    continue
                chosen = self._queue.pick(lambda r: self._fits(r, cap, budget))
                if chosen is None:
                    break
                self._admit(chosen, cap)
        self._publish_load()

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
        if self._settings.admission_policy != "adaptive" or not self._kv.live_usable():
            return False
        if self._projected is None:
            self._projected = self._projection_now(cap)
        return self._projected is not None and self._projected + self._growth(r, cap) <= budget

    def _admit(self, r: Reservation, cap: Capacity | None) -> None:
        enqueued_at = self._queue.enqueued_at(r)
        self._dequeue(r)
        if self._projected is not None and cap is not None:
            self._projected += self._growth(r, cap)
        waited = max(0.0, self._clock() - enqueued_at)
        r.admit(waited)
        self._ledger.commit(r.blocks)
        self._in_flight.add(r)
        self._idle.clear()
        self._metrics.record_admission("queued" if r.waited else "immediate", waited)

    def _dequeue(self, r: Reservation) -> None:
        self._queue.remove(r)
        self._timer.stop_if_empty()

    def _fail(self, r: Reservation, err: errors.GatewayError) -> None:
        self._dequeue(r)
        r.reject(err)

    def _shed(self, r: Reservation) -> errors.QueueFull:
        """Turn away a request the full queue has no room for; returns the 429 to raise."""
        position = self._queue.position(r)
        self._dequeue(r)
        r.reject()
        self._publish_load()
        return errors.QueueFull(
            f"The gateway's queue is full ({self._settings.max_queue} requests waiting for KV capacity, "
            f"{len(self._in_flight)} in flight); retry later.",
            retry_after=self._drain.retry_after(position, self._clock()),
        )

    def _expire(self) -> None:
        now = self._clock()
        for r in self._queue.expired(now):
            position = self._queue.position(r)
            waited = now - self._queue.enqueued_at(r)
            self._fail(r, errors.QueueTimeout(
                f"Waited {waited:.1f} s for KV capacity, the queue timeout is "
                f"{self._settings.queue_timeout:g} s ({len(self._in_flight)} requests in flight, "
                f"{len(self._queue)} queued); retry later.",
                retry_after=self._drain.retry_after(position, now),
            ))

    # -- capacity and the live view ---------------------------------------------------------------
    def _capacity(self) -> Capacity | None:
        """The capacity, after recounting every need if the engine's block size changed."""
        cap = self._kv.capacity()
        if cap is not None and cap.block_size != self._block_size:
            self._rebase(cap.block_size)
        return cap

    def _rebase(self, block_size: int) -> None:
        """Recount every need in a new block size (the engine published a different one than assumed)."""
        self._block_size = block_size
        for r in self._in_flight:
            old = r.recount(block_size)
            self._ledger.resize(old, r.blocks)
        for r in self._queue:
            r.recount(block_size)

    def _growth(self, r: Reservation, cap: Capacity) -> int:
        return growth(r, cap.block_size, self._projector.outlook())

    def _projection_now(self, cap: Capacity | None) -> int | None:
        """The adaptive projection as of now; None where the policy does not use one."""
        if cap is None or self._settings.admission_policy != "adaptive" or not self._kv.live_usable():
            return None
        return project(self._kv.live_used(cap) or 0, self._in_flight, cap.block_size, self._projector.outlook())

    def _admit_limit(self, budget: int | None, projected: int | None) -> int | None:
        """The committed total the policy would accept now: the budget, plus what live usage frees."""
        if budget is None:
            return None
        if projected is not None:
            return budget + max(0, self._ledger.committed - projected)
        return budget

    def _on_snapshot(self, old: EngineSnapshot, new: EngineSnapshot) -> None:
        self._projector.observe(old, new, self._in_flight)
        self._pump()
        self.publish()

    # -- messages and metrics ---------------------------------------------------------------------
    def _too_large_message(self, r: Reservation, cap: Capacity) -> str:
        return too_large_message(r.prompt_tokens, r.max_tokens, r.n, r.blocks, cap, self._settings.kv_target)

    def _publish_kv(self) -> None:
        cap = self._kv.capacity()
        if cap is None:
            return
        budget = self._kv.budget(cap)
        self._metrics.record_kv(
            capacity=cap.blocks, budget=budget, committed=self._ledger.committed, live_used=self._kv.live_used(cap),
            admit_limit=self._admit_limit(budget, self._projection_now(cap)) or budget,
        )
        self._published_committed = self._ledger.committed

    def _publish_load(self) -> None:
        """Set the committed-blocks and queue-depth gauges where they changed."""
        committed = self._ledger.committed
        if committed != self._published_committed:
            self._metrics.kv_committed.set(committed)
            self._published_committed = committed
        if self._queue.depth != self._published_depth:
            depth = dict(self._queue.depth)
            self._metrics.record_queue_depth(depth)
            self._published_depth = depth
