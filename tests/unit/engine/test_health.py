"""Whether an engine takes new requests, one judgement for /health and admission (``Engine.refusal``): down when
two scrapes in a row failed (one failure, or an old snapshot, says nothing: a busy host's late loop makes both)
or its own /health answers 5xx; hung when the hang detector says so; ready otherwise."""

from __future__ import annotations

import pytest

from gateway.engine.engine import Engine
from gateway.engine.health import HEALTH_PATH, EngineHealth
from gateway.engine.live import FAILED_SCRAPES_DOWN, EngineView
from gateway.engine.models import ServedModels
from gateway.engine.progress import ProgressDetector
from gateway.errors import UpstreamHung, UpstreamUnavailable
from gateway.metrics import Metrics

PAGE = b'vllm:num_requests_running{engine="0"} 0\n'


class Upstream:
    """Answers /metrics and /health as told; ``refuse`` makes every call fail like a refused connection."""

    def __init__(self) -> None:
        self.metrics_status, self.health_status, self.refuse = 200, 200, False
        self.calls: list[str] = []

    async def __call__(self, path: str) -> tuple[int, bytes]:
        self.calls.append(path)
        if self.refuse:
            raise ConnectionRefusedError("connect refused")
        return (self.health_status, b"") if path == HEALTH_PATH else (self.metrics_status, PAGE)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def engine_over(upstream: Upstream, clock: Clock) -> Engine[ServedModels]:
    view = EngineView(upstream, interval=0.25, stale_after=2.0, metrics=Metrics(), clock=clock)
    return Engine(
        client=None,  # type: ignore[arg-type]  # nothing here sends a request
        models=None,  # type: ignore[arg-type]
        view=view, progress=ProgressDetector(clock=clock), health=EngineHealth(upstream),
    )


async def test_an_engine_is_ready_while_its_scrapes_and_health_answer() -> None:
    upstream, clock = Upstream(), Clock()
    engine = engine_over(upstream, clock)
    await engine.view.refresh()
    await engine.health.check()
    assert engine.refusal() is None and engine.usable() and not engine.down()


@pytest.mark.parametrize("how", ["refused", "http-500", "http-404"])
async def test_it_is_down_after_two_failed_scrapes_in_a_row_not_one(how: str) -> None:
    upstream, clock = Upstream(), Clock()
    engine = engine_over(upstream, clock)
    await engine.view.refresh()
    upstream.refuse = how == "refused"
    upstream.metrics_status = {"http-500": 500, "http-404": 404}.get(how, 200)
    for failed in range(1, FAILED_SCRAPES_DOWN + 1):
        await engine.view.refresh()
        assert engine.usable() is (failed < FAILED_SCRAPES_DOWN), failed
    refusal = engine.refusal()
    assert isinstance(refusal, UpstreamUnavailable) and not isinstance(refusal, UpstreamHung)
    assert refusal.retry_after is not None and refusal.retry_after >= 1
    assert "scrapes of /metrics failed" in refusal.message
    upstream.refuse, upstream.metrics_status = False, 200
    await engine.view.refresh()  # one answered scrape: ready again
    assert engine.usable()


async def test_an_old_snapshot_alone_is_no_reason_to_refuse() -> None:
    """A busy host's loop ran late: every snapshot aged meanwhile, the engine was fine."""
    upstream, clock = Upstream(), Clock()
    engine = engine_over(upstream, clock)
    await engine.view.refresh()
    clock.now += 30.0
    assert engine.view.is_stale() and engine.usable()


@pytest.mark.parametrize(("status", "ready"), [(200, True), (503, False), (500, False), (404, True)])
async def test_its_own_health_answering_5xx_makes_it_down(status: int, ready: bool) -> None:
    upstream, clock = Upstream(), Clock()
    engine = engine_over(upstream, clock)
    await engine.view.refresh()
    upstream.health_status = status
    await engine.health.check()
    assert engine.usable() is ready and engine.down() is (not ready)
    if not ready:
        refusal = engine.refusal()
        assert refusal is not None and f"/health answered HTTP {status}" in refusal.message
    upstream.refuse = True  # a health check that cannot ask says nothing: the verdict stays
    await engine.health.check()
    assert engine.usable() is ready


async def test_a_hung_engine_is_refused_with_the_hang_detectors_error() -> None:
    upstream, clock = Upstream(), Clock()
    engine = engine_over(upstream, clock)
    await engine.view.refresh()
    engine.progress.hung_since, engine.progress.detail = clock.now, "no progress for 15.0 s"
    refusal = engine.refusal()
    assert isinstance(refusal, UpstreamHung) and refusal.code == "upstream_hung" and not engine.usable()


async def test_a_health_checker_without_a_fetch_never_asks_and_never_refuses() -> None:
    health = EngineHealth()
    await health.check()
    await health.start()
    await health.stop()
    assert not health.unhealthy and health.status is None
