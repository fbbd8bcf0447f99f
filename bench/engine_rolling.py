"""Rolling restart under load: ``vllm-guard serve --managed --engine-devices "0;1"`` runs two real vLLM
engines (CPU build, the tiny model, each engine's threads on a core of its own: bench/cpu_engine.py), OpenAI SDK
clients keep sending completions (streamed and not, no SDK retries, so any failure is a lost request), and
``POST /guard/restart`` restarts both engines one at a time, ``--rounds`` times in one session (rounds taken in
turn, medians reported).

Per round: the seconds the rolling restart took, requests answered while it ran and those that failed (target
0), the longest gap between two answers (serving never stops), ``/health`` answers other than 200 (target 0:
the gateway is ready while an engine is), the engines that answered during the round, and output tokens/s
during the round over tokens/s in the 20 s before it.

    .venv/bin/python bench/engine_rolling.py [--rounds 3] [--clients 3] [--logs DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.e2e.servers import (  # noqa: E402
    DEFAULT_KV_CACHE_BYTES,
    SERVED_MODEL_NAME,
    VENV_BIN,
    ServerProcess,
    ensure_tiny_model,
    free_port,
)

KEY, ADMIN = "bench-key", "bench-admin"
MAX_MODEL_LEN = 2048
PROMPT = "A rolling restart keeps one engine serving while the other comes back. " * 6
STEADY_S = 20.0


@dataclass
class Answer:
    at: float
    ok: bool
    engine: str | None
    tokens: int
    error: str | None = None


@dataclass
class Load:
    http: httpx.AsyncClient
    client: openai.AsyncOpenAI
    answers: list[Answer] = field(default_factory=list)
    health: list[tuple[float, int]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def one(self, i: int) -> None:
        stream = i % 2 == 1
        try:
            raw = await self.client.completions.with_raw_response.create(
                model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0, stream=stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            )
            body = raw.parse()
            tokens = 0
            if stream:
                async for chunk in body:  # type: ignore[union-attr]
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            else:
                tokens = body.usage.completion_tokens if body.usage else 0  # type: ignore[union-attr]
            self.answers.append(Answer(time.monotonic(), True, raw.headers.get("x-guard-engine"), tokens))
        except openai.OpenAIError as exc:
            self.answers.append(Answer(time.monotonic(), False, None, 0, f"{type(exc).__name__}: {exc}"[:200]))

    async def loop(self, offset: int) -> None:
        i = offset
        while not self.stop.is_set():
            await self.one(i)
            i += 1

    async def watch(self) -> None:
        while not self.stop.is_set():
            try:
                code = (await self.http.get("/health")).status_code
            except httpx.HTTPError:
                code = 0
            self.health.append((time.monotonic(), code))
            await asyncio.sleep(0.25)


@dataclass
class Round:
    seconds: float
    answered: int
    failed: int
    longest_gap_s: float
    health_not_200: int
    engines: dict[str, int]
    throughput_ratio: float
    errors: list[str]


async def status(http: httpx.AsyncClient) -> dict[str, object]:
    r = await http.get("/guard/status", headers={"Authorization": f"Bearer {KEY}"})
    body: dict[str, object] = r.json()
    return body


def tokens_per_s(answers: list[Answer], start: float, end: float) -> float:
    return sum(a.tokens for a in answers if start <= a.at < end) / max(end - start, 1e-9)


async def one_round(load: Load, http: httpx.AsyncClient, timeout: float) -> Round:
    await asyncio.sleep(STEADY_S)
    t0 = time.monotonic()
    rounds_before = (await status(http))["rolling_restart"]["rounds"]  # type: ignore[index]
    r = await http.post("/guard/restart", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 202, r.text
    while True:
        rolling = (await status(http))["rolling_restart"]
        if rolling["rounds"] > rounds_before and not rolling["in_progress"]:  # type: ignore[index,operator]
            break
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the rolling restart did not end within {timeout:g} s: {rolling}")
        await asyncio.sleep(0.5)
    t1 = time.monotonic()
    during = [a for a in load.answers if t0 <= a.at < t1]
    ok_times = [t0] + [a.at for a in during if a.ok] + [t1]
    return Round(
        seconds=t1 - t0,
        answered=sum(a.ok for a in during),
        failed=sum(not a.ok for a in during),
        longest_gap_s=max(b - a for a, b in itertools.pairwise(ok_times)),
        health_not_200=sum(code != 200 for at, code in load.health if t0 <= at < t1),
        engines=dict(Counter(a.engine or "?" for a in during if a.ok)),
        throughput_ratio=tokens_per_s(load.answers, t0, t1) / max(tokens_per_s(load.answers, t0 - STEADY_S, t0), 1e-9),
        errors=[a.error for a in during if a.error][:3],
    )


async def drive(url: str, rounds: int, clients: int, timeout: float) -> list[Round]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        load = Load(http, client)
        tasks = [asyncio.create_task(load.loop(i)) for i in range(clients)]
        tasks.append(asyncio.create_task(load.watch()))
        try:
            return [await one_round(load, http, timeout) for _ in range(rounds)]
        finally:
            load.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()


def gateway(model: Path, logs: Path, startup_timeout: float) -> ServerProcess:
    port = free_port()
    script = VENV_BIN / "vllm-guard"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]
    argv = [
        *command, "serve", "--managed", "--engine-devices", "0;1", "--model", str(model),
        "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        # Each engine's OpenMP threads on a core of its own (bench/cpu_engine.py says why).
        "--vllm-command", f"{sys.executable} {ROOT / 'bench' / 'servers' / 'cpu_engine.py'}",
        "--api-key", KEY, "--admin-api-key", ADMIN,
        "--startup-timeout", str(startup_timeout), "--drain-timeout", "30", "--queue-timeout", "300",
        "--", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES),
    ]  # fmt: skip
    return ServerProcess("managed gateway (2 engines)", argv, port, logs / "gateway.log")


def wait_both_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = httpx.get(url + "/guard/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
            if all(e["state"] == "ready" for e in body.get("managed_engines", [])):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the two managed engines were not ready within {timeout:g} s")


def report(rounds: list[Round], argv: list[str]) -> str:
    lines = [
        f"$ .venv/bin/python bench/engine_rolling.py {' '.join(argv)}".rstrip(),
        "",
        "| round | rolling restart s | answered | failed | longest gap s | /health not 200 | by engine "
        "| tok/s vs before |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(rounds, 1):
        by = ", ".join(f"{k}: {v}" for k, v in sorted(r.engines.items()))
        lines.append(f"| {i} | {r.seconds:.1f} | {r.answered} | {r.failed} | {r.longest_gap_s:.2f} | "
                     f"{r.health_not_200} | {by} | {r.throughput_ratio:.2f}x |")
    med = statistics.median
    lines.append(f"| median | {med(r.seconds for r in rounds):.1f} | {med(r.answered for r in rounds):.0f} | "
                 f"{med(r.failed for r in rounds):.0f} | {med(r.longest_gap_s for r in rounds):.2f} | "
                 f"{med(r.health_not_200 for r in rounds):.0f} | | "
                 f"{med(r.throughput_ratio for r in rounds):.2f}x |")
    errors = [e for r in rounds for e in r.errors]
    if errors:
        lines += ["", "failures:", *(f"- {e}" for e in errors)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--startup-timeout", type=float, default=400.0)
    parser.add_argument("--logs", type=Path, default=None)
    args = parser.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-rolling-"))
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "tinymodel.log").open("w", encoding="utf-8") as log:
        model = ensure_tiny_model(MAX_MODEL_LEN, log=log)
    server = gateway(model, logs, args.startup_timeout)
    try:
        server.start()
        server.wait_ready(("/metrics",), 120.0)
        wait_both_ready(server.url, args.startup_timeout)
        rounds = asyncio.run(drive(server.url, args.rounds, args.clients, 2 * args.startup_timeout))
    finally:
        server.stop(grace=60.0)
    print(report(rounds, list(argv if argv is not None else sys.argv[1:])))
    print(f"\nlogs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
