"""A tenant flooding long requests and a quiet one share a real vLLM (CPU build) through the gateway: fair queueing
with its headroom for active tenants, without the headroom, and in FIFO order.

    python -m bench run tenants                          # 3 turns, about 10 minutes
    python -m bench run tenants --repeat 5 --duration 40
    python -m bench run tenants --kv-blocks 129 --flood-clients 48   # a cache four times larger
    python -m bench run tenants --engine-floor           # and the engine's own TTFT under the flood

vLLM serves the tiny model (prefix caching off) with a KV cache of 33 blocks of 128 tokens: 32 for requests after
vLLM's null block, so four flood requests of 1,024 tokens fill it exactly. The gateways all read one keys file
(key ``bench-flood`` is tenant ``flood``, ``bench-quiet`` tenant ``quiet``, weight 1 each). Targets: ``fair``
(``--fair-queueing on``, its default ``--tenant-headroom on``), ``no-headroom`` (``--tenant-headroom off``),
``fifo`` (``--fair-queueing off``: one queue by priority, FIFO within a priority), ``kv-share`` (with
``--flood-kv-share``: fair without headroom, a ``kv_share`` limit on the flood tenant), ``baseline`` (fair at
``--baseline-commit``). Per run, against one gateway:

- the flood: ``--flood-clients`` clients sending long streamed completions back to back (a closed loop, so the
  queue stays full of them), ``ignore_eos``;
- after a warm-up, the quiet tenant sends one short streamed completion every ``--quiet-interval`` seconds for
  ``--duration`` seconds (an open loop).

Reported: the quiet tenant's p50/p99 queue wait (``x-guard-queue-ms``) and TTFT, each tenant's share of the tokens
served while the quiet tenant was sending, the output tokens a second, the blocks the flood held and the quiet
tenant's demand as the headroom counts it (``/guard/status`` every 0.25 s), with ratios to FIFO. Before every run
the quiet tenant's TTFT is measured on the idle engine through the same gateway. With ``--engine-floor`` the fair
runs also send each quiet request straight to vLLM half an interval later: the engine's own TTFT under the same
flood, which no gateway in front of it can beat.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.harness.scrape import get_json
from bench.targets import engines, proxies
from bench.workloads.tenants import (
    BLOCK_TOKENS,
    GATEWAY_ARGS,
    KV_BLOCKS,
    LABELS,
    TOKEN_BYTES,
    Options,
    Run,
    contend,
    keys_file,
)

SUMMARY = "a flooding tenant and a quiet one through the gateway: fair queueing, without headroom, FIFO"
TARGETS = ["fair", "no-headroom", "fifo", "kv-share"]
DEFAULT_TARGETS = ["fair", "no-headroom", "fifo"]
FLAGS = {"fair": ("--fair-queueing", "on"), "no-headroom": ("--fair-queueing", "on", "--tenant-headroom", "off"),
         "fifo": ("--fair-queueing", "off"), "kv-share": ("--fair-queueing", "on", "--tenant-headroom", "off"),
         "baseline": ("--fair-queueing", "on")}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
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
    parser.add_argument("--flood-kv-share", type=float, default=0.0, help="adds target kv-share: fair without "
                        "headroom, this kv_share limit on the flood tenant (0: not run)")
    parser.add_argument("--kv-blocks", type=int, default=KV_BLOCKS, help=f"vLLM's KV cache in blocks of "
                        f"{BLOCK_TOKENS} tokens, its null block included ({KV_BLOCKS})")
    parser.add_argument("--engine-floor", action="store_true", help="in the fair runs, also send each quiet "
                        "request straight to vLLM: the engine's own TTFT under the flood")


def options(args: argparse.Namespace) -> Options:
    return Options(args.duration, args.warmup, args.flood_clients, args.flood_prompt, args.flood_max_tokens,
                   args.quiet_prompt, args.quiet_max_tokens, args.quiet_interval, args.idle_samples, args.timeout,
                   args.flood_kv_share, args.kv_blocks, args.engine_floor)  # fmt: skip


def measures() -> list[Measure]:
    fmt = {"tokens_per_s": ".0f", "flood_held_blocks": ".1f", "quiet_demand_blocks": ".0f", "quiet_answered": ".0f",
           "failed": ".0f"}
    none = {"quiet_answered", "failed", "floor_p50_ttft_s", "floor_p99_ttft_s", "idle_ttft_s"}
    return [Measure(key, label, fmt.get(key, ".3f"), "none" if key in none else "ratio",
                    "sum" if key == "failed" else "median") for key, label in LABELS.items()]


def summary(meds: dict[str, dict[str, float]], every: list[float], floor: bool) -> str:
    """The quiet tenant's TTFT under the flood over the idle engine's (pooled: the same engine whatever the
    gateway), and over vLLM's own under the flood (``--engine-floor``)."""
    idle = statistics.median(every) if every else math.nan

    def over(value: float) -> str:
        return "-" if math.isnan(value) or not idle else f"{value / idle:.1f}x"

    lines = [f"Quiet TTFT on an idle engine (median of every run's): {idle:.3f} s. Under the flood, over that: "
             + "; ".join(f"{t} p50 {over(m['quiet_p50_ttft_s'])}, p99 {over(m['quiet_p99_ttft_s'])}"
                         for t, m in meds.items()) + "."]  # fmt: skip
    if floor and "fair" in meds:
        f = meds["fair"]
        lines.append(f"The quiet requests sent straight to vLLM during the fair runs, over the idle engine: p50 "
                     f"{over(f['floor_p50_ttft_s'])}, p99 {over(f['floor_p99_ttft_s'])}; fair through the gateway "
                     f"over them: p50 {f['quiet_p50_ttft_s'] / f['floor_p50_ttft_s']:.2f}x, p99 "
                     f"{f['quiet_p99_ttft_s'] / f['floor_p99_ttft_s']:.2f}x.")
    return "\n\n".join(lines)


def run(ctx: Context) -> Result:
    args = ctx.args
    opts = options(args)
    targets = list(args.targets) + (["kv-share"] if args.flood_kv_share and "kv-share" not in args.targets else [])
    if "kv-share" in targets and not args.flood_kv_share:
        raise SystemExit("tenants: target kv-share needs --flood-kv-share")
    vllm = engines.vllm(ctx, "vllm", kv_cache_bytes=opts.kv_blocks * BLOCK_TOKENS * TOKEN_BYTES,
                        flags=("--no-enable-prefix-caching",))
    ctx.start(vllm)
    plain = keys_file(ctx.logs / "keys.yaml")
    share = keys_file(ctx.logs / "keys-share.yaml", args.flood_kv_share) if args.flood_kv_share else plain
    gateways = {t: proxies.gateway(ctx, t, [vllm], commit=args.baseline_commit if t == "baseline" else None,
                                   flags=[*GATEWAY_ARGS, "--keys-file", str(share if t == "kv-share" else plain),
                                          *FLAGS[t]]) for t in targets}  # fmt: skip
    ctx.start(*gateways.values())
    seen: dict[str, list[Run]] = {}

    def one(target: str, turn: int) -> dict[str, float]:
        engines.wait_idle(vllm, 180)
        floor = vllm.url if opts.engine_floor and target == "fair" else None
        r = asyncio.run(contend(gateways[target].url, target, opts, seed=turn + 1, floor_url=floor))
        seen.setdefault(target, []).append(r)
        for error in sorted({a.error for a in r.answers if not a.ok})[:5]:
            ctx.say(f"{target}: {error}")
        return r.figures()

    runs = in_turns(targets, args.repeat, one, lambda t, n, f: ctx.say(f"turn {n + 1} {t}: {f}"))
    result = ctx.result(measures(), runs, ["fifo", "baseline"])
    meds = result.to_json()["medians"]
    every = [r.idle_ttft_s for rs in seen.values() for r in rs if r.idle_ttft_s]
    version = get_json(f"{vllm.url}/version").get("version", "?")
    result.notes = [
        f"vLLM {version} (CPU build), KV cache {opts.kv_blocks} blocks of {BLOCK_TOKENS} tokens, prefix caching off",
        f"flood: {opts.flood_clients} clients back to back, {opts.flood_prompt} prompt tokens, max_tokens "
        f"{opts.flood_max_tokens} (ignore_eos); quiet: one request every {opts.quiet_interval_s:g} s for "
        f"{opts.duration_s:g} s, {opts.quiet_prompt} prompt tokens, max_tokens {opts.quiet_max_tokens}",
    ]
    result.extra_markdown = summary(meds, every, opts.engine_floor)
    return result
