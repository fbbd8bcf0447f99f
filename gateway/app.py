"""create_app(settings): the lifespan builds the parts and wires them; routes stay thin."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from . import __version__, director
from .admission import Admission
from .config import Settings
from .director import Parts
from .engine import EngineSnapshot, EngineView
from .errors import GatewayError, InvalidRequest, install_handlers, internal_error_response
from .metrics import Metrics
from .models import Models
from .upstream import Upstream

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            parts = await build_parts(settings, stack)
            app.state.parts = parts
            yield

    app = FastAPI(
        title="vllm-guard", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
        openapi_url=None,
    )
    install_handlers(app)
    add_routes(app)
    app.add_middleware(GuardedFastPath)
    return app


class GuardedFastPath:
    """Serves the two guarded routes straight from the ASGI scope, ahead of FastAPI's routing, dependency and
    exception layers, which measured ~30% of the gateway's CPU per request for endpoints that read the raw body
    and turn every error into a response themselves (director.guarded). Everything else goes to FastAPI."""

    ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await director.guarded(scope["app"].state.parts, request, route)
        except Exception:
            response = internal_error_response(request)
        await response(scope, receive, send)


async def build_parts(settings: Settings, stack: contextlib.AsyncExitStack) -> Parts:
    metrics = Metrics()
    # Tokenization threads: the work holds the GIL only partly (the Rust tokenizer releases it).
    executor = stack.enter_context(ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize"))
    supervisor: Any = None
    if settings.managed:
        from .supervisor import Supervisor

        supervisor = Supervisor(settings, metrics)
    upstream = Upstream(settings, base_url=(lambda: supervisor.url) if supervisor is not None else None)
    await upstream.start()
    stack.push_async_callback(upstream.close)

    engine = EngineView(
        upstream.get, interval=settings.scrape_interval, stale_after=settings.metrics_stale_after, metrics=metrics
    )
    admission = Admission(settings, engine, metrics)
    stack.push_async_callback(admission.close)
    models = Models(settings, upstream, metrics, executor)
    parts = Parts(settings, metrics, upstream, models, admission, supervisor, engine)

    refreshing: set[asyncio.Task[None]] = set()

    def on_snapshot(old: EngineSnapshot, new: EngineSnapshot) -> None:
        if supervisor is None:
            metrics.set_upstream_state("ready" if new.ok else "down")
        cached = models.cached
        if new.ok and new.max_model_len is not None and (cached is None or cached.max_model_len != new.max_model_len):
            # The engine came back with another context length (a restart, an auto-fit): re-read the listing.
            # The loop keeps only weak references to tasks: hold this one until it is done.
            task = asyncio.get_running_loop().create_task(_refresh_quietly(models))
            refreshing.add(task)
            task.add_done_callback(refreshing.discard)

    engine.on_snapshot(on_snapshot)

    if supervisor is not None:
        supervisor.admission = admission
        supervisor.engine = engine
        stack.push_async_callback(supervisor.stop)
        task = asyncio.get_running_loop().create_task(_run_managed(supervisor, models))
        stack.callback(task.cancel)
    else:
        with contextlib.suppress(GatewayError):
            await models.refresh()
        if models.cached is None:
            log.warning("the upstream %s is not reachable yet; requests get 503 until it is", settings.upstream)
    await engine.start()
    stack.push_async_callback(engine.stop)
    if models.cached is not None:
        # Load the tokenizer now rather than on the first request.
        with contextlib.suppress(GatewayError):
            await models.counter()
    freeze_heap()
    return parts


def freeze_heap() -> None:
    """Keep the start-up heap (transformers, the tokenizer: ~400K objects) out of garbage collection.

    A full collection over it took ~200 ms here, and under load one fell on a request every few hundred:
    measured, it was most of the gateway's CPU time per request. Objects created later are still collected.
    """
    gc.collect()
    gc.freeze()


async def _refresh_quietly(models: Models) -> None:
    with contextlib.suppress(GatewayError):
        await models.refresh()


async def _run_managed(supervisor: Any, models: Models) -> None:
    try:
        await supervisor.start()
        await models.refresh()
        await models.counter()
        freeze_heap()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("the managed engine did not start; requests get 503 until POST /guard/restart mends it")
    # Watch even after a failed start: a manual restart brings the engine back under supervision.
    await supervisor.run()


def upstream_status(parts: Parts) -> dict[str, Any]:
    info = parts.models.cached
    sup: Any = parts.supervisor
    if sup is not None:
        state, restarts, reason = sup.state, sup.restarts, sup.last_restart_reason
        url = sup.url
    else:
        engine = parts.engine
        fresh = engine is not None and engine.snapshot.ok and not engine.is_stale()
        state = "ready" if info is not None and fresh else "down"
        restarts, reason, url = 0, None, parts.settings.upstream
    return {
        "url": url,
        "state": state,
        "max_model_len": info.max_model_len if info else None,
        "effective_max_model_len": _effective(parts),
        "model": info.ids[0] if info and info.ids else None,
        "last_restart_reason": reason,
        "restarts": restarts,
    }


def _effective(parts: Parts) -> int | None:
    from .limits import effective_max_model_len

    info = parts.models.cached
    return effective_max_model_len(info.max_model_len if info else None, parts.settings.max_model_len)


def add_routes(app: FastAPI) -> None:
    def parts_of(request: Request) -> Parts:
        parts: Parts = request.app.state.parts
        return parts

    # POST /v1/chat/completions and /v1/completions are served by GuardedFastPath.

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await director.list_models(parts_of(request), request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        parts = parts_of(request)
        up = upstream_status(parts)
        ready = up["state"] == "ready"
        body = {"status": "ok" if ready else "unavailable", "gateway": "ok", "upstream": up}
        return Response(orjson.dumps(body), status_code=200 if ready else 503, media_type="application/json")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        parts = parts_of(request)
        parts.admission.status()  # refreshes the KV and queue gauges
        data, ctype = parts.metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/guard/status")
    async def status(request: Request) -> Response:
        parts = parts_of(request)
        director.authenticate(parts, request)
        up = upstream_status(parts)
        body = {**parts.admission.status(), "upstream": up, "restarts": up["restarts"]}
        if parts.supervisor is not None:
            body["engine"] = parts.supervisor.status()  # type: ignore[attr-defined]
        return Response(orjson.dumps(body), media_type="application/json")

    @app.post("/guard/restart")
    async def restart(request: Request) -> Response:
        parts = parts_of(request)
        director.authenticate(parts, request, admin=True)
        sup: Any = parts.supervisor
        if sup is None:
            raise InvalidRequest("Restart needs managed mode (--managed); this gateway guards an external engine.")
        asyncio.get_running_loop().create_task(sup.restart("manual"))
        return Response(orjson.dumps({"restarting": True}), status_code=202, media_type="application/json")

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def v1_other(request: Request, path: str) -> Response:
        return await director.passthrough(parts_of(request), request, "/v1/" + path)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await director.passthrough(parts_of(request), request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await director.passthrough(parts_of(request), request, "/detokenize")
