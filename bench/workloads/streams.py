"""Many long streams at once through a proxy, from a client cheap enough not to be the bottleneck on the core it
shares with the engine: a raw asyncio protocol with httptools that parses no event, only counts the bytes and the
event boundaries and notes when the first body byte and the end came.

    python -m bench.workloads.streams --url URL --streams 128 --tokens 200 --seconds 20 [--usage none]

``--streams`` slots each keep one stream open at a time on a keep-alive connection of their own, starting their
first stream spread over one stream's length (so the tokens do not all fall due at once) and the next one as soon
as the last ends, until ``--seconds`` have passed; the streams in flight then finish. Prints one JSON object:
streams completed and failed, tokens relayed (a completed stream's tokens are the ones asked: the engine sends
exactly that many, and a stream whose event count differs is counted failed), bytes, time to first byte (p50,
p99), the client's own CPU seconds, and the tokens of completed streams by the first ``ID_PREFIX`` characters of
the answer's ``x-request-id`` (a gateway's process writes its own prefix there: ``by_prefix`` says which process
relayed what under ``--workers N``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools
import orjson

USAGE_OPTIONS: dict[str, dict[str, bool] | None] = {
    "none": None,
    "final": {"include_usage": True},
    "continuous": {"include_usage": True, "continuous_usage_stats": True},
}
DONE = b"data: [DONE]\n\n"
ID_PREFIX = 12  # the characters of a gateway's request id that name its process (gateway/http/context.py)


def stream_body(tokens: int, usage: str, token_delay: float | None = None, n: int = 0) -> dict[str, Any]:
    """A short chat streaming ``tokens`` tokens; ``usage`` says what the client asks of usage (none, the final
    chunk, every chunk)."""
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": f"Count to {tokens}, run {n}."}],
                            "max_tokens": tokens, "ignore_eos": True, "stream": True}
    if USAGE_OPTIONS[usage] is not None:
        body["stream_options"] = USAGE_OPTIONS[usage]
    if token_delay is not None:
        body["fake_token_delay"] = token_delay  # read by bench.servers.fake_engine only
    return body


def expected_events(tokens: int, usage: str, chat: bool = True) -> int:
    """Events a stream of ``tokens`` one-token events carries: the chat's role delta, the tokens, the usage chunk
    when asked, ``[DONE]``."""
    return int(chat) + tokens + int(usage != "none") + 1


class Exchange(asyncio.Protocol):
    """One keep-alive connection carrying one stream at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.done: asyncio.Future[None] | None = None
        self.closed = False
        self.reset(0.0)

    def reset(self, sent: float) -> None:
        self.sent, self.first, self.status = sent, 0.0, 0
        self.request_id = b""
        self.bytes = self.events = 0
        self.tail = b""
        self.keep_alive = True

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(exc)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-request-id":
            self.request_id = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.first:
            self.first = time.perf_counter()
        self.bytes += len(body)
        # An event ends at a blank line; one may straddle two reads ("\n" | "\n").
        self.events += body.count(b"\n\n") + (self.tail.endswith(b"\n") and body.startswith(b"\n"))
        self.tail = (self.tail + body)[-len(DONE):]

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self._finish(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._finish(exc or ConnectionError("closed before the end of the answer"))

    def _finish(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)


@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    tokens: int = 0
    events: int = 0
    bytes: int = 0
    ttfb_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    by_prefix: dict[str, int] = field(default_factory=dict)  # tokens of completed streams by request id prefix
    first_sent: float = math.inf
    last_end: float = 0.0

    def fail(self, why: str) -> None:
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1


@dataclass(frozen=True)
class Plan:
    host: str
    port: int
    path: str
    streams: int
    tokens: int
    seconds: float
    usage: str
    token_delay: float | None  # asked of the fake engine; None: the engine's own
    spread_s: float  # the slots' first streams start over this many seconds
    timeout_s: float = 120.0
    exact_events: bool = True  # False: a real vLLM may put several tokens in one event when it falls behind


async def _one(plan: Plan, conn: Exchange, n: int, tally: Tally) -> None:
    body = orjson.dumps(stream_body(plan.tokens, plan.usage, plan.token_delay, n))
    loop = asyncio.get_running_loop()
    conn.done = loop.create_future()
    conn.reset(time.perf_counter())
    tally.first_sent = min(tally.first_sent, conn.sent)
    conn.transport.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                         b"\r\n%s" % (plan.path.encode(), plan.host.encode(), len(body), body))
    try:
        await asyncio.wait_for(conn.done, plan.timeout_s)
    except (OSError, TimeoutError, httptools.HttpParserError) as exc:
        tally.fail(type(exc).__name__)
        conn.transport.close()
        return
    end = time.perf_counter()
    tally.last_end = max(tally.last_end, end)
    tally.bytes += conn.bytes
    tally.events += conn.events
    if conn.status != 200:
        tally.fail(f"status {conn.status}")
    elif conn.tail != DONE or (plan.exact_events and conn.events != expected_events(plan.tokens, plan.usage)):
        tally.fail("incomplete stream")
    else:
        tally.completed += 1
        tally.tokens += plan.tokens
        tally.ttfb_s.append(conn.first - conn.sent)
        prefix = conn.request_id[:ID_PREFIX].decode("latin-1")
        tally.by_prefix[prefix] = tally.by_prefix.get(prefix, 0) + plan.tokens
    if not conn.keep_alive:
        conn.transport.close()


async def _slot(plan: Plan, index: int, start: float, tally: Tally) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(plan.spread_s * index / plan.streams)
    conn: Exchange | None = None
    n = 0
    while time.perf_counter() - start < plan.seconds:
        if conn is None or conn.closed or conn.transport.is_closing():
            try:
                _, conn = await loop.create_connection(Exchange, plan.host, plan.port)
            except OSError as exc:
                tally.fail(type(exc).__name__)
                await asyncio.sleep(0.1)
                continue
        await _one(plan, conn, index * 100_000 + n, tally)
        n += 1
    if conn is not None and conn.transport is not None:
        conn.transport.close()


async def run(plan: Plan) -> dict[str, Any]:
    tally = Tally()
    cpu0, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(_slot(plan, i, start, tally) for i in range(plan.streams)))
    return summary(tally, time.process_time() - cpu0)


def summary(tally: Tally, cpu_s: float) -> dict[str, Any]:
    ordered = sorted(tally.ttfb_s)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))] * 1000 if ordered else math.nan

    wall = tally.last_end - tally.first_sent if tally.completed else 0.0
    out = asdict(tally)
    del out["ttfb_s"], out["first_sent"], out["last_end"]
    return {**out, "wall_s": wall, "ttfb_p50_ms": q(0.5), "ttfb_p99_ms": q(0.99), "client_cpu_s": cpu_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="base URL of the target")
    parser.add_argument("--path", default="/v1/chat/completions")
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20.0, help="start streams for this long")
    parser.add_argument("--usage", choices=sorted(USAGE_OPTIONS), default="none")
    parser.add_argument("--token-delay", type=float, default=None, help="asked of the fake engine per request")
    parser.add_argument("--any-events", action="store_true", help="a stream that ends with [DONE] is whole, however "
                        "many events carried its tokens (a real vLLM's; it is asked ignore_eos)")
    parser.add_argument("--spread", type=float, default=None, help="seconds over which the first streams start "
                        "(default: one stream's length at --token-delay, else 1)")
    args = parser.parse_args(argv)
    url = urlsplit(args.url)
    spread = args.spread if args.spread is not None else (args.tokens * args.token_delay if args.token_delay else 1.0)
    plan = Plan(url.hostname or "127.0.0.1", url.port or 80, args.path, args.streams, args.tokens, args.seconds,
                args.usage, args.token_delay, spread, exact_events=not args.any_events)
    import uvloop

    print(json.dumps(uvloop.run(run(plan))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
