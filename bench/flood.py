"""Flood benchmark: overload a real vLLM (CPU build) straight and through the gateway, side by side.

One invocation starts vLLM on the tiny model with a 4,096-token KV cache (32 blocks of 128 tokens) and
max_model_len 2,048, then runs each workload against each target: vLLM directly, and the gateway (a
``vllm-guard serve`` subprocess) in front of it, once per admission policy asked for. Per column it
reports the preemptions vLLM counted (``vllm:num_preemptions_total`` delta), failed requests, completed
tokens per second and p50/p99 latency, as a markdown table that also goes to docs/flood.md.

Workloads:
- ``full``: every request runs to max_tokens (``ignore_eos``). 12 x (1,000 + 900) tokens against a
  4,096-token cache: vLLM admits more than fits and preempts; the gateway's ledger should not.
- ``early``: the same requests, but each one really stops early, at an EOS that comes at a random
  "true length" far below max_tokens, which the gateway cannot know: the request carries
  ``min_tokens`` = true length - 1 and a +100 ``logit_bias`` on EOS, so vLLM's own EOS check ends it
  at the true length (finish_reason "stop") and frees its blocks in that step, while the gateway sees
  max_tokens 900. (Random weights emit EOS at no chosen place by themselves; a stop token calibrated
  from seeded sampling crashed the CPU engine, whose generator cannot rewind for chunked prefills;
  disconnecting the client measured vLLM's late disconnect detection instead of early stops.) This is
  where an adaptive policy (live KV usage) should beat a strict one (worst case only).

With ``--stream`` the requests stream and the table adds time to first token. Unless ``--no-plot``, vLLM's
/metrics is sampled during every flood and one PNG per workload goes beside the report (``img/<report>.png``,
``img/<report>-<workload>.png`` when there are several): vLLM's KV usage and cumulative preemptions over time,
one line per column, and throughput and TTFT (or latency) bars. It needs the ``bench`` extra (matplotlib);
without it the benchmark runs and says the picture was skipped.

    .venv/bin/python bench/flood.py                       # vLLM direct and the gateway, both workloads
    .venv/bin/python bench/flood.py --policy strict --policy adaptive --workload early
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.flood_client import Outcome, Workload, build_workloads, flood  # noqa: E402
from bench.harness.plots import ColumnBars, Timeline, flood_figure, unavailable  # noqa: E402
from bench.harness.timeline import MetricsSampler  # noqa: E402
from tests.e2e.servers import (  # noqa: E402
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    GATEWAY_READY_PATHS,
    VLLM_READY_PATHS,
    ServerProcess,
    ensure_tiny_model,
    gateway_server,
    get_json,
    scrape_counter,
    vllm_server,
)

PREEMPTIONS = "vllm:num_preemptions_total"
GENERATED = "vllm:generation_tokens_total"
KV_USAGE = "vllm:kv_cache_usage_perc"
# Long enough that the gateway queues rather than sheds: the table compares preemption with queueing.
DEFAULT_GATEWAY_ARGS = ("--queue-timeout", "600")


@dataclass(frozen=True)
class Target:
    """One column: vLLM straight (``gateway_args`` None) or a gateway variant in front of it."""

    name: str
    gateway_args: tuple[str, ...] | None = None


@dataclass
class Column:
    target: Target
    outcomes: list[Outcome] = field(default_factory=list)
    preemptions: float = 0.0
    # What vLLM really decoded: a client that went away must not leave its request running upstream.
    generated: float = 0.0
    wall_s: float = 0.0
    # Over all repeats of this column (the column itself is the run of median throughput).
    all_runs: list[float] = field(default_factory=list)
    all_preemptions: float = 0.0
    all_failed: int = 0
    # vLLM's /metrics during the flood (empty when not sampled), times relative to the flood's start.
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    preemptions_before: float = 0.0

    @property
    def failed(self) -> int:
        return sum(not o.ok for o in self.outcomes)

    def tokens_per_s(self) -> float:
        done = sum(o.tokens for o in self.outcomes if o.ok)
        return done / self.wall_s if self.wall_s > 0 else 0.0

    def latency(self, q: float) -> float | None:
        lat = sorted(o.latency_s for o in self.outcomes if o.ok)
        return _nearest_rank(lat, q)

    def ttft(self, q: float) -> float | None:
        return _nearest_rank(sorted(o.ttft_s for o in self.outcomes if o.ok and o.ttft_s is not None), q)

    def timeline(self) -> Timeline:
        return Timeline(
            self.target.name,
            [t for t, _ in self.samples],
            [m[KV_USAGE] for _, m in self.samples],
            [m[PREEMPTIONS] - self.preemptions_before for _, m in self.samples],
        )


def _nearest_rank(ordered: Sequence[float], q: float) -> float | None:
    # Nearest rank: with 12 requests p99 is the slowest one, not an interpolation past it.
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else None


def wait_idle(vllm: ServerProcess, timeout_s: float = 120.0) -> None:
    """Until vLLM runs and queues nothing, so that one flood's tail never overlaps the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = sum(
            scrape_counter(f"{vllm.url}/metrics", name)
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )
        if busy == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"vLLM still busy {timeout_s:.0f} s after the flood")


@dataclass(frozen=True)
class RunOptions:
    timeout_s: float
    stream: bool
    sample_interval_s: float | None  # None: vLLM's /metrics is not sampled (no picture)


def run_column(
    vllm: ServerProcess, target: Target, workload: Workload, base: str, eos_id: int, opts: RunOptions
) -> Column:
    metrics = f"{vllm.url}/metrics"
    wait_idle(vllm)
    before = {name: scrape_counter(metrics, name) for name in (PREEMPTIONS, GENERATED)}
    # The sampler runs until vLLM is idle again, so the picture shows the KV cache draining too.
    sampler = MetricsSampler(metrics, (KV_USAGE, PREEMPTIONS), opts.sample_interval_s or 1.0)
    with sampler if opts.sample_interval_s else contextlib.nullcontext():
        started = time.monotonic()
        outcomes, wall = asyncio.run(flood(base, workload, eos_id, opts.timeout_s, opts.stream))
        wait_idle(vllm)
    if opts.sample_interval_s:
        print(f"flood: vLLM /metrics: {sampler.summary()}", file=sys.stderr)
    after = {name: scrape_counter(metrics, name) for name in (PREEMPTIONS, GENERATED)}
    return Column(
        target,
        outcomes,
        preemptions=after[PREEMPTIONS] - before[PREEMPTIONS],
        generated=after[GENERATED] - before[GENERATED],
        wall_s=wall,
        samples=[(at - started, values) for at, values in sampler.samples],
        preemptions_before=before[PREEMPTIONS],
    )


def markdown_table(columns: Sequence[Column]) -> str:
    def fmt(v: float | None, digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    rows: list[tuple[str, list[str]]] = [
        ("preemptions (vLLM)", [f"{c.preemptions:.0f}" for c in columns]),
        ("failed requests", [f"{c.failed} / {len(c.outcomes)}" for c in columns]),
        ("completed tokens/s", [fmt(c.tokens_per_s(), 1) for c in columns]),
        ("tokens vLLM generated", [f"{c.generated:.0f}" for c in columns]),
        ("requests of planned length", [f"{sum(o.as_planned for o in c.outcomes)}" for c in columns]),
        ("p50 latency (s)", [fmt(c.latency(0.50)) for c in columns]),
        ("p99 latency (s)", [fmt(c.latency(0.99)) for c in columns]),
        *(
            [
                ("p50 TTFT (s)", [fmt(c.ttft(0.50)) for c in columns]),
                ("p99 TTFT (s)", [fmt(c.ttft(0.99)) for c in columns]),
            ]
            if any(o.ttft_s is not None for c in columns for o in c.outcomes)
            else []
        ),
        ("wall time (s)", [fmt(c.wall_s, 1) for c in columns]),
    ]
    if any(len(c.all_runs) > 1 for c in columns):
        rows += [
            ("tokens/s of every run", [" / ".join(f"{t:.0f}" for t in c.all_runs) for c in columns]),
            ("preemptions, all runs", [f"{c.all_preemptions:.0f}" for c in columns]),
            ("failed requests, all runs", [str(c.all_failed) for c in columns]),
        ]
        rows[0] = ("preemptions (vLLM), median run", rows[0][1])
    lines = [
        "| | " + " | ".join(c.target.name for c in columns) + " |",
        "|---|" + "---:|" * len(columns),
        *(f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows),
    ]
    return "\n".join(lines)


def failures(columns: Sequence[Column]) -> list[str]:
    seen: list[str] = []
    for c in columns:
        for o in c.outcomes:
            line = f"{c.target.name}: {o.error}"
            if not o.ok and line not in seen:
                seen.append(line)
    return seen


def targets_from(policies: Sequence[str], gateway_args: Sequence[str]) -> list[Target]:
    base = (*DEFAULT_GATEWAY_ARGS, *gateway_args)
    out = [Target("vLLM direct")]
    if not policies:
        out.append(Target("gateway", base))
    out.extend(Target(f"gateway ({p})", (*base, "--admission-policy", p)) for p in policies)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", choices=["full", "early"], help="repeatable; default both")
    parser.add_argument(
        "--policy", action="append", default=[], metavar="strict|adaptive",
        help="add a gateway column with --admission-policy POLICY (repeatable); default: one gateway "
        "column with the gateway's default policy",
    )  # fmt: skip
    parser.add_argument(
        "--gateway-arg", action="append", default=[], metavar="ARG",
        help=f"extra argument for every gateway (repeatable; after {' '.join(DEFAULT_GATEWAY_ARGS)})",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=12, help="concurrent requests per flood (12)")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length in tokens (1000)")
    parser.add_argument("--max-tokens", type=int, default=900, help="max_tokens of every request (900)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per column, taking turns; the median is shown (3)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one flood may take (900)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "flood.md", help="markdown report path")
    parser.add_argument("--stream", action="store_true", help="stream the requests; the table adds TTFT")
    parser.add_argument("--no-plot", action="store_true", help="no picture, and vLLM's /metrics is not sampled")
    parser.add_argument("--plot-dir", type=Path, default=None, help="where the PNGs go (default: img/ beside --out)")
    parser.add_argument(
        "--sample-interval", type=float, default=0.1, help="seconds between samples of vLLM's /metrics (0.1)"
    )
    args = parser.parse_args(argv)
    skipped = "--no-plot" if args.no_plot else unavailable()
    if skipped:
        print(f"flood: no picture ({skipped})", file=sys.stderr)
    opts = RunOptions(args.timeout, args.stream, None if skipped else args.sample_interval)

    targets = targets_from(args.policy, args.gateway_arg)
    logs = Path(tempfile.mkdtemp(prefix="flood-logs-"))
    print(f"flood: logs in {logs}", file=sys.stderr)

    workloads = build_workloads(
        args.workload or ["full", "early"], args.requests, args.prompt_tokens, args.max_tokens, args.seed
    )
    results: dict[str, list[Column]] = {w.name: [] for w in workloads}
    model = ensure_tiny_model(DEFAULT_MAX_MODEL_LEN)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    eos_id = int(eos[0] if isinstance(eos, list) else eos)
    # Prefix caching off: every column then does the same prefill work for the same prompts.
    vllm = vllm_server(model, logs / "vllm.log", extra_args=["--no-enable-prefix-caching"])
    gateways: dict[str, ServerProcess] = {}
    runs: dict[tuple[str, str], list[Column]] = {}
    try:
        vllm.start()
        vllm.wait_ready(VLLM_READY_PATHS, 600)
        version = get_json(f"{vllm.url}/version").get("version", "?")
        for target in targets:
            if target.gateway_args is not None:
                slug = target.name.replace(" ", "-").replace("(", "").replace(")", "")
                gateway = gateway_server(vllm.url, logs / f"{slug}.log", target.gateway_args, name=target.name)
                gateways[target.name] = gateway
                gateway.start()
                gateway.wait_ready(GATEWAY_READY_PATHS, 120)
        # Columns take turns, run after run: a slow spell of this shared machine then hits every column alike,
        # and each cell reports the run of median throughput.
        for rep in range(args.repeat):
            for workload in workloads:
                for target in targets:
                    gateway = gateways.get(target.name)
                    base = gateway.url if gateway else vllm.url
                    print(f"flood: run {rep + 1}/{args.repeat} {workload.name} -> {target.name}", file=sys.stderr)
                    column = run_column(vllm, target, workload, base, eos_id, opts)
                    runs.setdefault((workload.name, target.name), []).append(column)
                    print(markdown_table([column]), file=sys.stderr)
    finally:
        for gateway in gateways.values():
            gateway.stop()
        vllm.stop()
    for workload in workloads:
        for target in targets:
            done = sorted(runs[(workload.name, target.name)], key=Column.tokens_per_s)
            median = done[len(done) // 2]
            median.all_runs = [c.tokens_per_s() for c in runs[(workload.name, target.name)]]
            median.all_preemptions = sum(c.preemptions for c in done)
            median.all_failed = sum(c.failed for c in done)
            results[workload.name].append(median)

    pictures = {} if skipped else draw_pictures(args.out, args.plot_dir, workloads, results, args.repeat)
    report = render_report(argv, workloads, results, targets, version, pictures)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report, encoding="utf-8")
    print(f"flood: written to {args.out}", file=sys.stderr)
    return 0


def draw_pictures(
    out: Path, plot_dir: Path | None, workloads: Sequence[Workload], results: dict[str, list[Column]], repeat: int
) -> dict[str, str]:
    """One PNG per workload; returns each one's path relative to the report, for its markdown link."""
    folder = plot_dir or out.parent / "img"
    links: dict[str, str] = {}
    for w in workloads:
        columns = results[w.name]
        path = folder / (f"{out.stem}.png" if len(workloads) == 1 else f"{out.stem}-{w.name}.png")
        streamed = any(o.ttft_s is not None for c in columns for o in c.outcomes)
        which = "one run" if repeat == 1 else f"the median run of {repeat}"
        title = (
            f"Flood '{w.name}': {len(w.requests)} concurrent requests into a 4,096-token KV cache, "
            f"vLLM direct vs. vllm-guard\n(vLLM CPU build, tiny model; {which} per column)"
        )
        bars = [
            ColumnBars(
                c.target.name,
                c.tokens_per_s(),
                c.ttft(0.5) if streamed else c.latency(0.5),
                c.ttft(0.99) if streamed else c.latency(0.99),
            )
            for c in columns
        ]
        wait = "time to first token" if streamed else "end-to-end latency"
        flood_figure(path, title, [c.timeline() for c in columns], bars, wait)
        print(f"flood: picture written to {path}", file=sys.stderr)
        links[w.name] = os.path.relpath(path, out.parent)
    return links


def render_report(
    argv: Sequence[str] | None,
    workloads: Sequence[Workload],
    results: dict[str, list[Column]],
    targets: Sequence[Target],
    vllm_version: str,
    pictures: dict[str, str],
) -> str:
    shown = " ".join(sys.argv[1:] if argv is None else argv)
    command = f".venv/bin/python bench/flood.py {shown}".rstrip()
    parts = [
        "# Flood: vLLM alone vs. behind vllm-guard",
        "",
        f"Measured by `{command}` on {datetime.now(UTC):%Y-%m-%d} "
        f"({platform.machine()}, {_cpu_count()} CPUs, vLLM {vllm_version}, CPU build).",
        "",
        f"vLLM serves the tiny random-weight model with a {DEFAULT_KV_CACHE_BYTES / 2**20:g} MiB KV cache "
        f"(32 blocks of 128 = 4,096 tokens), max_model_len {DEFAULT_MAX_MODEL_LEN}, prefix caching off. "
        "Preemptions are vLLM's own count (`vllm:num_preemptions_total`) during each flood; tokens/s "
        "counts the generated tokens of requests that succeeded, over the flood's wall time; "
        "\"tokens vLLM generated\" is vLLM's own count (`vllm:generation_tokens_total`), which shows work "
        "done for nobody (an abandoned request left running); latency is per successful request, end to "
        "end as the client sees it. Columns take turns; each cell is the run of median throughput, and "
        "the last rows cover every run (this machine's speed varies by tens of percent from minute to minute).",
        "",
        "Gateway columns: "
        + "; ".join(f"{t.name} = `vllm-guard serve {' '.join(t.gateway_args)}`" for t in targets if t.gateway_args)
        + ".",
    ]
    for w in workloads:
        parts += ["", f"## {w.name}", "", w.description + ".", "", markdown_table(results[w.name])]
        if w.name in pictures:
            parts += [
                "",
                f"![{w.name}: vLLM's KV usage and preemptions over time, throughput and waits per column]"
                f"({pictures[w.name]})",
                "",
                "The picture is of the run each column shows: vLLM's `vllm:kv_cache_usage_perc` and "
                "`vllm:num_preemptions_total` sampled during the flood and until vLLM was idle again.",
            ]
        errors = failures(results[w.name])
        if errors:
            parts += ["", "Failures (distinct):", "", *(f"- {e}" for e in errors[:10])]
    parts += [
        "",
        "How the `early` requests stop early for real: each carries `min_tokens` = its true length - 1 and a "
        "+100 `logit_bias` on EOS. vLLM masks EOS until min_tokens and then EOS wins, so the request ends "
        "there with finish_reason \"stop\" and its blocks are freed in that step, exactly as at a real EOS; "
        "the gateway only sees max_tokens. True lengths come from a fixed seed, the same for every column. "
        "Rejected alternatives: random weights emit EOS at no chosen place; a stop token calibrated from "
        "seeded sampling crashed the CPU engine (`RuntimeError: CPU Generator does not use offset` once "
        "seeded requests are chunk-prefilled); disconnecting the client at the true length measured how "
        "late a busy vLLM notices a disconnect rather than early stops.",
        "",
    ]
    return "\n".join(parts)


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


if __name__ == "__main__":
    raise SystemExit(main())
