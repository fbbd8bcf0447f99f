"""Admission: admit, queue or shed each request against the engine's KV budget.

A request's *need* is the most KV blocks admitting it adds: its sequences' own blocks (``n x`` prompt and
``max_tokens``, less the shareable prompt blocks) plus the shareable prompt blocks no request in flight holds
(``books``, ``sharing``). The budget is ``B = floor(kv_target x capacity_blocks)``; ``committed``: the books' total.

Whether one more request fits is the policy's (``policy``: ``strict`` books every request at its full size, so the
engine never runs short of blocks for the gateway's requests; ``adaptive`` also admits on the projection of the live
usage). The queue is re-examined on every release, snapshot and resume. With several engines (``placement``) each has
its own budget, books, policy; the queue is one: a request waits while no engine can take it, then goes to the first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from gateway import errors
from gateway.admission import lateness, order, refusals, report
from gateway.admission.deadlines import Deadlines
from gateway.admission.forecast import Forecast
from gateway.admission.gauges import LoadGauges
from gateway.admission.headroom import Headroom
from gateway.admission.ledger import Capacity, fit_output
from gateway.admission.placement import Sites
from gateway.admission.prefix import PromptPrefix
from gateway.admission.queue import DeadlineTimer, Drain, WaitQueue
from gateway.admission.reservation import Phase, Reservation
from gateway.admission.site import Site
from gateway.config import Settings
from gateway.engine.live import EngineSnapshot, EngineView
from gateway.engine.vllm_api.defaults import DEFAULT_BLOCK_SIZE
from gateway.metrics import Metrics


class Admission:
    """The admission controller: one per gateway, shared by every request."""

    def __init__(
        self, settings: Settings, engine: EngineView | None, metrics: Metrics,
        clock: Callable[[], float] = time.monotonic, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        engines: Sequence[EngineView] = (), usable: Callable[[int], bool] | None = None,
    ) -> None:
        """``engine``, or several ``engines`` serving the same model; ``usable(i)``: whether engine ``i`` may
        take requests now (up, not hung), consulted when there are several."""
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self._queue: WaitQueue[Reservation] = WaitQueue(settings.starvation_bound, fair=settings.fair_queueing == "on")
        self._timer = DeadlineTimer(self._queue, self._pump, clock=clock, sleep=sleep)
        self._in_flight: dict[Reservation, Site] = {}
        self._paused = False
        self._moved = True  # the books or the engine moved since the last pass (``_pump``)
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain = Drain()
        self._forecast = Forecast(enabled=settings.shed_early == "on", timeout=settings.queue_timeout, clock=clock)
        self._deadlines = Deadlines(settings.queue_timeout, settings.ttft_objective, clock,
                                    feedback=settings.sustained_feedback == "on")
        self._checkpoint_spacing = settings.scrape_interval / 4
        self._gauges = LoadGauges(metrics)
        on = settings.fair_queueing == "on" and settings.tenant_headroom == "on"
        self._headroom = Headroom(enabled=on, clock=clock, record=metrics.record_tenant_headroom)
        views: list[EngineView | None] = [*engines] or [engine]
        self._sites = Sites(settings, views, self._headroom, usable)
        cap = self._sites.primary.capacity()
        self._block_size = cap.block_size if cap else (settings.block_size or DEFAULT_BLOCK_SIZE)
        self._sharing = self._sites.primary.kv.prefix_sharing()
        for i, view in enumerate(views):
            if view is not None:
                view.on_snapshot(partial(self._on_snapshot, i))
        self._gauges.publish_kv(self._sites)

    # -- public surface ---------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def committed(self) -> int:
        """Blocks booked: each request's own, and the shared prompt blocks once (every engine's)."""
        return self._sites.committed

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def sharing(self) -> bool:
        """Whether prompt blocks shared by requests in flight are booked once (prefix caching on the engine)."""
        return self._sharing

    @property
    def optimism(self) -> float:
        return min(s.projector.optimism.value for s in self._sites)

    def budget_blocks(self) -> int | None:
        """The blocks the gateway may commit (``kv_target`` x capacity, all engines'); None while none is known."""
        self._capacity()
        return self._sites.budget_total() if self._sites.capacities() else None

    def fit(self, prompt_tokens: int, max_tokens: int, n: int, *, clamp: bool, prefix_known: bool = False) -> int:
        """``max_tokens`` if the request fits the whole budget; with ``clamp``, lowered until it does, else raises
        ``KVBudgetExceeded``. ``prefix_known``: ids known, with prefix sharing its sequences hold its prompt once."""
        cap = self.largest_capacity()
        shared = self._sharing and prefix_known
        return max_tokens if cap is None else fit_output(prompt_tokens, max_tokens, n, cap, self._settings.kv_target,
                                                         clamp=clamp, shared=shared)

    def largest_capacity(self) -> Capacity | None:
        """The largest engine's capacity: what one request can ever be given (``fit``'s, for other processes)."""
        self._capacity()
        return largest[0] if (largest := self._sites.largest()) is not None else None

    def reservation(
        self, *, prompt_tokens: int, max_tokens: int, n: int, priority: int, request_id: str, tenant: str = "default",
        weight: float = 1.0, prefix: PromptPrefix | None = None, avoid: frozenset[str] = frozenset(), family: str = "",
        deadline: float | None = None, min_output: int = 0, objective: float | None = None,
    ) -> Reservation:
        """``avoid``: engines (names) not to go to while another can take it; ``family``: its served model and route
        (whose answers' lengths book it); ``deadline``: seconds it may wait at most (the client's, under
        ``--queue-timeout``); ``min_output``: output tokens per sequence it surely generates; ``objective``: its
        own TTFT objective, s, judged at arrival as ``--ttft-objective``."""
        self._capacity()  # settles the block size the need is counted in
        return Reservation(
            self, prompt_tokens=prompt_tokens, max_tokens=max_tokens, n=n, priority=priority,
            request_id=request_id, block_size=self._block_size, clock=self._clock,
            checkpoint_spacing=self._checkpoint_spacing, tenant=tenant, weight=weight, prefix=prefix, avoid=avoid,
            family=family, deadline=deadline, min_output=min_output, objective=objective,
        )

    def pause(self) -> None:
        self._paused = True
        self.publish()

    def resume(self) -> None:
        self._paused = False
        self._pump()

    def hold(self, engine: int, held: bool = True) -> None:
        """Place nothing more on ``engine`` (drained for its restart) while the others serve; False: release it."""
        (self._sites.held.add if held else self._sites.held.discard)(engine)
        self._pump()

    def in_flight_on(self, engine: int) -> int:
        return sum(len(site.in_flight) for site in self._sites.of_engine(engine))

    def tick(self) -> None:  # expire queued requests whose deadline passed, and re-examine the queue
        self._pump()

    async def wait_idle(self, timeout: float) -> bool:
        if self._in_flight:
            idle, timer = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._sleep(timeout))
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
        self._gauges.publish_load(self._sites, self._queue.depth)
        await self._timer.stop()

    def status(self) -> dict[str, Any]:
        """The state as ``/guard/status`` shows it (a JSON document). Reads only: changes nothing."""
        return report.status_document(report.Parts(
            self._settings, self._sites, self._queue, self._forecast, self._headroom, self._block_size,
            self._sharing, self._paused, len(self._in_flight), self._drain.rate(self._clock()),
            self._clock(), self._deadlines.status(),
        ))

    def publish(self) -> None:
        """Every KV and queue gauge and the engine's freshness, as of now: when ``/metrics`` is read (and on pause),
        the one place they are seen. Set as they changed instead (on every admission, release and engine snapshot),
        they cost each request two passes over the books and three gauges' locks, and each snapshot a projection
        over every request in flight (~3% of a loaded gateway's loop), for values nobody read until the next
        scrape."""
        self._gauges.publish_kv(self._sites)
        self._gauges.publish_load(self._sites, self._queue.depth)
        self._sites.engine_kv.publish_freshness()
        self._headroom.publish(self.budget_blocks())

    # -- the reservation's side (``Admitter``) ------------------------------------------------------
    async def enter(self, r: Reservation) -> None:
        """Admit ``r`` now, or queue it and return once it is admitted (``Reservation.__aenter__``)."""
        await r.prepare(self._block_size, self._sharing)  # a long prompt's block keys, hashed off the loop
        if self.arrive(r):
            return
        try:
            await r.wait()
        except asyncio.CancelledError:
            # Still queued: withdrawn. Admitted as the waiter was cancelled: the unused blocks go back at once.
            self.leave(r)
            raise

    def arrive(self, r: Reservation) -> bool:
        """``enter`` without its waits (``r.prepare`` is the caller's): True once ``r`` is admitted, False while it
        is queued (``r.wait()``); raises what refused it. For a holder without a task (the workers' authority)."""
        if r.phase is not Phase.NEW:
            raise RuntimeError(f"reservation {r.request_id} was already entered or released")
        self._capacity()
        r.recount(self._block_size, self._sharing)
        largest = self._sites.largest()
        if largest is not None and r.alone_blocks > largest[1]:
            r.reject()
            raise refusals.too_large(r, largest[0], self._settings.kv_target)
        now = self._clock()
        limit = r.wait_limit = self._deadlines.limit(r, len(self._in_flight), self._queue.oldest_wait(now))
        if limit.seconds <= 0:  # the engine alone takes longer than its deadline to a first token
            r.reject()
            self._refuse_late(arriving=r)  # refused at once, it still arrived: the backlog's bound holds (``lateness``)
            raise refusals.deadline_now(limit, self._drain.retry_after(len(self._queue), now))
        r.enqueue()
        self._headroom.arrive(r)
        # Least-work order (``order``) among others waiting; at an empty queue shifted only if it waits (a third).
        adaptive = self._settings.admission_policy == "adaptive"  # strict keeps arrival order
        alone = not self._queue
        shift = order.queue_shift(r, self._sites, self._block_size, limit.seconds) if adaptive and not alone else 0.0
        r.due = now + limit.seconds if limit.then is not None else None
        self._queue.push(r, now, now + limit.queued.seconds, shift)
        self._pump(arriving=r, due=r.due)  # judged by ``limit``; once queued, by ``limit.queued``
        if r.admitted:
            return True
        r.wait_limit = limit.queued
        if adaptive and alone:  # still queued (a no-op if the forecast refused it)
            self._queue.reshift(r, order.queue_shift(r, self._sites, self._block_size, limit.seconds))
        if len(self._queue) > self._settings.max_queue:
            raise self._shed(r)
        self._timer.ensure()
        return False

    def first_token(self, r: Reservation, seconds: float) -> None:
        self._deadlines.first_token(seconds, waited=r.queue_ms / 1000.0, queued=r.queued_anywhere, limit=r.wait_limit)

    def leave(self, r: Reservation) -> None:
        """Give back ``r``'s blocks, or withdraw it from the queue (``Reservation.release``; idempotent)."""
        if r.phase is Phase.ADMITTED:
            r.finish()
            self._queue.served(r, output_tokens=r.generated)
            site = self._in_flight.pop(r)
            held = site.books.committed
            site.books.release(r)
            site.in_flight.discard(r)
            site.recent.add(r.keys)
            self._forecast.released(held - site.books.committed)
            self._headroom.release(r)
            self._drain.note(now := self._clock())
            site.projector.completed(r, r.completed_output, now)
            self._deadlines.left_engine(timed=r.timed_first_token)
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
    def _pump(self, arriving: Reservation | None = None, due: float | None = None) -> None:
        """Expire, then admit from the queue as far as the policy allows; refuse what is forecast to miss its
        deadline (``arriving``, the request just queued, at the rate seen and by ``due``: ``forecast``)."""
        self._expire(arriving)
        self._capacity()  # first: a rebase moves every need
        if arriving is None or self._moved:
            # An arrival's pass keeps the pass before's projection: it moves nothing that reads (releases, snapshots,
            # resumes, rebases pass themselves); at 2x capacity arrivals' projections took a tenth of the loop.
            for site in self._sites:
                site.policy.begin_pass()
            self._moved = False
        if not self._paused:
            largest = self._sites.largest()
            if self._sharing and len(self._sites) == 1:
                for r in self._queue:
                    self._sites.primary.books.quote(r)
            placed: dict[Reservation, Site] = {}
            while (head := self._queue.head()) is not None:
                if largest is not None and head.alone_blocks > largest[1]:
                    # Capacity shrank under a queued request (engine restarted smaller): it can never fit.
                    self._fail(head, refusals.too_large(head, largest[0], self._settings.kv_target))
                    continue
                chosen = self._queue.pick(lambda r: self._place(r, placed))
                if chosen is None:
                    break
                self._admit(chosen, placed[chosen])
            self._refuse_late(arriving)
            if largest is not None and self._queue:  # refused now rather than at the deadline: forecast to wait
                free = self._sites.budget_total() - self.committed
                backlog, span = self._queue.backlog(), refusals.span_of(self._settings.queue_timeout)
                overdue = partial(Reservation.overdue, now=self._clock())
                for late in self._forecast.late(backlog, free, len(self._in_flight), span, arriving, due, overdue):
                    self._fail(late.item, refusals.expected_late(late, self._settings.queue_timeout))
        self._deadlines.queue(bool(self._queue), self._clock())
        self._forecast.observe(backlogged=bool(self._queue) and bool(self._in_flight) and not self._paused)

    def _refuse_late(self, arriving: Reservation | None) -> None:
        """Refuse the queued requests known late, or held past their objective by the pace (``lateness``)."""
        for r, err in list(lateness.late_requests(
                self._queue, self._deadlines, self._drain, len(self._in_flight), self._clock(), arriving)):
            self._fail(r, err)

    def _place(self, r: Reservation, placed: dict[Reservation, Site]) -> bool:
        """Whether ``r`` fits on an engine now; the engine it fits on first is noted in ``placed``."""
        limit = self._settings.max_concurrency
        if (limit is not None and len(self._in_flight) >= limit) or self._deadlines.pace.binds(len(self._in_flight)):
            return False
        for site in self._sites.candidates(r, self._block_size, self._sharing):
            if site.fits(r):
                placed[r] = site
                return True
        return False

    def _admit(self, r: Reservation, site: Site) -> None:
        enqueued_at = self._queue.enqueued_at(r)
        self._dequeue(r)
        site.policy.admitted(r, site.capacity())
        waited = max(0.0, self._clock() - enqueued_at)
        r.target = site.target
        crowded = self._deadlines.crowded(len(self._in_flight), len(self._sites))
        r.admit(waited, engine_queued=site.engine_queued or crowded)
        site.books.commit(r)
        self._headroom.commit(r)
        self._queue.served(r, prompt_tokens=r.prompt_tokens)
        site.in_flight.add(r)
        site.admitted_total += 1
        self._in_flight[r] = site
        self._idle.clear()
        self._metrics.record_admission("queued" if r.waited else "immediate", waited)

    def _dequeue(self, r: Reservation) -> None:
        self._deadlines.left_queue(r, self._clock() - self._queue.enqueued_at(r), r.wait_limit)  # admitted or not
        self._queue.remove(r)
        self._headroom.dequeued(r)
        self._timer.stop_if_empty()

    def _fail(self, r: Reservation, err: errors.GatewayError) -> None:
        self._dequeue(r)
        self._deadlines.refused()
        r.reject(err)

    def _shed(self, r: Reservation) -> errors.QueueFull:
        """Turn away a request the full queue has no room for; returns the 429 to raise."""
        position = self._queue.position(r)
        self._dequeue(r)
        r.reject()
        retry_after = self._drain.retry_after(position, self._clock())
        return refusals.queue_full(self._settings.max_queue, len(self._in_flight), retry_after)

    def _expire(self, arriving: Reservation | None = None) -> None:
        """Fail the queued requests whose wait is over; never the one arriving, whose pass tries it first (a
        deadline of a few milliseconds could pass between its queueing and this, on an idle engine)."""
        now = self._clock()
        for r in [r for r in self._queue.expired(now) if r is not arriving]:
            position, waited = self._queue.position(r), now - self._queue.enqueued_at(r)
            self._fail(r, refusals.timed_out(r, waited, self._settings.queue_timeout, len(self._in_flight),
                                             len(self._queue), self._drain.retry_after(position, now)))

    # -- capacity and the live view ---------------------------------------------------------------
    def _capacity(self) -> Capacity | None:
        """The capacity, after recounting every need if the engine's block size or prefix caching changed."""
        primary = self._sites.primary
        cap, sharing = primary.capacity(), primary.kv.prefix_sharing()
        if (cap is not None and cap.block_size != self._block_size) or sharing != self._sharing:
            self._rebase(cap.block_size if cap is not None else self._block_size, sharing)
        return cap

    def _rebase(self, block_size: int, sharing: bool) -> None:
        """Recount every need (the engine published another block size than assumed, or (re)started with prefix
        caching switched): each admitted request gives back its shared blocks and takes them again as recounted."""
        self._block_size, self._sharing = block_size, sharing
        self._moved = True
        for r, site in self._in_flight.items():
            site.books.recount(r, block_size, sharing)
        for r in self._queue:
            r.recount(block_size, sharing)

    def _on_snapshot(self, engine: int, old: EngineSnapshot, new: EngineSnapshot) -> None:
        self._sites.follow_ranks(engine, new)
        held_back, room = bool(self._queue) and not self._paused, self._deadlines.compute_room(len(self._in_flight))
        self._deadlines.steer(len(self._in_flight), held_back, new.waiting, engine)
        blamed = sum(site.learn(old, new, held_back, room) for site in self._sites.of_engine(engine))
        self._metrics.record_foreign(sum(s.foreign for s in self._sites), blamed)
        control = self._sites.primary.projector.optimism
        self._metrics.record_preemption_control(control.quantile, control.rate(new.taken_at), control.reach)
        self._pump()
