"""The gateway's own routes (models, health, metrics, status, restart, the live page) and the pass-through
routes, added to the app at their canonical paths. Guarded routes never reach here: ``app.GuardedFastPath``
serves them, and has already refused every unknown path and method."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.errors import InvalidRequest
from gateway.guard.parts import Parts
from gateway.guard.status import engines_status, publish_pool_metrics, upstream_status
from gateway.http import passthrough, tokenization, ui
from gateway.http.auth import authenticate
from gateway.http.routes import RouteTable
from gateway.workers.metrics_merge import render_merged

Handler = Callable[[Request], Awaitable[Response]]


def parts_of(request: Request) -> Parts:
    parts: Parts = request.app.state.parts
    return parts


def json(body: object, status_code: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status_code, media_type="application/json")


async def list_models(request: Request) -> Response:
    return await passthrough.list_models(parts_of(request), request)


async def health(request: Request) -> Response:
    """The readiness route: 503 unless the engine is ready (starting, restarting, draining, down, or hung)."""
    up = upstream_status(parts_of(request))
    ready = up["state"] == "ready"
    body = {"status": "ok" if ready else "unavailable", "gateway": "ok", "upstream": up}
    return json(body, 200 if ready else 503)


async def metrics(request: Request) -> Response:
    parts = parts_of(request)
    parts.local_admission().publish()  # the gauges that move with time (freshness, live usage), as of this read
    publish_pool_metrics(parts)
    if parts.worker_metrics is None:
        data, ctype = parts.metrics.render()
    else:  # with --workers: every process's requests, added up
        data, ctype = render_merged(parts.metrics, await parts.worker_metrics())
    return Response(data, media_type=ctype)


async def status(request: Request) -> Response:
    parts = parts_of(request)
    authenticate(parts.settings, request)
    up = upstream_status(parts)
    admission = parts.local_admission().status()
    admission["engines"] = engines_status(parts, admission["engines"])
    body: dict[str, object] = {**admission, "upstream": up, "restarts": up["restarts"]}
    if parts.supervisor is not None:
        body["engine"] = parts.supervisor.status()
    if len(sups := parts.every_supervisor()) > 1:
        body["managed_engines"] = [s.status() for s in sups]
    if parts.rolling is not None:
        body["rolling_restart"] = parts.rolling.status()
    return json(body)


async def restart(request: Request) -> Response:
    """Restart the managed engine; with several, one at a time while the others serve (``?engine=N``: that one)."""
    parts = parts_of(request)
    authenticate(parts.settings, request, admin=True)
    if parts.rolling is None:  # built with the supervisors
        raise InvalidRequest("Restart needs managed mode (--managed); this gateway guards an external engine.")
    named = request.query_params.get("engine")
    names = parts.rolling.names()
    if named is not None and named not in names:
        raise InvalidRequest(f"No engine {named!r}: the engines are {', '.join(names)}.", param="engine")
    engines, started = parts.rolling.request(None if named is None else [named])
    body = {"restarting": True, "engines": engines, "rolling": len(names) > 1, "already_under_way": not started}
    return json(body, 202)


async def usage(request: Request) -> Response:
    """Each tenant's usage, for billing (admin key): by tenant name, never by key."""
    parts = parts_of(request)
    authenticate(parts.settings, request, admin=True)
    tenants = parts.local_tenants()
    return json(tenants.report() if tenants is not None else {"tenants": {}})


def live_page() -> Handler:
    html = ui.load_page()  # read once, at start-up

    async def page(request: Request) -> Response:
        return ui.page(html)

    return page


async def live_data(request: Request) -> Response:
    parts = parts_of(request)
    return ui.data(parts.settings, request, parts.sampler, dict(upstream_status(parts)))


def forwarding(path: str) -> Handler:
    bounded = tokenization.HANDLERS.get(path)  # /tokenize, /detokenize: counted and bounded by the gateway

    async def forward(request: Request) -> Response:
        if bounded is not None:
            return await bounded(parts_of(request), request)
        return await passthrough.passthrough(parts_of(request), request, path)

    return forward


def add_routes(app: FastAPI, table: RouteTable) -> None:
    handlers: dict[str, Handler] = {
        "models": list_models, "health": health, "metrics": metrics, "status": status, "restart": restart,
        "usage": usage, "ui": live_page(), "ui_data": live_data,
    }
    for route in table.routes():
        if route.kind == "gateway":
            app.add_api_route(route.path, handlers[route.name], methods=[route.method], name=route.name)
        elif route.kind == "passthrough":
            app.add_api_route(route.path, forwarding(route.path), methods=[route.method], name=route.path)
