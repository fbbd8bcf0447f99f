"""Assembling the gateway at start-up: the engine (client, served models, metrics view), its admission, the
supervisor in managed mode, the live page's sampler. Every part is closed by the exit stack it is built on,
in reverse order, and every background task is owned and awaited there."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from gateway.admission import Admission
from gateway.admission.engine_control import EngineControl
from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.engine.engine import Engine
from gateway.engine.health import EngineHealth
from gateway.engine.live import EngineSnapshot, EngineView
from gateway.engine.probe import completion_probe
from gateway.engine.progress import ProgressDetector
from gateway.errors import ConfigInvalid, GatewayError
from gateway.guard.models import Models
from gateway.guard.parts import Parts
from gateway.guard.status import upstream_status
from gateway.managed.lifecycle import EngineLifecycle
from gateway.managed.tasks import OwnedTasks
from gateway.metrics import Metrics
from gateway.observe.history import History, Sampler
from gateway.observe.loop_lag import LoopLag
from gateway.observe.trace_export import start_tracing
from gateway.redact import redact_url
from gateway.tenants import Tenants

if TYPE_CHECKING:
    from gateway.managed.supervisor import Supervisor

log = logging.getLogger(__name__)


async def build_parts(settings: Settings, stack: contextlib.AsyncExitStack) -> Parts:
    metrics = Metrics()
    supervisors = _supervisors(settings, metrics)
    # Tokenization threads: the work holds the GIL only partly (the Rust tokenizer releases it).
    executor = stack.enter_context(ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize"))
    # Each engine but the first keeps its own gauges (freshness, hung), which would overwrite the first's:
    # /guard/status shows them.
    if supervisors:
        engines = [
            await build_engine(settings, metrics if i == 0 else Metrics(), stack, sup, executor)
            for i, sup in enumerate(supervisors)
        ]
    else:
        engines = [await build_engine(settings, metrics, stack, None, executor)]
        for url in settings.upstream[1:]:
            engines.append(await build_engine(settings, Metrics(), stack, None, executor, url=url))
    engine = engines[0]
    admission = Admission(
        settings, engine.view, metrics, engines=[e.view for e in engines],
        usable=lambda i: engines[i].usable() and engines[i].serves_like(engine),
    )
    stack.push_async_callback(admission.close)
    tenants = await build_tenants(settings, metrics, stack)
    parts = Parts(
        settings, metrics, engine, admission, supervisors[0] if supervisors else None, tenants=tenants,
        engines=engines, supervisors=supervisors,
    )
    parts.tracing = start_tracing(settings)
    stack.push_async_callback(parts.tracing.close)  # spans still buffered are exported on shutdown
    if supervisors:
        manage(parts, stack)
    else:
        for each in engines:
            await _read_models_once(each)
        check_same_model(engines)
        for each in engines:
            await _scrape_once(each)
        for each in engines:
            # Proxy mode only: a managed engine's hang and health are the supervisor's, cured by a restart.
            await each.progress.start()
            stack.push_async_callback(each.progress.stop)
            await each.health.start()
            stack.push_async_callback(each.health.stop)
    for each in engines:
        await each.view.start()
        stack.push_async_callback(each.view.stop)
    # The live page's history: one sample a second in the background, nothing on the request path.
    parts.sampler = Sampler(History(), metrics, admission.status, lambda: dict(upstream_status(parts)))
    await parts.sampler.start()
    stack.push_async_callback(parts.sampler.stop)
    if engine.models.cached is not None:
        # Load the tokenizer now rather than on the first request.
        with contextlib.suppress(GatewayError):
            await engine.models.counter()
    # The loop's lag, measured as long as the app runs.
    lag = LoopLag(metrics.record_loop_lag)
    await lag.start()
    stack.push_async_callback(lag.stop)
    freeze_heap()
    return parts


async def build_engine(
    settings: Settings, metrics: Metrics, stack: contextlib.AsyncExitStack, supervisor: Supervisor | None,
    executor: ThreadPoolExecutor, *, url: str | None = None,
) -> Engine[Models]:
    """The engine's one HTTP client, its served models (with the tokenizer loader) and its metrics view; ``url``:
    another engine than the first ``--upstream``."""
    base_url = (lambda: supervisor.url) if supervisor is not None else (lambda: url) if url is not None else None
    client = Upstream(settings, base_url=base_url)
    await client.start()
    stack.push_async_callback(client.close)
    view = EngineView(
        client.get, interval=settings.scrape_interval, stale_after=settings.metrics_stale_after, metrics=metrics
    )
    models = Models(settings, client, metrics, executor)
    stack.push_async_callback(models.templates.close)
    stack.push_async_callback(models.close)
    health = EngineHealth(client.get)
    if supervisor is None:

        def on_snapshot(old: EngineSnapshot, new: EngineSnapshot) -> None:
            # As /health judges it (Engine.down): one failed scrape is not yet down.
            up = view.answering() and not health.unhealthy
            metrics.set_upstream_state(EngineLifecycle.READY if up else EngineLifecycle.DOWN)

        view.on_snapshot(on_snapshot)
    # An engine back from an outage may serve another context length (a restart, an auto-fit).
    view.on_snapshot(models.follow)
    progress = ProgressDetector(settings.hang_timeout, metrics=metrics)
    progress.probe = lambda timeout: completion_probe(client, _served_model(models), timeout)
    view.on_snapshot(progress.observe)
    return Engine(client, models, view, progress, view.queue_cap, health=health)


def _served_model(models: Models) -> str | None:
    listing = models.cached
    return listing.ids[0] if listing is not None and listing.ids else None


async def build_tenants(settings: Settings, metrics: Metrics, stack: contextlib.AsyncExitStack) -> Tenants:
    """The keys file (its reload task) and the tenants' limits (the Redis client), closed on shutdown."""
    tenants = Tenants(settings, metrics)
    await tenants.start()
    stack.push_async_callback(tenants.close)
    return tenants


def _supervisors(settings: Settings, metrics: Metrics) -> list[Supervisor]:
    """Managed mode: one supervisor per engine, each with its GPUs when ``--engine-devices`` splits them."""
    if not settings.managed:
        return []
    from gateway.managed.supervisor import Supervisor

    count, groups = settings.engine_count(), settings.device_groups()
    devices = groups if len(groups) == count else [groups[0] if groups else None] * count
    return [Supervisor(settings, metrics, index=i, devices=devices[i]) for i in range(count)]


def manage(parts: Parts, stack: contextlib.AsyncExitStack) -> None:
    """Start and watch each managed engine, each on its own: one engine's restart holds only that engine's
    requests (``EngineControl``) while the others serve; restarts asked for or scheduled roll one at a time."""
    from gateway.managed.rolling import RollingRestarts

    sups, settings = parts.supervisors, parts.settings
    for i, (sup, engine) in enumerate(zip(sups, parts.engines, strict=True)):
        admission = parts.local_admission()
        sup.admission = admission if len(sups) == 1 else EngineControl(admission, i)
        sup.engine = engine  # its metrics and the answers completed through the gateway
        stack.push_async_callback(sup.stop)
    # With one engine a turn restarts it in place; with several, one at a time while the others serve.
    parts.rolling = RollingRestarts(sups, every=settings.restart_every, ready_timeout=settings.startup_timeout)
    parts.rolling.start()
    stack.push_async_callback(parts.rolling.close)
    # Cancelled and awaited on shutdown, before the supervisors stop their engines.
    managing = OwnedTasks()
    for i, (sup, engine) in enumerate(zip(sups, parts.engines, strict=True)):
        managing.spawn(_run_managed(sup, engine.models, first=None if i == 0 else parts.models))
    stack.push_async_callback(managing.close)


# Seconds the start waits for an engine's first scrape (its metrics answer in milliseconds when it is up).
FIRST_SCRAPE_WAIT = 2.0


async def _scrape_once(engine: Engine[Models]) -> None:
    """One scrape of an engine that answered at start, before serving: until the engine's capacity is known every
    request fits (the policy cannot bound what it cannot count), so a flood in the first scrape went straight into
    the engine (31 preemptions of 40 requests, tests/integration/test_admission_flood.py). An engine whose metrics
    do not answer delays the start by FIRST_SCRAPE_WAIT at most."""
    if engine.models.cached is None:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(FIRST_SCRAPE_WAIT):
            await engine.view.refresh()


async def _read_models_once(engine: Engine[Models]) -> None:
    with contextlib.suppress(GatewayError):
        await engine.models.refresh()
    if engine.models.cached is None:
        log.warning("the upstream %s is not reachable yet; requests get 503 until it is", redact_url(engine.url))


def check_same_model(engines: list[Engine[Models]]) -> None:
    """Every engine reachable at start serves what the first serves (the models and their context length):
    requests are counted and clamped once, for any of them."""
    first = engines[0].models.cached
    if first is None:  # the first is not up yet: what another serves is the listing until it is
        first = next((e.models.cached for e in engines[1:] if e.models.cached is not None), None)
        if first is not None:
            engines[0].models.update(first)
    for engine in engines[1:]:
        other = engine.models.cached
        if first is not None and other is not None and not engine.serves_like(engines[0]):
            raise ConfigInvalid(
                f"--upstream {redact_url(engine.url)} serves {other.ids} with max_model_len {other.max_model_len}, "
                f"but {redact_url(engines[0].url)} serves {first.ids} with max_model_len {first.max_model_len}: "
                "every engine must serve the same model with the same limits"
            )


# The cyclic collector's thresholds once the start-up heap is frozen. A request leaves a few hundred container
# objects behind for a while (the token piece cache, the learned lengths, the live page's samples), so at
# Python's default (700) a young collection ran every two or three requests; measured with callgrind at one
# short chat at a time, 3,498K instructions a request at the default against 3,032K at these.
GC_THRESHOLDS = (20_000, 50, 50)


def freeze_heap() -> None:
    """Keep the start-up heap (transformers, the tokenizer: ~400K objects) out of garbage collection.

    A full collection over it took ~200 ms here, and under load one fell on a request every few hundred:
    measured, it was most of the gateway's CPU time per request. Objects created later are still collected.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _run_managed(supervisor: Supervisor, models: Models, *, first: Models | None = None) -> None:
    """Start and watch one managed engine. The first engine's tokenizer counts every request (loaded once it
    serves); ``first``: that engine's models, for another engine, whose listing stands in while the first has none
    (it has not come up yet)."""
    try:
        await supervisor.start()
        listing = await models.refresh()
        if first is None:
            await models.counter()
            freeze_heap()
        elif first.cached is None:
            first.update(listing)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("the managed engine did not start; requests get 503 until POST /guard/restart mends it")
    # Watch even after a failed start: a manual restart brings the engine back under supervision.
    await supervisor.run()
