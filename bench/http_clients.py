"""Which HTTP client should carry the gateway's upstream traffic? Measured, in one run.

    .venv/bin/python bench/http_clients.py [--seconds 5] [--markdown docs/http-client.md]

A minimal pass-through (the same Starlette app on uvicorn + uvloop + httptools, only the client differs)
forwards POST /v1/chat/completions to the vLLM simulator with zero delay; wrk (or a Python load generator)
drives it at concurrency 64 and 1. The pass-through runs alone on CPU 1; simulator and load generator share
CPU 0, as in bench/overhead.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import CHAT, SIM_CODE, free_port, load, pinned, process  # noqa: E402

PASSTHROUGH = """
import sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
KIND, UPSTREAM, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])
state = {}

async def startup():
    if KIND == "aiohttp":
        import aiohttp
        state["c"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512))
    elif KIND == "httpx":
        import httpx
        state["c"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))
    else:
        import httpx
        from httpx_aiohttp import AiohttpTransport
        state["c"] = httpx.AsyncClient(transport=AiohttpTransport())

async def chat(request):
    body = await request.body()
    headers = {"content-type": "application/json"}
    if KIND == "aiohttp":
        async with state["c"].post(UPSTREAM, data=body, headers=headers) as r:
            data = await r.read()
            return Response(data, status_code=r.status, media_type="application/json")
    r = await state["c"].post(UPSTREAM, content=body, headers=headers)
    return Response(r.content, status_code=r.status_code, media_type="application/json")

async def health(request):
    return Response(b"ok")

import contextlib

@contextlib.asynccontextmanager
async def lifespan(app):
    await startup()
    yield

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)],
                lifespan=lifespan)
uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning", access_log=False, loop="uvloop",
            http="httptools")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    kinds = ["httpx", "aiohttp"]
    try:
        import httpx_aiohttp  # noqa: F401

        kinds.append("httpx-aiohttp")
    except ImportError:
        pass
    py = sys.executable
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    rows = []
    with process([*pinned(0), py, "-c", SIM_CODE.format(root=str(ROOT), port=sim_port)], sim_url + "/health"):
        direct = load(sim_url + "/v1/chat/completions", CHAT, 64, args.seconds)
        rows.append(("direct (no proxy)", direct.rps, direct.p99_ms, 0.0))
        for kind in kinds:
            port = free_port()
            cmd = [*pinned(1), py, "-c", PASSTHROUGH, kind, sim_url + "/v1/chat/completions", str(port)]
            url = f"http://127.0.0.1:{port}"
            with process(cmd, url + "/health"):
                load(url + "/v1/chat/completions", CHAT, 8, 1.0)
                c1 = load(url + "/v1/chat/completions", CHAT, 1, args.seconds)
                c64 = load(url + "/v1/chat/completions", CHAT, 64, args.seconds)
            d1 = load(sim_url + "/v1/chat/completions", CHAT, 1, args.seconds)
            rows.append((f"pass-through with {kind}", c64.rps, c64.p99_ms, c1.p50_ms - d1.p50_ms))
    lines = [
        "| client | req/s at c=64 | p99 at c=64 (ms) | added p50 at c=1 (ms) |",
        "| --- | --- | --- | --- |",
        *(f"| {name} | {rps:.0f} | {p99:.1f} | {added:+.2f} |" for name, rps, p99, added in rows),
    ]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(
            "# Upstream HTTP client, chosen by measurement\n\n"
            f"Command: `.venv/bin/python bench/http_clients.py --seconds {args.seconds:g}`\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
