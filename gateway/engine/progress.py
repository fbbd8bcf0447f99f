"""Whether one engine makes progress while work runs, and what the gateway does once it does not (``hung``).

A vLLM whose engine core is frozen (SIGSTOP, a stuck kernel or worker) keeps its API server answering
``/health`` and ``/metrics`` with 200; its gauges stay at their last values and requests sent to it are accepted
and never answered. Only a lack of progress shows it.

**Progress** is any one of, for this engine:
- between two successful scrapes of its ``/metrics``: ``vllm:generation_tokens_total``,
  ``vllm:prompt_tokens_total`` or ``vllm:num_preemptions_total`` moved, ``vllm:num_requests_running`` or
  ``vllm:kv_cache_usage_perc`` changed, or ``vllm:num_requests_waiting`` fell (arrivals are not progress: a
  frozen engine's API server still queues them);
- a chunk on any of the gateway's open streams to it;
- an answer that completed through the gateway (a whole answer read: an engine that answers at once never moves
  a stream, and a stand-in engine may publish no moving metrics at all);
- a probe answered (below).

**A long prefill is not a hang.** In vLLM V1 (read in 0.32: ``v1/metrics/stats.py``, ``loggers.py``,
``engine/async_llm.py``) prompt tokens are counted when a request's prefill completes, with its first token,
and ``vllm:iteration_tokens_total`` is observed only for steps that produced output: neither moves while a long
prompt is prefilled chunk by chunk. What does move is the scheduler's stats, sent with every step: each chunk
allocates the KV blocks it fills, so ``vllm:kv_cache_usage_perc`` rises chunk by chunk, and that is why KV usage
is a signal. One step (a chunk, or a whole prompt with chunked prefill off) publishes nothing until it ends, so
the bound must exceed the longest step: seconds, not the scrape interval (``--hang-timeout``, 15 s by default).

**Work** is requests of the gateway in flight to this engine, or running or waiting requests in its latest
successful scrape. Without work nothing is judged, and the clock starts when work appears. When nothing moved
for half the bound, one probe (a one-token completion, sent straight to the engine) asks whether the engine
still answers: vLLM publishes its gauges only when it steps, so requests aborted by their clients can leave
``running > 0`` behind on an idle engine, and a live engine answers the probe and moves its counters.

**A busy API server is not a frozen engine.** vLLM's API server is one event loop: a large ``/tokenize`` or a
burst of requests can hold it for seconds, during which it answers nothing (scrapes late or failed, streams
silent) while the engine core keeps generating; the movement shows once the loop is free. A frozen engine core is
the opposite: its API server answers scrapes at once, with gauges that do not move. So the bound applies as it is
while the latest scrape was answered promptly (within ``LATE_SCRAPE``); while the API server answers late or not
at all, the bound is ``BUSY_FACTOR`` times longer (a server frozen whole, or deadlocked, with the gateway's
requests waiting on it is still called hung, later).

**Hung** after the whole bound without progress: ``/health`` answers 503 (state ``hung``), new requests get
503 ``upstream_hung`` with ``Retry-After`` at once, requests in flight are cut (a stream with an error event,
others with the 503). While hung a probe goes out every third of the bound; the engine rejoins when one is
answered or its metrics move again (a restarted engine's counters start again from zero: movement too); chunks
the cut streams still read from their buffers are not movement.

The detector runs in proxy mode only. A managed engine has the supervisor's watchdog, whose cure is a restart
(``gateway/managed/watchdog.py``); the detector there is built but not started, and never reports a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TypedDict

from gateway.engine.live import EngineSnapshot
from gateway.errors import UpstreamHung
from gateway.metrics import Metrics
from gateway.periodic import Periodic, cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_HANG_TIMEOUT = 15.0
# A scrape answered later than this after it was sent says the API server is busy: vLLM renders /metrics in
# milliseconds, and a frozen engine core leaves its API server as quick as ever.
LATE_SCRAPE = 1.0
# While the API server answers late or not at all, the bound is this many times --hang-timeout.
BUSY_FACTOR = 3.0
# Sends a probe to the engine with a time limit; True when the engine answered it.
Probe = Callable[[float], Awaitable[bool]]
Abort = Callable[[UpstreamHung], None]


@dataclass(frozen=True, slots=True)
class Reading:
    """What progress is judged from in one successful scrape."""

    running: int | None
    waiting: int | None
    generation_tokens: float | None
    prompt_tokens: float | None
    preemptions: float | None
    kv_usage: float | None

    @property
    def busy(self) -> bool:
        return (self.running or 0) > 0 or (self.waiting or 0) > 0


def reading_of(snapshot: EngineSnapshot) -> Reading | None:
    if not snapshot.ok or not snapshot.has_metrics:
        return None
    return Reading(
        snapshot.running, snapshot.waiting, snapshot.generation_tokens_total, snapshot.prompt_tokens_total,
        snapshot.preemptions_total, snapshot.kv_usage,
    )


def moved(old: Reading, new: Reading) -> bool:
    """Whether the engine did anything between two readings (see the module's docstring)."""
    fell = old.waiting is not None and new.waiting is not None and new.waiting < old.waiting
    return fell or (
        (new.generation_tokens, new.prompt_tokens, new.preemptions, new.running, new.kv_usage)
        != (old.generation_tokens, old.prompt_tokens, old.preemptions, old.running, old.kv_usage)
    )


class ProgressStatus(TypedDict):
    """The detector's part of ``/guard/status``."""

    hung: bool
    hang_timeout: float
    stalled_seconds: float
    in_flight: int
    hangs: int
    detail: str | None


class Forward(Protocol):
    """Where a worker process's detector tells what it sees of an engine (streams opened less closed, chunks,
    whole answers): the authority, whose detector for that engine judges for every process."""

    def __call__(self, *, opened: int = 0, chunks: int = 0, answers: int = 0) -> None: ...


class ProgressDetector:
    """Judges one engine's progress on a timer (``tick``) from what the exchange and the engine view tell it,
    and cuts the requests in flight when it declares the engine hung.

    In a worker process of ``--workers`` it is given ``forward``: it then judges nothing itself (its timer is
    never started), passes what it sees to the authority, and applies the authority's judgement (``mirror``)."""

    def __init__(
        self,
        timeout: float = DEFAULT_HANG_TIMEOUT,
        *,
        metrics: Metrics | None = None,
        probe: Probe | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        forward: Forward | None = None,
    ) -> None:
        self.timeout = timeout
        self._forward = forward
        self.probe = probe
        self._metrics = metrics
        self._clock = clock
        self.in_flight = 0  # the gateway's requests open to this engine
        self.hangs = 0
        self.hung_since: float | None = None
        self.detail: str | None = None
        self.on_change: Callable[[], None] = lambda: None  # with --workers: the authority tells its workers at once
        self._since = clock()  # the last progress, or when work appeared
        self._events = 0  # stream chunks seen, read and compared by tick
        self._events_seen = 0
        self.answers = 0  # whole answers completed through the gateway, compared by tick (and the watchdog)
        self._answers_seen = 0
        self._late = False  # the latest scrape was answered late or not at all
        self._answered_at: float | None = None  # when the latest scrape's answer (or failure) came
        self._cadence = 0.0  # the pause between one scrape's answer and the next scrape
        self._moved = False  # set between ticks by a scrape that moved or a probe answered
        self._reading: Reading | None = None  # the latest scrape's, None after a failed one
        self._last_reading: Reading | None = None  # the latest successful scrape's, kept to compare the next with
        self._watchers: dict[int, Abort] = {}
        self._ids = itertools.count()
        self._last_probe: float | None = None
        self._probing: asyncio.Task[None] | None = None
        self._timer = Periodic(
            lambda: self.tick(), lambda: min(1.0, self.timeout / 10), name="engine-progress",
            failed="the engine progress check crashed", logger=log, sleep=sleep,
        )

    @property
    def hung(self) -> bool:
        return self.hung_since is not None

    @property
    def retry_after(self) -> float:
        """How long a refused client should wait: until the next probe could have seen the engine back."""
        return max(1.0, self.timeout / 3)

    # -- what the gateway sees -------------------------------------------------------------------------
    def observe(self, old: EngineSnapshot, new: EngineSnapshot) -> None:
        """An engine view listener: each successful scrape, compared with the last successful one."""
        now = self._clock()
        if self._answered_at is not None:
            self._cadence = max(0.0, new.taken_at - self._answered_at)
        self._answered_at = now
        self._late = not new.ok or now - new.taken_at > LATE_SCRAPE
        reading = reading_of(new)
        if reading is None:
            # A failed scrape says nothing of movement, and the last one's running count is no longer the engine's
            # work: an engine gone (killed, restarting) is down, not hung; only the gateway's own requests on it
            # still count as work.
            self._reading = None
            return
        # Compared across failed scrapes: a busy API server's first answer after them shows what moved meanwhile.
        if self._last_reading is not None and moved(self._last_reading, reading):
            self._moved = True
        self._reading = self._last_reading = reading

    def opened(self) -> None:
        self.in_flight += 1
        if self._forward is not None:
            self._forward(opened=1)

    def closed(self) -> None:
        self.in_flight -= 1
        if self._forward is not None:
            self._forward(opened=-1)

    def stream_moved(self) -> None:
        """Bytes arrived on one of the engine's streams (called once a read: a counter, compared on tick)."""
        if self._forward is None:
            self._events += 1
        else:
            self._forward(chunks=1)

    def note_remote(self, opened: int, chunks: int, answers: int) -> None:
        """What another worker process saw of this engine since it last said (streams opened less closed,
        chunks, whole answers): the judgement here sees every process's requests (``workers/authority.py``)."""
        self.in_flight += opened
        self._events += chunks
        self.answers += answers

    def answered(self) -> None:
        """A whole answer of the engine's was read (the gateway's request completed): the engine did its work."""
        self.answers += 1
        if self._forward is not None:
            self._forward(answers=1)

    @property
    def bound(self) -> float:
        """Seconds without progress, while work runs, that make the engine hung: longer while its API server is
        busy (see the module's docstring)."""
        return self.timeout * BUSY_FACTOR if self.api_server_busy() else self.timeout

    def api_server_busy(self) -> bool:
        """Whether the engine's API server answers its scrapes late or not at all: the latest one came late or
        failed, or the one now due has waited longer than ``LATE_SCRAPE`` (the scrapes' own cadence aside)."""
        if self._answered_at is None:
            return False
        return self._late or self._clock() - self._answered_at > self._cadence + LATE_SCRAPE

    def has_work(self) -> bool:
        return self.in_flight > 0 or (self._reading is not None and self._reading.busy)

    def mirror(self, hung: bool, detail: str | None) -> None:
        """A worker's detector: the authority's judgement, applied here. Becoming hung cuts this process's
        requests in flight to the engine as the judgement does where it is made."""
        if hung and self.hung_since is None:
            self.hung_since = self._clock()
            self.detail = detail
            cut = self.error(cut=True)
            for abort in list(self._watchers.values()):
                abort(cut)
        elif not hung:
            self.hung_since, self.detail = None, None

    # -- the judgement ---------------------------------------------------------------------------------
    def tick(self) -> None:
        now = self._clock()
        # While hung no new stream opens: chunks then are what the cut streams had buffered before the freeze
        # (read after the cut), not movement.
        progressed = (
            self._moved or self.answers != self._answers_seen or (not self.hung and self._events != self._events_seen)
        )
        self._moved, self._events_seen, self._answers_seen = False, self._events, self.answers
        if progressed:
            self._since = now
            if self.hung:
                self._rejoin(now)
        elif self.hung:
            self._maybe_probe(now, every=self.retry_after)
        elif not self.has_work():
            self._since = now
        elif now - self._since >= self.bound:
            self._declare(now)
        elif now - self._since >= self.timeout / 2:
            self._maybe_probe(now, every=self.timeout / 2)

    def stalled_seconds(self) -> float:
        if not self.hung and not self.has_work():
            return 0.0
        return max(0.0, self._clock() - self._since)

    def _declare(self, now: float) -> None:
        stalled = now - self._since
        self.hung_since = now
        self.hangs += 1
        busy = f", x{BUSY_FACTOR:g} while its API server answered late or not at all" if self.api_server_busy() else ""
        self.detail = (
            f"no progress for {stalled:.1f} s while {self._work()} (limit --hang-timeout {self.timeout:g} s{busy})"
        )
        log.warning("the engine is hung: %s; refusing new requests and cutting %d in flight",
                    self.detail, len(self._watchers))
        if self._metrics is not None:
            self._metrics.record_engine_hung(True)
        cut = self.error(cut=True)
        for abort in list(self._watchers.values()):
            abort(cut)
        self.on_change()

    def _rejoin(self, now: float) -> None:
        assert self.hung_since is not None
        log.warning("the engine moved again after %.1f s hung; it takes requests again", now - self.hung_since)
        self.hung_since, self.detail = None, None
        self._last_probe = None
        if self._metrics is not None:
            self._metrics.record_engine_hung(False)
        self.on_change()

    def _work(self) -> str:
        r = self._reading
        engine = f"the engine reports {r.running or 0} running and {r.waiting or 0} waiting" if r else ""
        ours = f"{self.in_flight} requests of the gateway were in flight" if self.in_flight else ""
        return " and ".join(part for part in (ours, engine) if part) or "work ran"

    def error(self, *, cut: bool = False) -> UpstreamHung:
        what = "this request was cut" if cut else "requests are refused until it moves again"
        return UpstreamHung(
            f"The engine is hung: {self.detail}; {what}. Retry shortly.", retry_after=self.retry_after
        )

    # -- refusing and cutting --------------------------------------------------------------------------
    def refuse_if_hung(self) -> None:
        if self.hung:
            raise self.error()

    def watch(self, abort: Abort) -> int:
        """Call ``abort`` with the error when the engine is declared hung; returns the token for ``unwatch``."""
        token = next(self._ids)
        self._watchers[token] = abort
        return token

    def unwatch(self, token: int) -> None:
        self._watchers.pop(token, None)

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Around one wait of the current task on the engine (a request sent, an answer read): refused at once
        while hung, and ended with ``UpstreamHung`` when the engine is declared hung meanwhile."""
        self.refuse_if_hung()
        task = asyncio.current_task()
        if task is None:
            yield
            return
        cut: list[UpstreamHung] = []

        def abort(error: UpstreamHung) -> None:
            cut.append(error)
            task.cancel()

        token = self.watch(abort)
        try:
            yield
        except asyncio.CancelledError:
            # Cancelled for another reason as well (its client went away): that cancellation goes on.
            if not cut or task.uncancel() > 0:
                raise
            raise cut[0] from None
        finally:
            self.unwatch(token)

    # -- probing ---------------------------------------------------------------------------------------
    def _maybe_probe(self, now: float, *, every: float) -> None:
        if self.probe is None or (self._probing is not None and not self._probing.done()):
            return
        if self._last_probe is not None and now - self._last_probe < every:
            return
        self._last_probe = now
        self._probing = asyncio.get_running_loop().create_task(self._probe_once(self.probe), name="engine-probe")

    async def _probe_once(self, probe: Probe) -> None:
        try:
            answered = await probe(self.timeout)
        except Exception:
            log.exception("the engine probe failed")
            answered = False
        if answered:
            self._moved = True

    # -- the timer -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._timer.start()

    async def stop(self) -> None:
        await self._timer.stop()
        probing, self._probing = self._probing, None
        await cancel_and_wait(probing)

    def status(self) -> ProgressStatus:
        return {
            "hung": self.hung, "hang_timeout": self.timeout, "stalled_seconds": round(self.stalled_seconds(), 1),
            "in_flight": self.in_flight, "hangs": self.hangs, "detail": self.detail,
        }
