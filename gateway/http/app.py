"""create_app(settings): the lifespan builds the parts and wires them; routes stay thin."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from gateway import __version__
from gateway.admission.controller import Admission
from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.engine.live import EngineSnapshot, EngineView
from gateway.errors import GatewayError, InvalidRequest, error_response, install_handlers, internal_error_response
from gateway.guard import pipeline as director
from gateway.guard.models import Models
from gateway.guard.parts import Parts
from gateway.http import passthrough, ui
from gateway.http.auth import authenticate
from gateway.http.routes import Route, RouteTable
from gateway.metrics import Metrics
from gateway.observe.history import History, Sampler
from gateway.redact import redact_url

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
    table = RouteTable(settings.passthrough_route)
    add_routes(app, table)
    app.add_middleware(GuardedFastPath, table=table)
    return app


class GuardedFastPath:
    """Routes every request by its canonical path (routing.py), before anything else reads the path.

    Refused and unknown paths get 404, known paths with another method 405. The guarded routes are served
    straight from the ASGI scope, ahead of FastAPI's routing, dependency and exception layers, which measured
    ~30% of the gateway's CPU per request for endpoints that read the raw body and turn every error into a
    response themselves (director.guarded). The rest go to FastAPI with the path replaced by the canonical
    one, and the query string kept only where it is forwarded (the pass-through routes).
    """

    def __init__(self, app: ASGIApp, table: RouteTable) -> None:
        self.app = app
        self.table = table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":  # vLLM's realtime audio generates unguarded: never served
                await WebSocketClose()(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        try:
            route = self.table.resolve(scope["method"], scope.get("raw_path"), scope["path"])
        except GatewayError as exc:
            await error_response(exc)(scope, receive, send)
            return
        if route.kind == "guarded":
            await self._guarded(route, scope, receive, send)
            return
        canonical = {**scope, "path": route.path, "raw_path": route.path.encode()}
        if route.kind != "passthrough" and not route.query:
            canonical["query_string"] = b""
        await self.app(canonical, receive, send)

    async def _guarded(self, route: Route, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await director.guarded(scope["app"].state.parts, request, route.name, route.path)
        except Exception:
            response = internal_error_response(request)
        await response(scope, receive, send)


async def build_parts(settings: Settings, stack: contextlib.AsyncExitStack) -> Parts:
    metrics = Metrics()
    # Tokenization threads: the work holds the GIL only partly (the Rust tokenizer releases it).
    executor = stack.enter_context(ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize"))
    supervisor: Any = None
    if settings.managed:
        from gateway.managed.supervisor import Supervisor

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
    stack.push_async_callback(models.templates.close)
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
            log.warning(
                "the upstream %s is not reachable yet; requests get 503 until it is", redact_url(settings.upstream)
            )
    await engine.start()
    stack.push_async_callback(engine.stop)
    # The live page's history: one sample a second in the background, nothing on the request path.
    parts.sampler = Sampler(History(), metrics, admission.status, lambda: upstream_status(parts))
    await parts.sampler.start()
    stack.push_async_callback(parts.sampler.stop)
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
        "url": redact_url(url),
        "state": state,
        "max_model_len": info.max_model_len if info else None,
        "effective_max_model_len": _effective(parts),
        "model": info.ids[0] if info and info.ids else None,
        "last_restart_reason": reason,
        "restarts": restarts,
    }


def _effective(parts: Parts) -> int | None:
    from gateway.guard.policy import effective_max_model_len

    info = parts.models.cached
    return effective_max_model_len(info.max_model_len if info else None, parts.settings.max_model_len)


def add_routes(app: FastAPI, table: RouteTable) -> None:
    """The gateway's own and pass-through routes of ``table``, at their canonical paths (GuardedFastPath
    serves the guarded ones and has already refused everything else)."""

    def parts_of(request: Request) -> Parts:
        parts: Parts = request.app.state.parts
        return parts

    async def list_models(request: Request) -> Response:
        return await passthrough.list_models(parts_of(request), request)

    async def health(request: Request) -> Response:
        parts = parts_of(request)
        up = upstream_status(parts)
        ready = up["state"] == "ready"
        body = {"status": "ok" if ready else "unavailable", "gateway": "ok", "upstream": up}
        return Response(orjson.dumps(body), status_code=200 if ready else 503, media_type="application/json")

    async def metrics(request: Request) -> Response:
        parts = parts_of(request)
        parts.admission.status()  # refreshes the KV and queue gauges
        data, ctype = parts.metrics.render()
        return Response(data, media_type=ctype)

    async def status(request: Request) -> Response:
        parts = parts_of(request)
        authenticate(parts.settings, request)
        up = upstream_status(parts)
        body = {**parts.admission.status(), "upstream": up, "restarts": up["restarts"]}
        if parts.supervisor is not None:
            body["engine"] = parts.supervisor.status()  # type: ignore[attr-defined]
        return Response(orjson.dumps(body), media_type="application/json")

    async def restart(request: Request) -> Response:
        parts = parts_of(request)
        authenticate(parts.settings, request, admin=True)
        sup: Any = parts.supervisor
        if sup is None:
            raise InvalidRequest("Restart needs managed mode (--managed); this gateway guards an external engine.")
        asyncio.get_running_loop().create_task(sup.restart("manual"))
        return Response(orjson.dumps({"restarting": True}), status_code=202, media_type="application/json")

    html = ui.load_page()

    async def ui_page(request: Request) -> Response:
        return ui.page(html)

    async def ui_data(request: Request) -> Response:
        parts = parts_of(request)
        return ui.data(parts.settings, request, parts.sampler, upstream_status(parts))

    def forwarding(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def forward(request: Request) -> Response:
            return await passthrough.passthrough(parts_of(request), request, path)

        return forward

    handlers = {
        "models": list_models, "health": health, "metrics": metrics, "status": status, "restart": restart,
        "ui": ui_page, "ui_data": ui_data,
    }
    for route in table.routes():
        if route.kind == "gateway":
            app.add_api_route(route.path, handlers[route.name], methods=[route.method], name=route.name)
        elif route.kind == "passthrough":
            app.add_api_route(route.path, forwarding(route.path), methods=[route.method], name=route.path)
