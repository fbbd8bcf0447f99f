"""Clients that stop reading: many streams asked for and never read, while the gateway's memory is sampled.

Each reader opens its own connection with a small receive buffer, sends one streamed chat whose tokens are large
(the fake engine's ``fake_token_bytes``, produced as fast as it can), and reads nothing. What the engine sends
piles up in the gateway for those readers until each stream's ``--max-buffered-bytes`` or all streams'
``--max-total-buffered-bytes`` cuts it. Meanwhile the gateway's resident memory (its process and every child: the
workers of ``--workers``) and the time ``/health`` takes on a fresh connection are sampled; at the end every
reader hangs up, and once the gateway has let go the memory and its ledger are read again.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson

RECEIVE_BUFFER = 4096  # bytes: the kernel's floor is about this; a reader that never reads takes no more
SAMPLE_SECONDS = 0.5


@dataclass
class Held:
    rss_before_mib: float = 0.0
    rss_peak_mib: float = 0.0
    rss_after_mib: float = 0.0
    health_ms: list[float] = field(default_factory=list)
    health_failed: int = 0
    connected: int = 0
    in_flight_after: int = -1

    def figures(self) -> dict[str, float]:
        return {
            "connected": float(self.connected), "rss_before_mib": self.rss_before_mib,
            "rss_peak_mib": self.rss_peak_mib, "rss_after_mib": self.rss_after_mib,
            "health_p50_ms": statistics.median(self.health_ms) if self.health_ms else float("nan"),
            "health_max_ms": max(self.health_ms) if self.health_ms else float("nan"),
            "health_failed": float(self.health_failed), "in_flight_after": float(self.in_flight_after),
        }  # fmt: skip


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its children (the gateway's workers), MiB."""
    total, pids = 0, [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total / 1024


def request(host: str, port: int, tokens: int, token_bytes: int) -> bytes:
    body = orjson.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": "hold this"}], "stream": True,
        "max_tokens": tokens, "fake_token_delay": 0, "fake_token_bytes": token_bytes,
    })  # fmt: skip
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def open_reader(host: str, port: int, data: bytes) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, port))
    await loop.sock_sendall(sock, data)
    return sock


async def get(host: str, port: int, path: str, timeout: float = 10.0) -> bytes:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode())
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


async def health_ms(host: str, port: int) -> float | None:
    t0 = time.perf_counter()
    try:
        answer = await get(host, port, "/health")
    except (OSError, TimeoutError):
        return None
    return (time.perf_counter() - t0) * 1000 if answer.startswith(b"HTTP/1.1 200") else None


async def in_flight(host: str, port: int) -> int:
    answer = await get(host, port, "/guard/status")
    return int(orjson.loads(answer.split(b"\r\n\r\n", 1)[1])["in_flight"])


async def hold(pid: int, url: str, readers: int, seconds: float, tokens: int, token_bytes: int) -> Held:
    """``readers`` streams asked for and never read for ``seconds``; then all hang up."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    held = Held(rss_before_mib=rss_mib(pid))
    data = request(host, port, tokens, token_bytes)
    opened = await asyncio.gather(*(open_reader(host, port, data) for _ in range(readers)), return_exceptions=True)
    socks = [s for s in opened if isinstance(s, socket.socket)]
    held.connected = len(socks)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            held.rss_peak_mib = max(held.rss_peak_mib, rss_mib(pid))
            ms = await health_ms(host, port)
            if ms is None:
                held.health_failed += 1
            else:
                held.health_ms.append(ms)
            await asyncio.sleep(SAMPLE_SECONDS)
    finally:
        for s in socks:
            s.close()
    for _ in range(60):  # the gateway sees each reader gone, cancels its stream and lets go of what it held
        await asyncio.sleep(0.5)
        try:
            held.in_flight_after = await in_flight(host, port)
        except (OSError, TimeoutError):
            continue  # its loop is still busy with the readers' ends
        if held.in_flight_after == 0:
            break
    await asyncio.sleep(2.0)
    held.rss_after_mib = rss_mib(pid)
    return held
