"""Gateway overhead against the vLLM simulator with zero delay, gateway vs direct, in one run.

    .venv/bin/python bench/overhead.py [--seconds 8] [--markdown docs/overhead.md]

Measures, each as direct and through the gateway:
- latency at concurrency 1 for a short chat (the gateway's counting and policy included): added p50 / p99;
- throughput at concurrency 64 (non-streaming) and its p99;
- streams of 20 chunks per second at concurrency 16 (per-chunk relay overhead);
- counting cost of 1K / 8K / 32K-token chats: naive apply_chat_template vs the gateway's counter, cold and
  with the conversation's earlier turns already counted;
- the live page's cost: each gateway load phase again with /guard/ui/data polled once a second (as an open
  page does), the ratio to the phase without, and what the background sampler takes per second.
The simulator and the load generator (wrk when installed, else a Python aiohttp client) share CPU 0;
the gateway runs alone on CPU 1, as a user would run it beside an engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHAT = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        # {n} becomes a per-request number, so that no request is counted from a cache of identical ones.
        {"role": "user", "content": "Question {n}: what is the capital of France? Answer in one word."},
    ],
    "max_tokens": 1,
}
STREAM = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Count to twenty, run {n}."}],
    "max_tokens": 20,
    "ignore_eos": True,
    "stream": True,
}

SIM_CODE = """
import sys, uvicorn
sys.path.insert(0, {root!r})
from tests.support.vllm_sim import SimConfig, create_sim_app
app = create_sim_app(SimConfig(model="tiny", max_model_len=32768, num_blocks=1_000_000, block_size=16,
                               max_num_seqs=100_000))
import gc
gc.collect()
gc.freeze()  # as the gateway does: the direct baseline must not carry GC pauses the gateway avoids
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", access_log=False, loop="uvloop",
            http="httptools")
"""

WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local template = os.getenv("BENCH_BODY")
local counter = 0
request = function()
  counter = counter + 1
  return wrk.format(nil, nil, nil, (string.gsub(template, "{n}", tostring(counter))))
end
done = function(summary, latency, requests)
  io.write(string.format('{"requests": %d, "seconds": %f, "p50_ms": %f, "p99_ms": %f, "errors": %d}\\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write
      + summary.errors.timeout))
end
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []


def wait_http(url: str, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


@contextmanager
def process(
    cmd: list[str], health: str, *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_http(health)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@dataclass
class Load:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


@dataclass
class PagePoll:
    """What polling the live page's data once a second saw: the data route's answer times, the sampler's cost."""

    polls: int = 0
    answer_ms: float = 0.0
    sampler_ms: list[float] | None = None


@contextmanager
def page_open(gateway_url: str) -> Iterator[PagePoll]:
    """Poll /guard/ui/data once a second in a thread, asking only for new samples, as the page does."""
    import httpx

    seen = PagePoll(sampler_ms=[])
    stop = threading.Event()

    def poll() -> None:
        last = 0
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                body = client.get(gateway_url + "/guard/ui/data", params={"since": last} if last else None).json()
                seen.answer_ms += (time.perf_counter() - t0) * 1000
                seen.polls += 1
                last = body["last_id"]
                if body.get("sampler_ms") is not None and seen.sampler_ms is not None:
                    seen.sampler_ms.append(body["sampler_ms"])
                stop.wait(1.0)

    thread = threading.Thread(target=poll, name="page-poll", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(10)


def compared(measure: str, without: float, with_page: float, fmt: str) -> tuple[str, str, str, str]:
    ratio = f"{with_page / without:.2f}x" if without else ""
    return measure, format(without, fmt), format(with_page, fmt), ratio


def load(url: str, body: dict[str, Any], concurrency: int, seconds: float) -> Load:
    if shutil.which("wrk"):
        return _wrk(url, body, concurrency, seconds)
    return asyncio.run(_py_load(url, body, concurrency, seconds))


def _wrk(url: str, body: dict[str, Any], concurrency: int, seconds: float) -> Load:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_LUA)
    try:
        env = {**os.environ, "BENCH_BODY": json.dumps(body)}
        threads = 1
        out = subprocess.run(
            [
                *pinned(0),
                "wrk",
                "-t",
                str(threads),
                "-c",
                str(concurrency),
                "-d",
                f"{max(1, round(seconds))}s",
                "-s",
                f.name,
                url,
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)
    line = next(ln for ln in out.splitlines() if ln.startswith("{"))
    return Load(**json.loads(line))


async def _py_load(url: str, body: dict[str, Any], concurrency: int, seconds: float) -> Load:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    template = json.dumps(body)
    counter = 0
    deadline = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors, counter
        while time.perf_counter() < deadline:
            counter += 1
            payload = template.replace("{n}", str(counter)).encode()
            t0 = time.perf_counter()
            async with session.post(url, data=payload, headers={"content-type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return Load(
        len(latencies),
        elapsed,
        latencies[len(latencies) // 2] * 1000,
        latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
        errors,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each load phase")
    parser.add_argument("--markdown", type=Path, help="also write the results as markdown here")
    args = parser.parse_args()

    from bench.counting import bench_counting
    from gateway.guard.counting import load_tokenizer
    from gateway.tools.tinymodel import build_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    tok_dir = build_tokenizer(tmp / "tokenizer")
    sim_port, gw_port = free_port(), free_port()
    sim_url, gw_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{gw_port}"
    py = sys.executable
    gateway_cmd = [
        *pinned(1),
        py,
        "-m",
        "gateway.cli",
        "serve",
        "--upstream",
        sim_url,
        "--port",
        str(gw_port),
        "--host",
        "127.0.0.1",
        "--tokenizer",
        str(tok_dir),
        "--log-level",
        "warning",
        "--max-queue",
        "10000",
    ]
    loader = "wrk" if shutil.which("wrk") else "python aiohttp client (install wrk for steadier figures)"
    rows: list[tuple[str, str, str, str]] = []
    page_rows: list[tuple[str, str, str, str]] = []
    polled: list[PagePoll] = []

    def with_page(path: str, body: dict[str, Any], concurrency: int) -> Load:
        with page_open(gw_url) as seen:
            result = load(gw_url + path, body, concurrency, args.seconds)
        polled.append(seen)
        return result

    with (
        process([*pinned(0), py, "-c", SIM_CODE.format(root=str(ROOT), port=sim_port)], sim_url + "/health"),
        process(gateway_cmd, gw_url + "/health"),
    ):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/chat/completions", STREAM)):
            load(sim_url + path, body, 4, 1.0)  # warm-up: connections, caches, JIT-free but lazy imports
            load(gw_url + path, body, 4, 1.0)
        d1, g1 = (load(u + "/v1/chat/completions", CHAT, 1, args.seconds) for u in (sim_url, gw_url))
        p1 = with_page("/v1/chat/completions", CHAT, 1)
        page_rows.append(compared("latency c=1 p50 (ms)", g1.p50_ms, p1.p50_ms, ".2f"))
        page_rows.append(compared("latency c=1 p99 (ms)", g1.p99_ms, p1.p99_ms, ".2f"))
        rows.append(
            (
                "latency c=1 p50 (ms)",
                f"{d1.p50_ms:.2f}",
                f"{g1.p50_ms:.2f}",
                f"+{g1.p50_ms - d1.p50_ms:.2f} ms (target <= 0.6)",
            )
        )
        rows.append(
            (
                "latency c=1 p99 (ms)",
                f"{d1.p99_ms:.2f}",
                f"{g1.p99_ms:.2f}",
                f"+{g1.p99_ms - d1.p99_ms:.2f} ms (target <= 1.5)",
            )
        )
        d64, g64 = (load(u + "/v1/chat/completions", CHAT, 64, args.seconds) for u in (sim_url, gw_url))
        p64 = with_page("/v1/chat/completions", CHAT, 64)
        page_rows.append(compared("req/s c=64", g64.rps, p64.rps, ".0f"))
        rows.append(
            (
                "req/s c=64",
                f"{d64.rps:.0f}",
                f"{g64.rps:.0f}",
                f"{g64.rps / d64.rps:.2f}x direct (target >= 2,500 req/s)",
            )
        )
        rows.append(("p99 c=64 (ms)", f"{d64.p99_ms:.1f}", f"{g64.p99_ms:.1f}", "target <= 60 ms"))
        ds, gs = (load(u + "/v1/chat/completions", STREAM, 16, args.seconds) for u in (sim_url, gw_url))
        ps = with_page("/v1/chat/completions", STREAM, 16)
        page_rows.append(compared("streams/s (20 chunks) c=16", gs.rps, ps.rps, ".0f"))
        rows.append(
            (
                "streams/s (20 chunks) c=16",
                f"{ds.rps:.0f}",
                f"{gs.rps:.0f}",
                f"{gs.rps / ds.rps:.2f}x direct (target >= 2,000)",
            )
        )
        per_chunk = (1000 / gs.rps - 1000 / ds.rps) * 16 / 22 if gs.rps and ds.rps else 0.0
        rows.append(("added time per chunk (ms, c=16)", "", "", f"{per_chunk:.3f}"))
        errors = sum(x.errors for x in (d1, g1, d64, g64, ds, gs, p1, p64, ps))
        rows.append(("non-200 answers", "", "", str(errors)))

    counting = bench_counting(load_tokenizer(str(tok_dir)))
    shutil.rmtree(tmp, ignore_errors=True)

    lines = [
        f"load generator: {loader}; gateway pinned to CPU 1, simulator + load generator to CPU 0",
        "",
        "| measure | direct | gateway | result |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines += [
        "",
        "| chat tokens | naive apply_chat_template (ms) | gateway cold (ms) | earlier turns counted (ms) |"
        " repeated (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for size, f in counting.items():
        lines.append(
            f"| {int(f['tokens'])} ({size} target) | {f['naive_ms']:.1f} | {f['cold_ms']:.1f} | "
            f"{f['prefix_ms']:.1f} | {f['warm_ms']:.2f} |"
        )
    polls = sum(p.polls for p in polled)
    sampler = [ms for p in polled for ms in (p.sampler_ms or [])]
    lines += [
        "",
        "The live page: the gateway's phases again with /guard/ui/data polled once a second (an open page).",
        "",
        "| measure | gateway | gateway, page open | ratio |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in page_rows]
    if polls and sampler:
        lines += [
            "",
            f"data route: {polls} polls, {sum(p.answer_ms for p in polled) / polls:.2f} ms per answer on average; "
            f"background sampler: {sum(sampler) / len(sampler):.2f} ms per one-second sample on average "
            f"(max {max(sampler):.2f} ms), {sum(sampler) / len(sampler) / 10:.3f}% of one core",
        ]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(
            "# Gateway overhead\n\nCommand: `.venv/bin/python bench/overhead.py"
            f" --seconds {args.seconds:g}`\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
