"""The hang detector: an engine is hung only when nothing moves while work runs, for the whole bound; it is
refused and its requests in flight are cut then, and it rejoins when it moves again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pytest

from gateway.engine.live import EngineSnapshot, never_scraped
from gateway.engine.progress import BUSY_FACTOR, ProgressDetector, Reading, moved, reading_of
from gateway.errors import UpstreamHung
from gateway.metrics import Metrics
from tests.support.clock import FakeClock, ManualSleep

TIMEOUT = 10.0


def snapshot(**kw: float | int | None) -> EngineSnapshot:
    base = replace(
        never_scraped(0.0), ok=True, has_metrics=True, running=0, waiting=0, generation_tokens_total=100.0,
        prompt_tokens_total=1000.0, preemptions_total=0.0, kv_usage=0.0,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


class Engine:
    """The detector with what feeds it: a clock, the engine's scrapes, the gateway's requests and streams."""

    def __init__(self) -> None:
        self.clock = FakeClock(0.0)
        self.metrics = Metrics()
        self.detector = ProgressDetector(TIMEOUT, metrics=self.metrics, clock=self.clock)
        self.last = snapshot()
        self.detector.observe(self.last, self.last)

    def scrape(self, late: float = 0.0, **kw: float | int | None) -> None:
        """A successful scrape answered ``late`` seconds after it was sent (0: at once)."""
        new = replace(self.last, taken_at=self.clock.now - late, **kw)  # type: ignore[arg-type]
        self.detector.observe(self.last, new)
        self.last = new

    def after(self, seconds: float, *, answering: bool = True, **scrape: float | int | None) -> None:
        """Let ``seconds`` pass in one-second ticks, the engine's API server answering a scrape at once in each
        (``answering``), the changes in ``scrape`` arriving with the first."""
        for i in range(int(seconds)):
            if answering:
                self.scrape(**(scrape if i == 0 else {}))
            self.clock.now += 1.0
            self.detector.tick()

    def hung_gauge(self) -> float | None:
        return self.metrics.registry.get_sample_value("vllm_guard_engine_hung")


@pytest.mark.parametrize(
    ("case", "engine_running", "gateway_requests", "stream_moves", "scrape_moves", "hung"),
    [
        ("counters and streams still while requests run", 3, 2, False, False, True),
        ("counters still, the engine reports running requests, nothing of the gateway's", 2, 0, False, False, True),
        ("counters still, only the gateway's requests in flight (the frozen gauges say 0)", 0, 1, False, False, True),
        ("counters still but a stream moves", 1, 1, True, False, False),
        ("streams still but the counters move", 1, 1, False, True, False),
        ("no work at all: nothing runs, nothing is judged", 0, 0, False, False, False),
    ],
)
def test_an_engine_is_hung_only_when_nothing_moves_while_work_runs(
    case: str, engine_running: int, gateway_requests: int, stream_moves: bool, scrape_moves: bool, hung: bool
) -> None:
    e = Engine()
    e.scrape(running=engine_running)
    for _ in range(gateway_requests):
        e.detector.opened()
    for second in range(int(TIMEOUT) + 2):
        if stream_moves:
            e.detector.stream_moved()
        if scrape_moves:
            e.scrape(generation_tokens_total=200.0 + second)
        e.after(1)
    assert e.detector.hung is hung, case
    assert e.hung_gauge() == (1.0 if hung else 0.0)


def test_the_hang_is_declared_at_the_bound_and_not_before() -> None:
    e = Engine()
    e.after(1, running=1)  # work appearing is the engine's last movement
    e.after(TIMEOUT - 1)
    assert not e.detector.hung and e.detector.stalled_seconds() == TIMEOUT - 1
    e.after(1)
    assert e.detector.hung
    assert e.detector.detail is not None and "limit --hang-timeout 10 s" in e.detector.detail


def test_the_clock_starts_when_work_appears_not_when_the_engine_last_moved() -> None:
    e = Engine()
    e.after(100)  # idle for long
    e.detector.opened()
    e.after(TIMEOUT - 1)
    assert not e.detector.hung


@pytest.mark.parametrize(
    ("case", "chunk"),
    [
        # vLLM counts prompt tokens only when a prefill completes; each chunk allocates the blocks it fills.
        ("each chunk of a long prefill raises KV usage", {"kv_usage": None}),
        ("a waiting request is scheduled", {"waiting": None}),
    ],
)
def test_a_long_prefill_is_not_a_hang(case: str, chunk: dict[str, None]) -> None:
    e = Engine()
    e.scrape(running=1, waiting=40)
    e.detector.opened()
    for step in range(1, 4 * int(TIMEOUT)):
        moves: dict[str, float | int | None] = (
            {"kv_usage": step / 100} if "kv_usage" in chunk else {"waiting": max(0, 40 - step)}
        )
        e.after(TIMEOUT / 2, **moves)  # one step every half bound, each moving only that signal
    assert not e.detector.hung, case


def test_arrivals_alone_are_not_progress() -> None:
    e = Engine()
    e.scrape(running=2)
    for waiting in range(1, int(TIMEOUT) + 2):
        e.after(1, waiting=waiting)  # a frozen engine's API server still queues new requests
    assert e.detector.hung


def test_failed_scrapes_neither_move_nor_reset_the_clock_while_the_gateways_requests_run() -> None:
    # An API server that answers nothing (frozen whole, deadlocked) with the gateway's requests waiting on it: hung,
    # after the longer bound of a server that may only be busy.
    e = Engine()
    e.scrape(running=1)
    e.detector.opened()
    for _ in range(int(TIMEOUT * BUSY_FACTOR) + 1):
        e.detector.observe(e.last, never_scraped(e.clock.now))
        e.after(1, answering=False)
    assert e.detector.hung
    assert e.detector.detail is not None and "answered late or not at all" in e.detector.detail


@pytest.mark.parametrize(
    ("case", "scrape"),
    [
        ("scrapes fail (timed out)", lambda e: e.detector.observe(e.last, never_scraped(e.clock.now - 5.0))),
        ("scrapes answered 9 s late", lambda e: e.scrape(late=9.0)),
        ("a scrape sent and not answered yet", lambda e: None),
    ],
)
def test_a_busy_api_server_is_not_hung_within_the_bound(case: str, scrape: Callable[[Engine], None]) -> None:
    # vLLM's one event loop held by a large /tokenize: nothing answers in time, though the engine core generates.
    e = Engine()
    e.scrape(running=2)
    e.detector.opened()
    for _ in range(2 * int(TIMEOUT)):
        scrape(e)
        e.after(1, answering=False)
    assert not e.detector.hung, case
    e.after(1, generation_tokens_total=500.0)  # the loop is free again: the engine moved all along
    assert not e.detector.hung and e.detector.stalled_seconds() <= 1.0


def test_once_its_api_server_answers_promptly_again_a_still_engine_is_hung_at_the_bound() -> None:
    e = Engine()
    e.scrape(running=2)
    e.detector.opened()
    for _ in range(int(TIMEOUT) + 1):
        e.scrape(late=9.0)
        e.after(1, answering=False)
    assert not e.detector.hung
    e.scrape()  # answered at once, and nothing moved: a frozen engine core, not a busy API server
    e.after(1)
    assert e.detector.hung and e.detector.detail is not None and "late" not in e.detector.detail


def test_answers_completing_through_the_gateway_are_progress_though_the_metrics_never_move() -> None:
    # A stand-in engine answering at once: nothing ever shows running, no stream moves, its counters never change.
    e = Engine()
    for _ in range(4 * int(TIMEOUT)):
        for _ in range(64):
            e.detector.opened()
        for _ in range(64):
            e.detector.answered()
            e.detector.closed()
        e.detector.opened()  # 64 concurrent: one is always in flight when the detector looks
        e.after(1)
        e.detector.closed()
    assert not e.detector.hung


def test_answers_that_stop_completing_leave_the_hang_to_be_declared() -> None:
    e = Engine()
    e.detector.opened()
    e.detector.answered()
    e.after(1)
    e.after(int(TIMEOUT))
    assert e.detector.hung


def test_an_engine_that_stops_answering_scrapes_with_none_of_the_gateways_requests_is_down_not_hung() -> None:
    # Killed or restarting: its last scrape's running requests are no longer work anyone waits for.
    e = Engine()
    e.scrape(running=2)
    for _ in range(3 * int(TIMEOUT)):
        e.detector.observe(e.last, never_scraped(e.clock.now))
        e.after(1, answering=False)
    assert not e.detector.hung


@pytest.mark.parametrize(
    ("case", "change", "is_movement"),
    [
        ("generated tokens", {"generation_tokens": 101.0}, True),
        ("prompt tokens", {"prompt_tokens": 1001.0}, True),
        ("preemptions", {"preemptions": 1.0}, True),
        ("running requests up or down", {"running": 4}, True),
        ("KV usage", {"kv_usage": 0.26}, True),
        ("waiting falls", {"waiting": 1}, True),
        ("waiting rises", {"waiting": 3}, False),
        ("counters restarted from zero", {"generation_tokens": 0.0, "prompt_tokens": 0.0}, True),
        ("nothing", {}, False),
    ],
)
def test_what_counts_as_movement(case: str, change: dict[str, float], is_movement: bool) -> None:
    old = Reading(running=3, waiting=2, generation_tokens=100.0, prompt_tokens=1000.0, preemptions=0.0, kv_usage=0.25)
    assert moved(old, replace(old, **change)) is is_movement, case  # type: ignore[arg-type]


def test_a_snapshot_without_metrics_gives_no_reading() -> None:
    assert reading_of(never_scraped(0.0)) is None
    assert reading_of(replace(snapshot(), has_metrics=False)) is None


def test_a_hung_engine_refuses_new_requests_with_retry_after() -> None:
    e = Engine()
    e.detector.refuse_if_hung()  # not hung: nothing raised
    e.scrape(running=1)
    e.after(TIMEOUT + 1)
    with pytest.raises(UpstreamHung) as refused:
        e.detector.refuse_if_hung()
    assert refused.value.code == "upstream_hung" and refused.value.retry_after == pytest.approx(TIMEOUT / 3)
    assert "limit --hang-timeout 10 s" in refused.value.message


@pytest.mark.parametrize(
    ("case", "moves"),
    [
        ("its counters move again (SIGCONT)", {"generation_tokens_total": 101.0}),
        ("it comes back restarted (counters from zero, nothing running)", {
            "generation_tokens_total": 0.0, "prompt_tokens_total": 0.0, "running": 0,
        }),
    ],
)
def test_a_hung_engine_rejoins_when_it_moves_again(case: str, moves: dict[str, float]) -> None:
    e = Engine()
    e.scrape(running=3)
    e.after(TIMEOUT + 1)
    e.after(30)  # stays hung while nothing moves, with or without work
    assert e.detector.hung
    e.after(1, **moves)
    assert not e.detector.hung, case
    assert e.hung_gauge() == 0.0 and e.detector.hangs == 1


def test_chunks_read_by_the_cut_streams_after_the_declaration_do_not_rejoin() -> None:
    e = Engine()
    e.detector.opened()
    e.after(TIMEOUT + 1)
    assert e.detector.hung
    e.detector.stream_moved()  # buffered before the freeze, read after the cut
    e.after(TIMEOUT)
    assert e.detector.hung and e.detector.hangs == 1


def test_watchers_are_cut_once_when_the_hang_is_declared() -> None:
    e = Engine()
    cut: list[UpstreamHung] = []
    token = e.detector.watch(cut.append)
    gone = e.detector.watch(cut.append)
    e.detector.unwatch(gone)
    e.detector.opened()
    e.after(TIMEOUT + 5)
    assert len(cut) == 1 and "this request was cut" in cut[0].message
    e.detector.unwatch(token)


async def test_a_wait_on_the_engine_ends_with_the_hang_error() -> None:
    e = Engine()
    e.detector.opened()
    started = asyncio.Event()

    async def send() -> None:
        with e.detector.interruptible():
            started.set()
            await asyncio.Event().wait()  # an answer that never comes

    task = asyncio.create_task(send())
    await started.wait()
    e.after(TIMEOUT + 1)
    with pytest.raises(UpstreamHung):
        await task
    assert not task.cancelled()


async def test_a_wait_cancelled_for_another_reason_stays_cancelled() -> None:
    e = Engine()
    e.detector.opened()
    started = asyncio.Event()

    async def send() -> None:
        with e.detector.interruptible():
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(send())
    await started.wait()
    task.cancel()  # the client went away
    e.after(TIMEOUT + 1)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_wait_is_refused_at_once_while_hung() -> None:
    e = Engine()
    e.scrape(running=1)
    e.after(TIMEOUT + 1)
    with pytest.raises(UpstreamHung), e.detector.interruptible():
        pytest.fail("the wait began on a hung engine")


class Probe:
    def __init__(self) -> None:
        self.calls: list[float] = []
        self.answer = False

    async def __call__(self, timeout: float) -> bool:
        self.calls.append(timeout)
        return self.answer


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_stale_gauges_on_an_idle_engine_are_cleared_by_a_probe() -> None:
    e = Engine()
    probe = e.detector.probe = Probe()
    probe.answer = True
    e.scrape(running=2)  # left behind by requests aborted while the engine went idle
    e.after(TIMEOUT / 2 + 1)
    await settle()
    assert probe.calls == [TIMEOUT]
    for _ in range(3 * int(TIMEOUT)):  # the gauges never change; each answered probe is the engine's movement
        e.after(1)
        await settle()
        assert not e.detector.hung
    assert len(probe.calls) >= 3


async def test_a_hung_engine_is_probed_every_third_of_the_bound_and_rejoins_when_one_is_answered() -> None:
    e = Engine()
    probe = e.detector.probe = Probe()
    e.scrape(running=2)
    e.after(TIMEOUT + 1)
    await settle()
    assert e.detector.hung
    calls = len(probe.calls)
    e.after(TIMEOUT + 1)
    await settle()
    assert len(probe.calls) > calls and e.detector.hung
    probe.answer = True
    e.after(TIMEOUT / 3 + 1)
    await settle()
    e.after(1)
    assert not e.detector.hung


async def test_the_timer_ticks_until_stopped_and_its_tasks_are_awaited() -> None:
    clock, sleep = FakeClock(0.0), ManualSleep()
    detector = ProgressDetector(TIMEOUT, clock=clock, sleep=sleep)
    detector.opened()
    await detector.start()
    for _ in range(int(TIMEOUT) + 1):
        clock.now += 1.0
        await sleep.wake_and_run()
    assert detector.hung and sleep.delays[0] == pytest.approx(1.0)
    await detector.stop()
    assert not detector._timer.running
