"""A round-robin HTTP forwarder: each POST goes to the next of its upstreams in turn and its answer is streamed
back as it comes. The baseline of ``python -m bench run servers-prefix``: placement that ignores prompts,
behind one proxy hop in its own process, as the gateway is.

    python -m bench.servers.round_robin --port 8100 http://127.0.0.1:8000 http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Mapping, Sequence

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

# Headers that describe one hop's connection or framing, not the message: each side sets its own.
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
SESSION = web.AppKey("session", ClientSession)


def end_to_end(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def build_app(upstreams: Sequence[str]) -> web.Application:
    turn = itertools.cycle(upstreams)

    async def open_session(app: web.Application) -> None:
        # No total timeout and no connection cap: the upstreams' own limits are what is measured.
        app[SESSION] = ClientSession(
            timeout=ClientTimeout(total=None), connector=TCPConnector(limit=0), auto_decompress=False
        )

    async def close_session(app: web.Application) -> None:
        await app[SESSION].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        # Only work is placed in turn; reads (health checks) always go to the first upstream.
        upstream = next(turn) if request.method == "POST" else upstreams[0]
        body = await request.read()
        async with request.app[SESSION].request(
            request.method, upstream + request.rel_url.path_qs, data=body, headers=end_to_end(request.headers)
        ) as answer:
            reply = web.StreamResponse(status=answer.status, headers=end_to_end(answer.headers))
            reply.headers["x-upstream"] = upstream
            await reply.prepare(request)
            async for chunk in answer.content.iter_any():
                await reply.write(chunk)
            await reply.write_eof()
            return reply

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("upstreams", nargs="+", help="base URLs, taken in turn")
    args = parser.parse_args(argv)
    web.run_app(build_app([u.rstrip("/") for u in args.upstreams]), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
