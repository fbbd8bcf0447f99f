"""One worker process of ``--workers N`` (started by the admission authority, ``http/workers.py``).

It serves the guarded routes itself, with the request path of one process (``workers/assembly.py`` gives it the
authority's admission), and forwards every other route to the authority's private app socket: the gateway's
own routes answer from the one view of the engines, the books and the tenants. It reads its settings from its
standard input, binds the gateway's port beside the others (``SO_REUSEPORT``) once its parts are ready, and
stops when told (SIGTERM: uvicorn's graceful shutdown) or when its authority goes away.

    python -m gateway.http.worker_main --index N --channel SOCKET --private SOCKET   (settings JSON on stdin)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

import orjson
from starlette.datastructures import State
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.errors import GatewayError, PayloadTooLarge, UpstreamTimeout, UpstreamUnavailable
from gateway.headers import HOP_BY_HOP
from gateway.http.app import GuardedFastPath
from gateway.http.errors import error_response
from gateway.http.routes import RouteTable
from gateway.http.serving import build_server, listening_socket
from gateway.http.stream_out import HeldBytes
from gateway.observe.process_logging import install_logging
from gateway.workers.assembly import build_worker_parts
from gateway.workers.liveness import CODE
from gateway.workers.messages import Serving
from gateway.workers.remote import AuthorityClient

log = logging.getLogger(__name__)

# One hop's headers, as ASGI's bytes: never forwarded either way. Credentials are: the authority checks them.
_HOP = frozenset(name.encode() for name in HOP_BY_HOP)
# Seconds the authority is given to answer a worker's /health: past them the worker answers 503 itself (a probe
# must learn that this process cannot admit, not wait with it).
HEALTH_WITHIN = 2.0


class ToAuthority:
    """Every route but the guarded ones, forwarded to the authority's app over its private socket."""

    def __init__(self, settings: Settings, private: str, client: AuthorityClient | None = None) -> None:
        self.state = State()
        self._settings = settings
        self._client = client
        self._upstream = Upstream(settings, base_url=lambda: "unix:" + private, credentials=True)

    async def start(self) -> None:
        await self._upstream.start()

    async def close(self) -> None:
        await self._upstream.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        health = scope["path"] == "/health"
        refusal = self._client.refusal() if self._client is not None else None
        if refusal is not None:  # an authority gone or frozen: this worker says so itself, at once
            reply = unhealthy(refusal.message, refusal.retry_after) if health else error_response(refusal)
            await reply(scope, receive, send)
            return
        try:
            body = await self._body(receive)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k not in _HOP}
            path = scope.get("raw_path") or scope["path"].encode()
            if scope.get("query_string"):
                path += b"?" + scope["query_string"]
            stream = await self._upstream.open(scope["method"], path.decode("latin-1"), body=body or None,
                                               headers=headers, timeout=HEALTH_WITHIN if health else None)
        except GatewayError as exc:
            if health:
                reason = (
                    f"this gateway worker's admission authority did not answer /health within {HEALTH_WITHIN:g} s"
                    if isinstance(exc, UpstreamTimeout) else f"this gateway worker's /health failed: {exc.message}"
                )
                await unhealthy(reason, 1.0)(scope, receive, send)
            else:
                await error_response(exc)(scope, receive, send)
            return
        except (OSError, RuntimeError):  # the private socket broke under the request: the authority's, not a 500
            log.exception("forwarding %s to the authority failed", scope["path"])
            await error_response(UpstreamUnavailable(
                "This gateway worker could not reach its admission authority; retry shortly.", retry_after=1
            ))(scope, receive, send)
            return
        try:
            out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in stream.headers.items()
                   if k.lower().encode("latin-1") not in _HOP]
            await send({"type": "http.response.start", "status": stream.status, "headers": out})
            async for chunk in stream.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except GatewayError as exc:
            log.warning("forwarding %s to the authority broke: %s", scope["path"], exc.message)
        finally:
            stream.close()

    async def _body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return b""
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._settings.max_body_bytes:
                raise PayloadTooLarge(
                    f"The request body exceeds the limit of {self._settings.max_body_bytes} bytes.",
                    close_connection=True,
                )
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def unhealthy(reason: str, retry_after: float | None) -> Response:
    """``/health`` as the worker answers it when its authority cannot: 503, and why."""
    body = {"status": "unavailable", "gateway": CODE, "reason": reason}
    headers = {"retry-after": str(max(1, round(retry_after)))} if retry_after is not None else None
    return Response(orjson.dumps(body), status_code=503, media_type="application/json", headers=headers)


async def run(settings: Settings, channel: str, private: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        parts, client = await build_worker_parts(settings, stack, channel)
        forward = ToAuthority(settings, private, client)
        await forward.start()
        stack.push_async_callback(forward.close)
        forward.state.parts = parts
        app = GuardedFastPath(forward, RouteTable(settings.passthrough_route), HeldBytes(
            settings.max_total_buffered_bytes
        ))
        server = build_server(app, settings, lifespan="off")
        sock = listening_socket(settings, shared=True)  # bound only now: no connection waits for the start-up

        async def orphaned() -> None:
            await client.lost.wait()
            log.warning("the admission authority went away; this worker stops")
            server.should_exit = True

        async def serving() -> None:
            while not server.started:  # noqa: ASYNC110 - uvicorn says it started only as a flag
                await asyncio.sleep(0.01)
            client.send(Serving())  # the authority counts it among the processes that serve

        watch = asyncio.create_task(orphaned(), name="worker-orphaned")
        told = asyncio.create_task(serving(), name="worker-serving")
        try:
            await server.serve(sockets=[sock])
        finally:
            watch.cancel()
            told.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway.http.worker_main")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--channel", required=True)
    parser.add_argument("--private", required=True)
    args = parser.parse_args(argv)
    settings = Settings.model_validate_json(sys.stdin.read())
    access = install_logging(settings)
    try:
        import uvloop

        uvloop.run(run(settings, args.channel, args.private))
    except KeyboardInterrupt:
        pass
    finally:
        if access is not None:
            access.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
