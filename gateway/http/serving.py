"""How the gateway's server is built and bound: uvicorn with the gateway's protocol (``server.GuardProtocol``),
on the gateway's port (with ``--workers``, one socket per process, ``SO_REUSEPORT``) and, for the admission
authority, on its private app socket (``workers.WorkerPlan``)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from gateway.config import Settings
from gateway.http.accept import BurstAcceptor
from gateway.http.limits import ConnectionLimits
from gateway.http.server import GuardProtocol
from gateway.http.workers import WorkerPlan


def protocol_class(limits: ConnectionLimits) -> type[GuardProtocol]:
    """uvicorn builds one protocol per connection from a class: this one carries ``limits``."""
    return type("GuardProtocol", (GuardProtocol,), {"limits": limits, "_body_first": limits.body.due(0)})


def server_config(app: ASGIApp, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration the gateway serves with; tests override only what a test needs (log level)."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "access_log": False,
        "timeout_graceful_shutdown": 10,
        "lifespan": "on",
        "loop": "auto",  # uvloop when installed
        "http": protocol_class(ConnectionLimits.of(settings)),
        "ws": "none",  # the gateway serves no websockets: one protocol less to reach
        # The gateway does not read forwarded-for headers nor needs Server/Date headers; each cost per request.
        "proxy_headers": False,
        "server_header": False,
        "date_header": False,
    }
    options.update(overrides)
    return uvicorn.Config(app, **options)


class GatewayServer(uvicorn.Server):
    """uvicorn's server, its TCP ports also accepted in bursts (``accept.BurstAcceptor``): libuv takes one new
    connection a loop turn, and a turn of a loaded gateway takes milliseconds."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.acceptors: list[BurstAcceptor] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started or not sockets:
            return
        config, state, app_state = self.config, self.server_state, self.lifespan.state

        def factory() -> asyncio.Protocol:  # the protocol uvicorn's own startup builds for its servers, as it does
            return config.http_protocol_class(config=config, server_state=state, app_state=app_state)  # type: ignore[call-arg]

        loop = asyncio.get_running_loop()
        for sock in sockets:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                acceptor = BurstAcceptor(sock, factory)
                acceptor.start(loop)
                self.acceptors.append(acceptor)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for acceptor in self.acceptors:
            acceptor.stop()
        self.acceptors.clear()
        await super().shutdown(sockets=sockets)


def build_server(app: ASGIApp, settings: Settings, **overrides: Any) -> GatewayServer:
    return GatewayServer(server_config(app, settings, **overrides))


def listening_socket(settings: Settings, *, shared: bool) -> socket.socket:
    """The gateway's port, bound (``shared``: with ``SO_REUSEPORT``, one socket per process)."""
    sock = _bound(settings, shared=shared)
    sock.listen(2048)
    return sock


def _bound(settings: Settings, *, shared: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((settings.host, settings.port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def private_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(2048)
    return sock


def sockets_for(settings: Settings, plan: WorkerPlan | None) -> list[socket.socket]:
    """The sockets the authority's server serves: the port, and with workers its private app socket (that
    alone for an authority apart: its workers hold the port)."""
    if plan is None:
        return [listening_socket(settings, shared=False)]
    if plan.apart:
        # Its workers bind the port; a port another program holds is said here, at the start, as a serving
        # authority's own bind would say it (a worker's failed bind would only be retried, and the gateway wait).
        _bound(settings, shared=True).close()  # bound, never listening: no connection is ever queued on it
        return [private_socket(plan.private)]
    return [listening_socket(settings, shared=True), private_socket(plan.private)]
