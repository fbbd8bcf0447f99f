"""The soak's clients: ordinary and hostile requests mixed at a fixed rate (the hostile cases of
tests/integration/hostile: malformed bodies, deep nesting, oversized bodies and headers, bypass and traversal
paths, wrong keys, bad guard headers, request templates, idle sockets, stalled headers, trickled bodies, clients
that leave mid-stream), each answer checked against what its case expects; and samples of the gateway's memory,
open file descriptors and ledger.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from testing.hostile_checks import closed_within, parse_raw, read_response, request_bytes

KEY = "sk-soak-client"
BODY_LIMIT = 64 * 1024
# Small limits, so that a slow client is cut off within seconds and the soak measures their cleanup.
GATEWAY_LIMITS = (
    "--max-body-bytes", str(BODY_LIMIT), "--header-timeout", "1", "--keep-alive-timeout", "1",
    "--body-timeout", "2", "--body-rate-grace", "0.5", "--min-body-rate", "1024", "--max-connections", "512",
    "--queue-timeout", "5", "--max-queue", "1024",
)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "How are you today?"}], "max_tokens": 8}


@dataclass(frozen=True)
class Sample:
    rss_mib: float
    fds: int
    ledger: str


def sample(pid: int, url: str) -> Sample:
    with open(f"/proc/{pid}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    import httpx

    status = httpx.get(url + "/guard/status", headers={"authorization": f"Bearer {KEY}"}, timeout=5).json()
    ledger = f"{status['committed_blocks']} / {status['in_flight']} / {status['queued']}"
    return Sample(rss_kib / 1024, fds, ledger)


# -- the clients ---------------------------------------------------------------------------------------
@dataclass
class Tally:
    sent: int = 0
    unexpected: int = 0
    examples: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def note(self, ok: bool, what: str, latency: float) -> None:
        self.sent += 1
        self.latencies.append(latency)
        if not ok:
            self.unexpected += 1
            if len(self.examples) < 3:
                self.examples.append(what[:160])


Case = Callable[["Client"], Awaitable[tuple[bool, str]]]


class Client:
    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self.session = url, session
        self.host, self.port = "127.0.0.1", int(url.rsplit(":", 1)[1])

    async def post(self, path: str, body: bytes, headers: dict[str, str] | None = None,
                   expect: frozenset[int] = frozenset({200})) -> tuple[bool, str]:
        h = {"content-type": "application/json", "authorization": f"Bearer {KEY}", **(headers or {})}
        async with self.session.post(self.url + path, data=body, headers=h) as r:
            text = await r.read()
            return r.status in expect and _shaped(r.status, text), f"{r.status} {text[:120]!r}"

    async def raw(self, data: bytes, expect: frozenset[int]) -> tuple[bool, str]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(data)
            await writer.drain()
            r = await asyncio.wait_for(read_response(reader), 10)
        except ConnectionError as exc:
            return False, f"connection error {exc}"
        finally:
            writer.close()
        if r is None:
            return False, "closed without an answer"
        return r.status in expect and _shaped(r.status, r.body), f"{r.status} {r.body[:120]!r}"

    async def stalled(self, data: bytes, expect: frozenset[int] | None, within: float) -> tuple[bool, str]:
        """Send ``data`` and nothing more: the gateway must close within ``within`` s (answering ``expect``)."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            if data:
                writer.write(data)
                await writer.drain()
            closed, got = await closed_within(reader, within)
        finally:
            writer.close()
        answer = parse_raw(got)
        if not closed:
            return False, f"still open after {within:g} s"
        if answer is None:
            return expect is None, "closed silently"
        return expect is not None and answer[0] in expect and _shaped(*answer), f"{answer[0]} {answer[1][:120]!r}"


def _shaped(status: int, body: bytes) -> bool:
    """OpenAI's error shape on every error (and never the gateway's own internal error)."""
    if status < 400:
        return True
    try:
        err = json.loads(body)["error"]
        return isinstance(err["message"], str) and isinstance(err["type"], str) and err["code"] != "internal_error"
    except (ValueError, KeyError, TypeError):
        return False


def _chat(**extra: Any) -> bytes:
    return json.dumps({**CHAT, **extra}).encode()


async def ordinary_chat(c: Client) -> tuple[bool, str]:
    return await c.post("/v1/chat/completions", _chat())


async def ordinary_completion(c: Client) -> tuple[bool, str]:
    return await c.post("/v1/completions", json.dumps({"model": "tiny", "prompt": "Once upon", "max_tokens": 8}
                                                       ).encode())


async def ordinary_stream(c: Client) -> tuple[bool, str]:
    h = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    async with c.session.post(c.url + "/v1/chat/completions", data=_chat(stream=True), headers=h) as r:
        text = await r.read()
    return r.status == 200 and text.rstrip().endswith(b"data: [DONE]"), f"{r.status} {text[-80:]!r}"


async def stream_left_midway(c: Client) -> tuple[bool, str]:
    h = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    async with c.session.post(c.url + "/v1/chat/completions", data=_chat(stream=True, max_tokens=200),
                              headers=h) as r:
        await r.content.readany()
        r.close()  # gone after the first event: the reservation must still be released
    return r.status == 200, str(r.status)


def _bad(body: bytes, expect: int = 400, headers: dict[str, str] | None = None) -> Case:
    async def run(c: Client) -> tuple[bool, str]:
        return await c.post("/v1/chat/completions", body, headers, frozenset({expect}))

    return run


def _raw(data: bytes, *expect: int) -> Case:
    async def run(c: Client) -> tuple[bool, str]:
        return await c.raw(data, frozenset(expect))

    return run


def _stall(data: bytes, expect: frozenset[int] | None, within: float) -> Case:
    async def run(c: Client) -> tuple[bool, str]:
        return await c.stalled(data, expect, within)

    return run


def _head(path: str, *lines: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {KEY}\r\n"
            "content-type: application/json\r\nconnection: close\r\n" + "".join(f"{ln}\r\n" for ln in lines)
            ).encode()


def _trickle(c: Client) -> Awaitable[tuple[bool, str]]:
    async def run() -> tuple[bool, str]:
        reader, writer = await asyncio.open_connection(c.host, c.port)
        try:
            writer.write(_head("/v1/chat/completions", "content-length: 60000") + b"\r\n")
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:
                writer.write(b" ")
                await writer.drain()
                closed, got = await closed_within(reader, 0.1)
                if closed:
                    answer = parse_raw(got)
                    return answer is not None and answer[0] == 408, f"{answer}"
        except ConnectionError:
            return True, "reset after the refusal"
        finally:
            writer.close()
        return False, "a trickled body was held past 6 s"

    return run()


def _nested(depth: int) -> bytes:
    return _chat()[:-1] + b', "metadata": ' + b"[" * depth + b"]" * depth + b"}"


CHAT_REQ = request_bytes("POST", "/v1/chat/completions", {"authorization": f"Bearer {KEY}",
                                                          "content-type": "application/json",
                                                          "connection": "close"}, _chat())

# Name -> (weight, case). Ordinary requests are about half of all.
MIX: dict[str, tuple[int, Case]] = {
    "ordinary chat": (30, ordinary_chat),
    "ordinary completion": (10, ordinary_completion),
    "ordinary stream": (10, ordinary_stream),
    "stream left midway": (3, stream_left_midway),
    "invalid json": (3, _bad(b'{"model": "tiny", "messages": [')),
    "wrong type": (3, _bad(_chat(max_tokens="5"))),
    "negative max_tokens": (2, _bad(_chat(max_tokens=-1))),
    "nested 300 deep": (2, _bad(_nested(300))),
    "integer beyond 64 bits": (2, _bad(_chat(seed=2**64 + 1), 200)),
    "body over the limit": (2, _bad(b" " * (BODY_LIMIT + 1), 413)),
    "request template": (2, _bad(_chat(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"))),
    "wrong key": (2, _bad(_chat(), 401, {"authorization": "Bearer sk-wrong"})),
    "bad priority header": (2, _bad(_chat(), 400, {"x-guard-priority": "high"})),
    "dot-segment path": (2, _raw(CHAT_REQ.replace(b"/v1/chat", b"/v1/./chat", 1), 200)),
    "traversal to /metrics": (2, _raw(CHAT_REQ.replace(b"/v1/chat/completions", b"/v1/%2e%2e/metrics", 1), 404)),
    "generating route outside the guard": (1, _raw(CHAT_REQ.replace(b"/v1/chat/completions", b"/invocations", 1),
                                                   404)),
    "header of 64 KB": (2, _raw(_head("/v1/chat/completions", "x-big: " + "a" * 65536) + b"\r\n", 431)),
    "Content-Length 10^20": (2, _raw(_head("/v1/chat/completions", "content-length: " + "1" + "0" * 20)
                                     + b"\r\n", 413)),
    "idle socket": (2, _stall(b"", None, 4.0)),
    "stalled headers": (2, _stall(_head("/v1/chat/completions"), frozenset({408}), 4.0)),
    "stalled body": (2, _stall(_head("/v1/chat/completions", "content-length: 500") + b"\r\n{",
                               frozenset({408}), 5.0)),
    "trickled body": (2, _trickle),
}


async def run_load(url: str, seconds: float, rate: float, clients: int, seed: int) -> dict[str, Tally]:
    tallies = {name: Tally() for name in MIX}
    names = list(MIX)
    weights = [MIX[n][0] for n in names]
    connector = aiohttp.TCPConnector(limit=256)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = Client(url, session)

        async def one(name: str) -> None:
            t0 = time.perf_counter()
            try:
                ok, what = await MIX[name][1](client)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                ok, what = False, f"{type(exc).__name__}: {exc}"
            tallies[name].note(ok, what, time.perf_counter() - t0)

        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            interval = clients / rate
            start = time.monotonic() + index * interval / clients
            running: set[asyncio.Task[None]] = set()
            slot = 0
            while True:
                at = start + slot * interval
                if at - start >= seconds:
                    break
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                slot += 1
                # Each request is a task of its own, so that a slow case never holds the schedule up.
                task = asyncio.create_task(one(rng.choices(names, weights)[0]))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)

        await asyncio.gather(*(worker(i) for i in range(clients)))
    return tallies


async def watch_peak(pid: int, url: str, stop: asyncio.Event, peak: list[Sample]) -> None:
    while not stop.is_set():
        s = await asyncio.to_thread(sample, pid, url)
        p = peak[0]
        peak[0] = Sample(max(p.rss_mib, s.rss_mib), max(p.fds, s.fds), "")
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def soak(pid: int, url: str, seconds: float, rate: float, clients: int, seed: int
               ) -> tuple[Sample, Sample, Sample, dict[str, Tally]]:
    async with aiohttp.ClientSession() as session:  # warm-up: tokenizer, pools, first-time imports
        c = Client(url, session)
        for _ in range(20):
            await ordinary_chat(c)
            await ordinary_stream(c)
    await asyncio.sleep(2)  # the warm-up's idle connections are closed by the keep-alive timeout
    before = sample(pid, url)
    peak = [before]
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_peak(pid, url, stop, peak))
    tallies = await run_load(url, seconds, rate, clients, seed)
    stop.set()
    await watcher
    # Settle: idle connections close after the keep-alive timeout (1 s), reservations are released at once.
    await asyncio.sleep(3)
    return before, sample(pid, url), peak[0], tallies
