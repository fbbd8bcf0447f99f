"""``create_app(settings)``: the ASGI app. Its lifespan assembles the parts (``assembly.py``); the guarded routes
are served by ``GuardedFastPath`` ahead of FastAPI, the gateway's own by ``handlers.py``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.datastructures import State
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocketClose

from gateway import __version__
from gateway.config import Settings
from gateway.errors import GatewayError
from gateway.guard.parts import Parts
from gateway.http.assembly import build_parts
from gateway.http.context import GuardedRequest
from gateway.http.errors import error_response, install_handlers, internal_error_response
from gateway.http.handlers import add_routes
from gateway.http.relay import serve_guarded
from gateway.http.routes import Route, RouteTable
from gateway.http.stream_out import HeldBytes
from gateway.http.workers import WorkerPlan, WorkerPool
from gateway.workers.authority import Authority

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


def create_app(settings: Settings, plan: WorkerPlan | None = None) -> GuardedFastPath:
    """``plan``: with ``--workers``, this app is the admission authority and starts the other workers."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            parts = await build_parts(settings, stack)
            app.state.parts = parts
            if plan is not None:
                await start_workers(parts, settings, plan, stack)
            yield

    app = FastAPI(
        title="vllm-guard", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
        openapi_url=None,
    )
    install_handlers(app)
    table = RouteTable(settings.passthrough_route)
    add_routes(app, table)
    # Outermost, ahead of Starlette's own middleware: a guarded request meets no layer it does not need.
    return GuardedFastPath(app, table, HeldBytes(settings.max_total_buffered_bytes))


async def start_workers(parts: Parts, settings: Settings, plan: WorkerPlan, stack: contextlib.AsyncExitStack) -> None:
    """The authority's channel, then the worker processes (stopped first on shutdown, then the channel)."""
    authority = Authority(parts, plan.channel)
    await authority.start()
    stack.push_async_callback(authority.close)
    parts.worker_metrics = authority.worker_metrics
    parts.authority = authority
    pool = WorkerPool(settings, plan)
    await pool.start()
    log.info("admission authority %s; %d worker process(es) serve port %d", "apart (it serves no request itself)"
             if plan.apart else "serving its share of the port", plan.workers, settings.port)
    stack.push_async_callback(pool.stop)


class GuardedFastPath:
    """Routes every request by its canonical path (routing.py), before anything else reads the path.

    Refused and unknown paths get 404, known paths with another method 405. The guarded routes are served
    straight from the ASGI scope, ahead of FastAPI's routing, dependency and exception layers, which measured
    ~30% of the gateway's CPU per request for endpoints that read the raw body and turn every error into a
    response themselves (relay.serve_guarded). The rest go to FastAPI with the path replaced by the canonical
    one, and the query string kept only where it is forwarded (the pass-through routes).
    """

    def __init__(self, app: Any, table: RouteTable, held: HeldBytes) -> None:
        self.app = app
        self.table = table
        self.held = held  # the bytes all streams hold for slow readers, bounded together

    @property
    def state(self) -> State:
        """The app's state: ``parts`` once its lifespan has assembled them."""
        state: State = self.app.state
        return state

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
        scope["app"] = self.app  # as Starlette sets it: the handlers find the app's parts through it
        request = GuardedRequest(scope, receive, send)
        try:
            response = await serve_guarded(self.app.state.parts, request, route.name, route.path, self.held)
        except Exception:
            response = internal_error_response(request)
        await response(scope, receive, send)
