"""Overload a real vLLM (CPU build): vLLM alone and through the gateway, side by side.

    python -m bench run flood                                   # vLLM alone and the gateway, both workloads
    python -m bench run flood --target direct --target strict --target adaptive --workload early --stream

vLLM serves the tiny model with a 4,096-token KV cache (32 blocks of 128 tokens), max_model_len 2,048, prefix
caching off (every target then does the same prefill work for the same prompts). Workloads:

- ``full``: every request runs to max_tokens (``ignore_eos``): 12 x (1,000 + 900) tokens against a 4,096-token
  cache. vLLM admits more than fits and preempts; the gateway's ledger should not;
- ``early``: the same requests, but each one really stops early, at an EOS far below max_tokens that nobody can
  know in advance: the request is sampled with a ``logit_bias`` on EOS alone that makes each token end it with the
  chance 1 / its planned length, so vLLM's own EOS check ends it at a geometric length around the plan
  (finish_reason "stop") and frees its blocks in that step, while the gateway sees max_tokens 900 (a
  ``min_tokens`` would declare the length). Where an adaptive policy (live KV usage) should beat a
  strict one (worst case only).

Targets: ``direct`` (vLLM), ``gateway`` (its default policy), ``strict``, ``adaptive``, ``baseline`` (the default
policy at ``--baseline-commit``); the gateways run with ``--queue-timeout 600`` (they queue rather than shed: the
table compares preemption with queueing). Per target: vLLM's preemptions (``vllm:num_preemptions_total``), failed
requests, completed tokens/s, the tokens vLLM generated (work done for nobody shows there), requests of planned
length, p50/p99 latency (and TTFT with ``--stream``). vLLM's /metrics is sampled during every flood (unless
``--no-plot``): one picture per workload of the median run of each target, KV usage and preemptions over time
with throughput and wait bars.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

from bench.harness import plots
from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.harness.scrape import get_json, scrape
from bench.harness.target import Target
from bench.harness.timeline import MetricsSampler
from bench.targets import engines, proxies
from bench.workloads.flood import KV_USAGE, PREEMPTIONS, Column, Workload, build_workloads, flood

SUMMARY = "a flood of long requests into a 32-block KV cache: preemptions, failures, tokens/s, vLLM alone vs gateway"
TARGETS = ["direct", "gateway", "strict", "adaptive"]
DEFAULT_TARGETS = ["direct", "gateway"]
GENERATED = "vllm:generation_tokens_total"
GATEWAY_ARGS = ("--queue-timeout", "600")
POLICY = {"gateway": (), "baseline": (), "strict": ("--admission-policy", "strict"),
          "adaptive": ("--admission-policy", "adaptive")}  # fmt: skip
EARLY_STOP = (
    "How the `early` requests stop early for real: each is sampled with a `logit_bias` on EOS alone that makes each "
    "token end it with the chance 1 / its planned length, so vLLM's own EOS check ends it (finish_reason \"stop\", "
    "its blocks freed in that step) at a geometric length around the plan that nobody knows in advance; the gateway "
    "only sees max_tokens (a `min_tokens` would declare the length, and the gateway books what requests declare). "
    "Planned lengths come from a fixed seed, the same for every target. Rejected alternatives: a stop token "
    "calibrated from seeded sampling crashed the CPU engine (`RuntimeError: CPU Generator does not use offset` once "
    "seeded requests are chunk-prefilled); disconnecting the client at the true length measured how late a busy "
    "vLLM notices a disconnect rather than early stops."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--workload", action="append", choices=["full", "early"], help="repeatable; default both")
    parser.add_argument("--requests", type=int, default=12, help="concurrent requests per flood (12)")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length in tokens (1000)")
    parser.add_argument("--max-tokens", type=int, default=900, help="max_tokens of every request (900)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one flood may take (900)")
    parser.add_argument("--stream", action="store_true", help="stream the requests; the table adds TTFT")
    parser.add_argument("--no-plot", action="store_true", help="no picture, and vLLM's /metrics is not sampled")
    parser.add_argument("--sample-interval", type=float, default=0.1, help="seconds between samples of /metrics")


def measures(workloads: list[Workload], stream: bool) -> list[Measure]:
    out: list[Measure] = []
    for w in workloads:
        n = w.name
        out += [Measure(f"{n}_preemptions", f"{n}: preemptions (vLLM)", ".0f", "none"),
                Measure(f"{n}_failed", f"{n}: failed requests (all runs)", ".0f", "none", "sum"),
                Measure(f"{n}_tokens_per_s", f"{n}: completed tokens/s", ".1f"),
                Measure(f"{n}_generated", f"{n}: tokens vLLM generated", ".0f"),
                Measure(f"{n}_as_planned", f"{n}: requests of planned length", ".0f", "none"),
                Measure(f"{n}_p50_latency_s", f"{n}: p50 latency s"),
                Measure(f"{n}_p99_latency_s", f"{n}: p99 latency s")]
        if stream:
            out += [Measure(f"{n}_p50_ttft_s", f"{n}: p50 TTFT s"), Measure(f"{n}_p99_ttft_s", f"{n}: p99 TTFT s")]
        out += [Measure(f"{n}_wall_s", f"{n}: wall time s", ".1f")]
    return out


def one(ctx: Context, vllm: Target, target: str, workload: Workload, base: str, eos_id: int) -> Column:
    args = ctx.args
    engines.wait_idle(vllm, 120)
    before = {name: scrape(vllm.url, name) for name in (PREEMPTIONS, GENERATED)}
    sampled = not args.no_plot and plots.unavailable() is None
    # The sampler runs until vLLM is idle again, so the picture shows the KV cache draining too.
    sampler = MetricsSampler(f"{vllm.url}/metrics", (KV_USAGE, PREEMPTIONS), args.sample_interval)
    with sampler if sampled else contextlib.nullcontext():
        started = time.monotonic()
        outcomes, wall = asyncio.run(flood(base, workload, eos_id, args.timeout, args.stream))
        engines.wait_idle(vllm, 120)
    after = {name: scrape(vllm.url, name) for name in (PREEMPTIONS, GENERATED)}
    return Column(target, outcomes, preemptions=after[PREEMPTIONS] - before[PREEMPTIONS],
                  generated=after[GENERATED] - before[GENERATED], wall_s=wall,
                  samples=[(at - started, values) for at, values in sampler.samples] if sampled else [],
                  preemptions_before=before[PREEMPTIONS])  # fmt: skip


def picture(ctx: Context, workload: Workload, columns: list[Column]) -> str:
    streamed = any(o.ttft_s is not None for c in columns for o in c.outcomes)
    title = (f"Flood '{workload.name}': {len(workload.requests)} concurrent requests into a 4,096-token KV cache, "
             f"vLLM alone vs. vllm-guard\n(vLLM CPU build, tiny model; the median run of each target)")
    bars = [plots.ColumnBars(c.target, c.tokens_per_s(), c.ttft(0.5) if streamed else c.latency(0.5),
                             c.ttft(0.99) if streamed else c.latency(0.99)) for c in columns]  # fmt: skip
    path = ctx.picture(workload.name)
    plots.flood_figure(path, title, [c.timeline() for c in columns], bars,
                       "time to first token" if streamed else "end-to-end latency")
    return path.name


def run(ctx: Context) -> Result:
    args = ctx.args
    targets = list(args.targets)
    if "direct" not in targets:
        targets.insert(0, "direct")
    workloads = build_workloads(args.workload or ["full", "early"], args.requests, args.prompt_tokens,
                                args.max_tokens, args.seed)
    model = engines.tiny_model()
    eos_id = engines.eos_id(model)
    vllm = engines.vllm(ctx, "direct", flags=("--no-enable-prefix-caching",), model=model)
    ctx.start(vllm)
    gateways = {t: proxies.gateway(ctx, t, [vllm], flags=[*GATEWAY_ARGS, *POLICY[t]],
                                   commit=args.baseline_commit if t == "baseline" else None)
                for t in targets if t != "direct"}  # fmt: skip
    ctx.start(*gateways.values())
    columns: dict[tuple[str, str], list[Column]] = {}

    def measure(target: str, turn: int) -> dict[str, float]:
        out: dict[str, float] = {}
        base = gateways[target].url if target in gateways else vllm.url
        for w in workloads:
            column = one(ctx, vllm, target, w, base, eos_id)
            columns.setdefault((w.name, target), []).append(column)
            out |= column.as_dict(f"{w.name}_")
        return out

    runs = in_turns(targets, args.repeat, measure, lambda t, n, f: ctx.say(f"turn {n + 1} {t}: {f}"))
    medians = {key: sorted(cs, key=Column.tokens_per_s)[len(cs) // 2] for key, cs in columns.items()}
    pictures = [] if args.no_plot or plots.unavailable() else [
        picture(ctx, w, [medians[(w.name, t)] for t in targets]) for w in workloads]
    failures = sorted({f"{c.target}: {o.error}" for cs in columns.values() for c in cs for o in c.outcomes
                       if not o.ok})[:10]  # fmt: skip
    extra = "\n".join([*(f"- {w.name}: {w.description}" for w in workloads), "", EARLY_STOP,
                       *(["", "Failures (distinct):", "", *(f"- {f}" for f in failures)] if failures else [])])
    version = get_json(f"{vllm.url}/version").get("version", "?")
    notes = [f"vLLM {version} (CPU build), tiny model, 4 MiB KV cache (32 blocks of 128), prefix caching off; "
             "gateways with " + " ".join(GATEWAY_ARGS) + "; the pictures show each target's median run"]
    return ctx.result(measures(workloads, args.stream), runs, ["direct", "baseline"], notes=notes,
                      extra_markdown=extra, pictures=pictures)
