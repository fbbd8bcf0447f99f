"""Tenants benchmark: a tenant flooding long requests and a quiet one share a real vLLM (CPU build) through the
gateway, with fair queueing and its headroom for active tenants, without the headroom, and in FIFO order.

One invocation starts vLLM on the tiny model (prefix caching off) with a KV cache of 33 blocks of 128 tokens:
32 for requests after vLLM's null block, so four flood requests of 1,024 tokens fill it exactly and nothing
slips in beside them. It starts three gateways (``vllm-guard serve``) in front of it, all reading the same keys
file (key ``bench-flood`` is tenant ``flood``, key ``bench-quiet`` is tenant ``quiet``, weight 1 each): ``fair``
(``--fair-queueing on``, with its default ``--tenant-headroom on``), ``fair, no headroom`` (``--tenant-headroom
off``) and ``FIFO`` (``--fair-queueing off``: one queue by priority, FIFO within a priority). With
``--flood-kv-share`` a fourth runs fair queueing without the headroom and with a ``kv_share`` limit on the flood
tenant, the static way to keep part of the KV budget free for others. Per run, against one gateway:

- the flood: ``--flood-clients`` clients, each sending long streamed completions back to back (a closed loop,
  so the gateway's queue stays full of them), ``ignore_eos`` so each runs to its ``max_tokens``;
- after a warm-up, the quiet tenant sends one short streamed completion every ``--quiet-interval`` seconds for
  ``--duration`` seconds (an open loop: it does not wait for its previous answers).

Reported per mode, as the median of the runs (the modes take turns, run after run, so a slow spell of this
shared machine hits both alike): the quiet tenant's p50/p99 queue wait (the gateway's ``x-guard-queue-ms``) and
time to first token, each tenant's share of the tokens served (prompt + completion tokens of the requests
finished while the quiet tenant was sending) and the total output tokens per second over that window; then the
ratios to FIFO. Before every run the quiet tenant's TTFT is measured on the idle engine, through the same
gateway, for the "within 2x of idle" comparison. With ``--engine-floor`` the fair mode's runs also send the quiet
requests a second time, half an interval later, straight to vLLM: the time to first token the engine itself gives
such a request under the same flood, which no gateway in front of it can beat. While the quiet tenant sends,
``/guard/status`` is read every ``STATUS_INTERVAL_S``: the blocks each tenant holds and the quiet tenant's demand
as the headroom counts it.

    .venv/bin/python bench/tenants.py                      # 3 runs per mode, about 10 minutes
    .venv/bin/python bench/tenants.py --repeat 5 --duration 40 --out /tmp/tenants.md
    .venv/bin/python bench/tenants.py --kv-blocks 129 --flood-clients 48   # a cache four times larger
    .venv/bin/python bench/tenants.py --engine-floor    # and the engine's own TTFT under the flood
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.e2e.payloads import token_ids  # noqa: E402
from tests.e2e.servers import (  # noqa: E402
    DEFAULT_MAX_MODEL_LEN,
    GATEWAY_READY_PATHS,
    SERVED_MODEL_NAME,
    VLLM_READY_PATHS,
    ServerProcess,
    ensure_tiny_model,
    gateway_server,
    get_json,
    scrape_counter,
    vllm_server,
)

BLOCK_TOKENS = 128
KV_BLOCKS = 33  # the default cache; vLLM keeps one as its null block: 32 for requests
TOKEN_BYTES = 1024  # the tiny model: 2 (K, V) x 1 KV head x 64 dims x 4 bytes x 2 layers
KEYS = {"flood": "bench-flood", "quiet": "bench-quiet"}
ENGINE = "engine"  # the quiet requests sent straight to vLLM (``--engine-floor``), counted apart from both tenants
NO_HEADROOM_MODE = "fair, no headroom"
SHARE_MODE = "fair + kv_share"
STATUS_INTERVAL_S = 0.25
GATEWAY_ARGS = ("--queue-timeout", "600", "--max-queue", "1024")


@dataclass(frozen=True)
class Options:
    duration_s: float
    warmup_s: float
    flood_clients: int
    flood_prompt: int
    flood_max_tokens: int
    quiet_prompt: int
    quiet_max_tokens: int
    quiet_interval_s: float
    idle_samples: int
    timeout_s: float
    flood_kv_share: float
    kv_blocks: int = KV_BLOCKS
    engine_floor: bool = False


@dataclass
class Answer:
    tenant: str
    started: float
    finished: float
    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float | None = None
    ttft_s: float | None = None
    error: str = ""


@dataclass
class Run:
    mode: str
    answers: list[Answer]
    window: tuple[float, float]  # while the quiet tenant was sending
    idle_ttft_s: float | None
    tenants: list[dict[str, dict[str, float]]]  # ``/guard/status``'s tenants, read through the window

    def quiet(self) -> list[Answer]:
        return [a for a in self.answers if a.tenant == "quiet" and a.ok]

    def in_window(self) -> list[Answer]:
        start, end = self.window
        return [a for a in self.answers if a.ok and start <= a.finished <= end]

    def figures(self) -> dict[str, float | None]:
        quiet = self.quiet()
        waits = sorted(a.queue_ms / 1000 for a in quiet if a.queue_ms is not None)
        ttfts = sorted(a.ttft_s for a in quiet if a.ttft_s is not None)
        floor = sorted(a.ttft_s for a in self.answers if a.tenant == ENGINE and a.ok and a.ttft_s is not None)
        served = [a for a in self.in_window() if a.tenant in KEYS]
        tokens = {t: sum(a.prompt_tokens + a.completion_tokens for a in served if a.tenant == t) for t in KEYS}
        total = sum(tokens.values())
        seconds = self.window[1] - self.window[0]
        flood_held = [s["flood"]["held_blocks"] for s in self.tenants if "flood" in s]
        quiet_demand = [s["quiet"]["demand_blocks"] for s in self.tenants if "quiet" in s]
        return {
            "quiet p50 queue wait (s)": nearest_rank(waits, 0.50),
            "quiet p99 queue wait (s)": nearest_rank(waits, 0.99),
            "quiet p50 TTFT (s)": nearest_rank(ttfts, 0.50),
            "quiet p99 TTFT (s)": nearest_rank(ttfts, 0.99),
            "quiet p50 TTFT straight to vLLM (s)": nearest_rank(floor, 0.50),
            "quiet p99 TTFT straight to vLLM (s)": nearest_rank(floor, 0.99),
            "quiet TTFT on an idle engine, p50 (s)": self.idle_ttft_s,
            "flood share of tokens served": tokens["flood"] / total if total else None,
            "quiet share of tokens served": tokens["quiet"] / total if total else None,
            "output tokens/s (both tenants)": sum(a.completion_tokens for a in served) / seconds,
            "flood blocks held, mean": statistics.mean(flood_held) if flood_held else None,
            "quiet demand (blocks), most seen": max(quiet_demand) if quiet_demand else None,
            "quiet requests answered": float(len(quiet)),
            "failed requests": float(sum(not a.ok for a in self.answers)),
        }


def nearest_rank(ordered: Sequence[float], q: float) -> float | None:
    # Nearest rank: with 30 samples p99 is the slowest one, not an interpolation past it.
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else None


# -- the clients -------------------------------------------------------------------------------------
async def complete(
    session: aiohttp.ClientSession, base: str, tenant: str, prompt: list[int], max_tokens: int
) -> Answer:
    """One streamed completion as ``tenant`` (``ENGINE``: no key, ``base`` is vLLM's): its queue wait, time to
    first token and usage."""
    body = {
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    headers = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant in KEYS else {}
    started = time.monotonic()
    answer = Answer(tenant, started, started, False)
    try:
        async with session.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                answer.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return answer
            queue_ms = resp.headers.get("x-guard-queue-ms")
            answer.queue_ms = float(queue_ms) if queue_ms is not None else None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise ValueError(f"error event: {json.dumps(chunk)[:160]}")
                if answer.ttft_s is None and chunk.get("choices"):
                    answer.ttft_s = time.monotonic() - started
                if chunk.get("usage"):
                    answer.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                    answer.completion_tokens = int(chunk["usage"]["completion_tokens"])
            answer.ok = answer.completion_tokens > 0
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:200]
    answer.finished = time.monotonic()
    return answer


async def idle_ttft(session: aiohttp.ClientSession, base: str, opts: Options, seed: int) -> float | None:
    """The quiet tenant's median TTFT with nothing else running, one request after another."""
    ttfts: list[float] = []
    for i in range(opts.idle_samples):
        a = await complete(session, base, "quiet", token_ids(opts.quiet_prompt, seed=seed + i), opts.quiet_max_tokens)
        if a.ok and a.ttft_s is not None:
            ttfts.append(a.ttft_s)
    return statistics.median(ttfts) if ttfts else None


async def contend(base: str, mode: str, opts: Options, seed: int, floor_url: str | None = None) -> Run:
    """The flood, and the quiet tenant's trickle once the flood has filled the queue; with ``floor_url`` (vLLM)
    each quiet request is sent there too, half an interval later."""
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        idle = await idle_ttft(session, base, opts, seed * 100_000 + 90_000)
        answers: list[Answer] = []
        stop = asyncio.Event()
        sequence = iter(range(seed * 100_000, seed * 100_000 + 90_000))  # distinct prompts: no prefix shared

        async def flood_client() -> None:
            while not stop.is_set():
                prompt = token_ids(opts.flood_prompt, seed=next(sequence))
                answers.append(await complete(session, base, "flood", prompt, opts.flood_max_tokens))

        async def quiet_one() -> None:
            prompt = token_ids(opts.quiet_prompt, seed=next(sequence))
            answers.append(await complete(session, base, "quiet", prompt, opts.quiet_max_tokens))

        async def straight_one() -> None:
            assert floor_url is not None
            await asyncio.sleep(opts.quiet_interval_s / 2)
            prompt = token_ids(opts.quiet_prompt, seed=next(sequence))
            answers.append(await complete(session, floor_url, ENGINE, prompt, opts.quiet_max_tokens))

        tenants: list[dict[str, dict[str, float]]] = []

        async def watch() -> None:
            headers = {"authorization": f"Bearer {KEYS['quiet']}"}
            while True:
                async with session.get(f"{base}/guard/status", headers=headers) as resp:
                    tenants.append((await resp.json())["tenants"])
                await asyncio.sleep(STATUS_INTERVAL_S)

        flood = [asyncio.create_task(flood_client()) for _ in range(opts.flood_clients)]
        await asyncio.sleep(opts.warmup_s)
        start = time.monotonic()
        watcher = asyncio.create_task(watch())
        trickle: list[asyncio.Task[None]] = []
        while time.monotonic() < start + opts.duration_s:
            trickle.append(asyncio.create_task(quiet_one()))
            if floor_url is not None:
                trickle.append(asyncio.create_task(straight_one()))
            await asyncio.sleep(opts.quiet_interval_s)
        end = time.monotonic()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await asyncio.gather(*trickle)
        stop.set()
        await asyncio.gather(*flood)
    return Run(mode, answers, (start, end), idle, tenants)


# -- servers and the report ----------------------------------------------------------------------------
def wait_idle(vllm: ServerProcess, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = sum(
            scrape_counter(f"{vllm.url}/metrics", name)
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )
        if busy == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"vLLM still busy {timeout_s:.0f} s after the run")


def keys_file(path: Path, flood_kv_share: float | None = None) -> Path:
    lines = ["tenants:"]
    for tenant, key in KEYS.items():
        lines += [f"  {tenant}:", "    weight: 1", f"    keys: [{key}]"]
        if tenant == "flood" and flood_kv_share is not None:
            lines.append(f"    limits: {{kv_share: {flood_kv_share}}}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def modes(folder: Path, flood_kv_share: float) -> dict[str, tuple[list[str], Path]]:
    """Each mode's queueing flags and keys file."""
    plain = keys_file(folder / "keys.yaml")
    no_headroom = ["--fair-queueing", "on", "--tenant-headroom", "off"]
    out = {"fair": (["--fair-queueing", "on"], plain), NO_HEADROOM_MODE: (no_headroom, plain),
           "FIFO": (["--fair-queueing", "off"], plain)}
    if flood_kv_share:
        out[SHARE_MODE] = (no_headroom, keys_file(folder / "keys-share.yaml", flood_kv_share))
    return out


def medians(runs: Sequence[Run]) -> dict[str, float | None]:
    table: dict[str, list[float]] = {}
    for run in runs:
        for name, value in run.figures().items():
            table.setdefault(name, [])
            if value is not None:
                table[name].append(value)
    return {name: statistics.median(values) if values else None for name, values in table.items()}


def render(argv: Sequence[str], runs: dict[str, list[Run]], opts: Options, version: str) -> str:
    table = {mode: medians(mode_runs) for mode, mode_runs in runs.items()}
    compared = [mode for mode in table if mode != "FIFO"]

    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}"

    def ratio(mode: str, name: str) -> str:
        a, b = table[mode][name], table["FIFO"][name]
        return "-" if a is None or not b else f"{a / b:.2f}"

    command = f".venv/bin/python bench/tenants.py {' '.join(argv)}".rstrip()
    rows = [
        f"| {name} | " + " | ".join(cell(table[m][name]) for m in table) + " | "
        + " | ".join(ratio(m, name) for m in compared) + " |"
        for name in table["FIFO"]
    ]
    # The idle engine is the same whichever gateway measured it: pool every run's figure.
    idle = statistics.median(r.idle_ttft_s for mode_runs in runs.values() for r in mode_runs if r.idle_ttft_s)

    def over_idle(mode: str, q: str, what: str = "TTFT") -> str:
        ttft = table[mode][f"quiet {q} {what} (s)"]
        return "-" if ttft is None else f"{ttft / idle:.1f}x"

    def over_floor(q: str) -> str:
        ttft, floor = table["fair"][f"quiet {q} TTFT (s)"], table["fair"][f"quiet {q} TTFT straight to vLLM (s)"]
        return "-" if ttft is None or not floor else f"{ttft / floor:.2f}x"

    every = {
        mode: " / ".join(cell(r.figures()["quiet p99 queue wait (s)"]) for r in mode_runs)
        for mode, mode_runs in runs.items()
    }
    lines = [
        f"Measured by `{command}` on {datetime.now(UTC):%Y-%m-%d} ({platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} CPUs, vLLM {version}, CPU build); medians of {len(runs['FIFO'])} runs "
        "per mode, the modes taking turns.",
        "",
        f"Flood: {opts.flood_clients} clients back to back, {opts.flood_prompt} prompt tokens, max_tokens "
        f"{opts.flood_max_tokens} (ignore_eos). Quiet: one request every {opts.quiet_interval_s:g} s for "
        f"{opts.duration_s:g} s, {opts.quiet_prompt} prompt tokens, max_tokens {opts.quiet_max_tokens}. "
        f"vLLM KV cache: {opts.kv_blocks} blocks of {BLOCK_TOKENS} tokens, prefix caching off. "
        "Modes: fair = `--fair-queueing on` (headroom for active tenants on, the default), "
        f"{NO_HEADROOM_MODE} = `--fair-queueing on --tenant-headroom off`, FIFO = `--fair-queueing off`"
        + (f", {SHARE_MODE} = {NO_HEADROOM_MODE} with `limits: {{kv_share: {opts.flood_kv_share:g}}}` on the "
           "flood tenant" if SHARE_MODE in runs else "") + ".",
        "",
        "| | " + " | ".join(table) + " | " + " | ".join(f"{m} / FIFO" for m in compared) + " |",
        "|---|" + "---:|" * (len(table) + len(compared)),
        *rows,
        "",
        "Quiet p99 queue wait (s) of every run: " + "; ".join(f"{m} {w}" for m, w in every.items()) + ".",
        f"Quiet TTFT on an idle engine (median of every run's): {idle:.3f} s. Under the flood, over that: "
        + "; ".join(f"{m} p50 {over_idle(m, 'p50')}, p99 {over_idle(m, 'p99')}" for m in table) + ".",
    ]
    if opts.engine_floor:
        lines.append(
            "The quiet requests sent straight to vLLM during the fair runs (no gateway, the same flood), over the "
            f"idle engine: p50 {over_idle('fair', 'p50', 'TTFT straight to vLLM')}, p99 "
            f"{over_idle('fair', 'p99', 'TTFT straight to vLLM')}; fair through the gateway over them: p50 "
            f"{over_floor('p50')}, p99 {over_floor('p99')}."
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode, taking turns (3)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds the quiet tenant sends (30)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of flood before it starts (5)")
    parser.add_argument("--flood-clients", type=int, default=16, help="flooding clients, back to back (16)")
    parser.add_argument("--flood-prompt", type=int, default=896, help="flood prompt tokens (896)")
    parser.add_argument("--flood-max-tokens", type=int, default=128, help="flood max_tokens (128)")
    parser.add_argument("--quiet-prompt", type=int, default=64, help="quiet prompt tokens (64)")
    parser.add_argument("--quiet-max-tokens", type=int, default=16, help="quiet max_tokens (16)")
    parser.add_argument("--quiet-interval", type=float, default=1.0, help="seconds between quiet requests (1)")
    parser.add_argument("--idle-samples", type=int, default=5, help="quiet requests on the idle engine per run (5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (600)")
    parser.add_argument(
        "--flood-kv-share", type=float, default=0.0,
        help="also run fair queueing without headroom, with this kv_share limit on the flood tenant (0: not run)",
    )
    parser.add_argument(
        "--kv-blocks", type=int, default=KV_BLOCKS,
        help=f"vLLM's KV cache in blocks of {BLOCK_TOKENS} tokens, its null block included ({KV_BLOCKS})",
    )
    parser.add_argument(
        "--engine-floor", action="store_true",
        help="in the fair runs, also send each quiet request straight to vLLM: the engine's own TTFT under the flood",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    opts = Options(
        args.duration, args.warmup, args.flood_clients, args.flood_prompt, args.flood_max_tokens, args.quiet_prompt,
        args.quiet_max_tokens, args.quiet_interval, args.idle_samples, args.timeout, args.flood_kv_share,
        args.kv_blocks, args.engine_floor,
    )
    logs = Path(tempfile.mkdtemp(prefix="tenants-logs-"))
    print(f"tenants: logs in {logs}", file=sys.stderr)
    model = ensure_tiny_model(DEFAULT_MAX_MODEL_LEN)
    vllm = vllm_server(
        model, logs / "vllm.log", kv_cache_memory_bytes=opts.kv_blocks * BLOCK_TOKENS * TOKEN_BYTES,
        extra_args=["--no-enable-prefix-caching"],
    )
    gateways = {
        mode: gateway_server(vllm.url, logs / f"gateway-{mode.replace(' ', '').replace(',', '-')}.log",
                             [*GATEWAY_ARGS, "--keys-file", str(keys), *flags], name=mode)
        for mode, (flags, keys) in modes(logs, args.flood_kv_share).items()
    }
    runs: dict[str, list[Run]] = {mode: [] for mode in gateways}
    try:
        vllm.start()
        vllm.wait_ready(VLLM_READY_PATHS, 600)
        version = get_json(f"{vllm.url}/version").get("version", "?")
        for gateway in gateways.values():
            gateway.start()
            gateway.wait_ready(GATEWAY_READY_PATHS, 120)
        for rep in range(args.repeat):
            for mode, gateway in gateways.items():
                wait_idle(vllm)
                print(f"tenants: run {rep + 1}/{args.repeat}, {mode}", file=sys.stderr)
                floor = vllm.url if opts.engine_floor and mode == "fair" else None
                run = asyncio.run(contend(gateway.url, mode, opts, seed=rep + 1, floor_url=floor))
                runs[mode].append(run)
                print(json.dumps({k: v if v is None else round(v, 3) for k, v in run.figures().items()}),
                      file=sys.stderr)
                errors = sorted({a.error for a in run.answers if not a.ok})
                for error in errors[:5]:
                    print(f"tenants: {mode}: {error}", file=sys.stderr)
    finally:
        for gateway in gateways.values():
            gateway.stop()
        vllm.stop()
    report = render(sys.argv[1:] if argv is None else argv, runs, opts, version)
    print(report)
    if args.out is not None:
        args.out.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
