"""Where a client's time to first token goes through the gateway: before its handler, in it, after its write.

Starts one vLLM (the CPU build, the realistic benchmark's tiny model; 64 MiB cache unless ``--kv-cache-mib``)
and one gateway in front of it (its access log on), sends ``bench/realistic.py``'s chat traffic at ``--rate`` for
``--duration`` seconds through the gateway ``--repeat`` times, and joins each request the client saw to the
gateway's access-log line by ``x-request-id``. The line's ``time`` is when the gateway's handler began and its
``ttft_ms`` the time from there to the first event written, so each client's TTFT splits into:

- before the handler: from the client's send to the handler's start (the connection accepted, the head read,
  the request's task run: each a turn of the gateway's event loop);
- in the handler: counting, admission, the exchange with vLLM until its first event, and that event written;
- after the write: from the gateway's write to the client's read of it.

Also printed per run: the gateway's admission wait and its exchange with vLLM (request sent to first event read)
from its own histograms, and vLLM's own time to first token. The client and the servers share one clock
(``time.time``): run it on one machine.

    .venv/bin/python bench/ttft_split.py --rate 24 --duration 20 --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.realistic import KV_CACHE_BYTES, gateway_command  # noqa: E402
from bench.realistic_clients import chat_body  # noqa: E402
from bench.realistic_load import Planned, plan, prompt  # noqa: E402
from bench.variants import (  # noqa: E402
    ENGINE_TTFT,
    GATEWAY_QUEUE,
    GATEWAY_TTFT,
    histogram_now,
    mean_since,
)
from tests.e2e.servers import (  # noqa: E402
    DEFAULT_MAX_MODEL_LEN,
    GATEWAY_READY_PATHS,
    VLLM_READY_PATHS,
    ServerProcess,
    ensure_tiny_model,
    free_port,
    vllm_server,
)


@dataclass(frozen=True)
class Seen:
    """One request as its client saw it: wall-clock times of its send and of its first event read."""

    request_id: str
    sent: float
    first_event: float


@dataclass(frozen=True)
class Handled:
    """One request as the gateway's access log tells it: when its handler began, and its first event's write."""

    started: float
    ttft: float


@dataclass(frozen=True)
class Split:
    joined: int
    client: float  # the client's mean time to first token
    before: float  # means of the three parts
    inside: float
    after: float
    before_p90: float
    inside_p90: float
    after_p90: float


def access_lines(text: str) -> dict[str, Handled]:
    """The guarded requests of a text access log (``key=value`` pairs) that wrote a first event, by request id."""
    handled: dict[str, Handled] = {}
    for line in text.splitlines():
        if not line.startswith("time="):
            continue
        fields = dict(pair.split("=", 1) for pair in line.split() if "=" in pair)
        rid, ttft_ms = fields.get("request_id", ""), fields.get("ttft_ms", "")
        if not rid or ttft_ms in ("", "None"):
            continue
        started = datetime.datetime.strptime(fields["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
        handled[rid] = Handled(started.replace(tzinfo=datetime.UTC).timestamp(), float(ttft_ms) / 1000)
    return handled


def split(seen: Iterable[Seen], handled: Mapping[str, Handled]) -> Split | None:
    """Each request seen by the client and logged by the gateway, its TTFT in three parts; None when none joined."""
    before: list[float] = []
    inside: list[float] = []
    after: list[float] = []
    client: list[float] = []
    for s in seen:
        h = handled.get(s.request_id)
        if h is None:
            continue
        before.append(h.started - s.sent)
        inside.append(h.ttft)
        after.append(s.first_event - (h.started + h.ttft))
        client.append(s.first_event - s.sent)
    if not client:
        return None
    return Split(
        len(client), statistics.mean(client), statistics.mean(before), statistics.mean(inside),
        statistics.mean(after), p90(before), p90(inside), p90(after),
    )


def p90(values: Sequence[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * 0.9))]


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, object], at: float, seen: list[Seen]) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    sent = time.time()
    async with session.post(url, json=body) as resp:
        rid = resp.headers.get("x-request-id", "")
        first: float | None = None
        async for line in resp.content:
            if line.startswith(b"data: ") and first is None:
                first = time.time()
                seen.append(Seen(rid, sent, first))
            # The client reads every event whole, as the realistic benchmark's does.
            if line.startswith(b"data: {"):
                json.loads(line[6:])


async def send_all(url: str, plans: Sequence[Planned], texts: Sequence[str], eos_id: int) -> list[Seen]:
    seen: list[Seen] = []
    start = time.monotonic() + 0.5
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        await asyncio.gather(*(one(session, f"{url}/v1/chat/completions", chat_body(p, t, eos_id), start + p.at, seen)
                               for p, t in zip(plans, texts, strict=True)))
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=24.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_BYTES >> 20)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/bench-ttft-split"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model(DEFAULT_MAX_MODEL_LEN)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    eos_id = int(eos[0] if isinstance(eos, list) else eos)
    access_log = args.logs / "gateway.log"
    access_log.unlink(missing_ok=True)
    engine = vllm_server(model, args.logs / "vllm.log", kv_cache_memory_bytes=args.kv_cache_mib << 20).start()
    gateway: ServerProcess | None = None
    try:
        engine.wait_ready(VLLM_READY_PATHS, 900)
        port = free_port()
        argv = [*gateway_command(None), "serve", "--upstream", engine.url, "--host", "127.0.0.1", "--port", str(port),
                "--access-log", "text"]
        gateway = ServerProcess("gateway", argv, port, access_log).start()
        gateway.wait_ready(GATEWAY_READY_PATHS, 180)
        for rep in range(args.repeat):
            seed = 500 + rep
            plans = plan(args.rate, args.duration, seed)
            texts = [prompt(p, i, seed, 1) for i, p in enumerate(plans)]
            marks = {key: histogram_now(server, key) for key, server in
                     ((ENGINE_TTFT, engine), (GATEWAY_QUEUE, gateway), (GATEWAY_TTFT, gateway))}
            seen = asyncio.run(send_all(gateway.url, plans, texts, eos_id))
            time.sleep(2)  # the access log's writer thread
            means = {key: mean_since(mark, histogram_now(engine if key == ENGINE_TTFT else gateway, key))
                     for key, mark in marks.items()}
            parts = split(seen, access_lines(access_log.read_text(encoding="utf-8", errors="replace")))
            if parts is None:
                print(f"run {rep + 1}: no request joined to the gateway's access log", flush=True)
                continue
            print(f"run {rep + 1}: {parts.joined} requests; the client's mean TTFT {parts.client:.2f} s = before the "
                  f"gateway's handler {parts.before:.2f} s + in it to the first event written {parts.inside:.2f} s + "
                  f"after that write {parts.after:.2f} s (p90 {parts.before_p90:.2f} / {parts.inside_p90:.2f} / "
                  f"{parts.after_p90:.2f} s); the gateway's admission wait {means[GATEWAY_QUEUE]:.2f} s, its request "
                  f"sent to vLLM to the first event read {means[GATEWAY_TTFT]:.2f} s, vLLM's own TTFT "
                  f"{means[ENGINE_TTFT]:.2f} s", flush=True)
            time.sleep(3)
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
