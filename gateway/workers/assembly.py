"""A worker process's parts: its own clients to the engines, tokenizers and metrics; the authority's admission,
tenant limits and view of the engines (``remote.py``, ``mirror.py``).

What a worker counts, checks and relays it does itself, on its own core; what must be one for the whole gateway
(the KV books, the queue, the tenants' windows, the engines' health and the managed engines) it asks of, or
learns from, the authority. Its engines' views are never started (the authority scrapes), and its progress
detectors judge nothing: they pass what this process sees (streams opened and closed, chunks, whole answers) to
the authority, whose detectors judge, and apply the authority's judgement here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.engine.engine import Engine
from gateway.engine.live import EngineView
from gateway.engine.progress import ProgressDetector
from gateway.guard.models import Models
from gateway.guard.parts import Parts
from gateway.metrics import Metrics
from gateway.workers.access_log import ForwardedAccessLog
from gateway.workers.mirror import MirroredEngine, SupervisorMirror
from gateway.workers.remote import AuthorityClient, RemoteAdmission, RemoteTenants


def _base_url(settings: Settings, supervisors: list[SupervisorMirror], i: int) -> Callable[[], str]:
    """Engine ``i``'s URL: a managed engine's as the authority last said (it moves with restarts)."""
    if settings.managed:
        sup = supervisors[i]
        return lambda: sup.url
    url = settings.upstream[i]
    return lambda: url


async def build_worker_parts(
    settings: Settings, stack: contextlib.AsyncExitStack, channel: str
) -> tuple[Parts, AuthorityClient]:
    metrics = Metrics()
    executor = stack.enter_context(ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize"))
    client = AuthorityClient(None, settings)  # type: ignore[arg-type]  # its parts are set below
    count = settings.engine_count() if settings.managed else len(settings.upstream)
    supervisors = [SupervisorMirror() for _ in range(count)] if settings.managed else []
    client.supervisors = supervisors
    engines: list[Engine[Models]] = []
    for i in range(count):
        upstream = Upstream(settings, base_url=_base_url(settings, supervisors, i))
        await upstream.start()
        stack.push_async_callback(upstream.close)
        models = Models(settings, upstream, metrics, executor)
        stack.push_async_callback(models.templates.close)
        stack.push_async_callback(models.close)
        view = EngineView(
            upstream.get, interval=settings.scrape_interval, stale_after=settings.metrics_stale_after, metrics=metrics
        )
        # Judged by the authority: what this process sees goes there, batched by the client.
        progress = ProgressDetector(settings.hang_timeout, metrics=metrics, forward=partial(client.engine_moved, i))
        engines.append(MirroredEngine(upstream, models, view, progress))
    tenants = RemoteTenants(settings, metrics, client)
    parts = Parts(
        settings, metrics, engines[0], RemoteAdmission(client, settings), tenants=tenants, engines=engines,
        supervisors=supervisors,  # type: ignore[arg-type]
        supervisor=supervisors[0] if supervisors else None,  # type: ignore[arg-type]
    )
    client.parts = parts
    for engine in engines:
        engine.fingerprint.on_learn = client.flush  # learned here: the authority and the others are told at once
    access_log = parts.access_log = ForwardedAccessLog(settings.access_log, client)
    await tenants.start()  # the keys file, reloaded on change
    stack.push_async_callback(tenants.close)
    await client.connect(channel)
    stack.push_async_callback(client.close)
    # Stopped before the channel closes (the stack unwinds last in, first out): its last lines go out on it.
    stack.callback(access_log.stop)
    if engines[0].models.cached is not None:
        with contextlib.suppress(Exception):
            await engines[0].models.counter()  # the tokenizer now, not on the first request
    return parts, client
