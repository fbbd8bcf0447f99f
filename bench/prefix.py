"""Prefix benchmark: shared-prompt workloads on a real vLLM (CPU build, prefix caching on), straight and through
the gateway under each admission policy, runs taken in turns, medians reported.

vLLM serves the tiny model with a 4,096-token KV cache (32 blocks of 128, one of them vLLM's null block) and
max_model_len 2,048, prefix caching on as by default. Workloads:

- ``shared``: vLLM's own benchmark client, dataset ``prefix_repetition``: 24 requests sharing one 1,200-token
  prefix plus 60 unique tokens, 200 output tokens, all at once (``--request-rate inf``), completions backend;
- ``groups``: the same with four prefixes (four system prompts), 32 requests;
- ``chat``: vLLM's benchmark client, chat backend (``openai-chat``), 16 x (900 prompt + 600 output) tokens,
  ``--ignore-eos``: requests run to their limit;
- ``multiturn``: the OpenAI SDK: 8 conversations of 4 turns, each turn re-sending the conversation so far plus a
  new question, streamed, 100 output tokens;
- ``n4``: the OpenAI SDK: 6 chat requests of ~700 prompt tokens with ``n = 4``, 120 output tokens, streamed.
- ``overload``: vLLM's benchmark client, chat backend: 64 requests arriving at 6 a second (Poisson), random
  dataset of 700 prompt and 500 output tokens, each +-90% (``--random-range-ratio 0.9``), ``--ignore-eos``; the
  gateways keep their default 30-s queue timeout. Also counted: requests refused by the forecast (503
  ``queue_timeout_expected``) and after waiting the whole timeout (``queue_timeout``), from the gateway's metrics;
  ``--policy strict-noshed`` is strict with ``--shed-early off``, as before shedding early.

Every run uses its own seed, so no run finds the previous run's prompts in the cache. Per cell: output tokens/s
(and its ratio to direct), mean and p99 TTFT, mean TPOT, preemptions and prefix-cache hit rate (vLLM's own
counters), failed requests; the median of the runs by throughput.

    .venv/bin/python bench/prefix.py                       # every workload, direct / strict / adaptive, 3 runs
    .venv/bin/python bench/prefix.py --workload shared --repeat 5
    .venv/bin/python bench/prefix.py --workload chat --policy strict --policy strict+time
    .venv/bin/python bench/prefix.py --workload shared --workload chat --workload overload \
        --policy watermark --policy strict --policy default     # vLLM's --watermark 0.05 beside the gateway
    .venv/bin/python bench/prefix.py ... --engine-core-nice 10  # both engines' engine cores at niceness 10
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.prefix_clients import gateway_refusals, multiturn, n_sampling, vllm_bench  # noqa: E402
from bench.realistic import renice_engine_core  # noqa: E402
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

COUNTERS = ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
GATEWAY_ARGS = ("--queue-timeout", "600")
# Gateway targets: the admission policy, and strict with time-aware booking (``--time-aware on``).
MODES = {"strict": ("--admission-policy", "strict"), "adaptive": ("--admission-policy", "adaptive"),
         "strict+time": ("--admission-policy", "strict", "--time-aware", "on"),
         "default": ()}  # the gateway as it starts without a policy flag
# Not a gateway: a second vLLM with the same cache and vLLM's own --watermark, what a user would set instead.
WATERMARK = "watermark"
WATERMARK_ARGS = ("--watermark", "0.05")


@dataclass
class Run:
    tokens_per_s: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    failed: int
    preemptions: float = 0.0
    hit_rate: float | None = None
    shed: float = 0.0  # refused by the forecast, before the deadline (overload)
    timed_out: float = 0.0  # refused after waiting the whole queue timeout (overload)


Workload = Callable[[str, Path, int], Run]


def _bench(dataset: list[str], backend: str = "openai") -> Workload:
    def run(base: str, model: Path, seed: int) -> Run:
        endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
        result = vllm_bench([
            "--backend", backend, "--base-url", base, "--endpoint", endpoint, "--model", SERVED_MODEL_NAME,
            "--tokenizer", str(model), "--seed", str(seed), "--request-rate", "inf", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "99", *dataset,
        ])
        return Run(
            float(result["output_throughput"]), float(result["mean_ttft_ms"]), float(result["p99_ttft_ms"]),
            float(result["mean_tpot_ms"]), int(result.get("failed", 0)),
        )

    return run


def _sdk(fn: Callable[[str, int], Any]) -> Workload:
    def run(base: str, model: Path, seed: int) -> Run:
        stats = asyncio.run(fn(base, seed))
        return Run(stats.tokens_per_s, stats.mean_ttft_ms, stats.p99_ttft_ms, stats.mean_tpot_ms, stats.failed)

    return run


PREFIX_ARGS = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1200",
               "--prefix-repetition-suffix-len", "60", "--prefix-repetition-output-len", "200"]
WORKLOADS: dict[str, Workload] = {
    "shared": _bench([*PREFIX_ARGS, "--prefix-repetition-num-prefixes", "1", "--num-prompts", "24"]),
    "groups": _bench([*PREFIX_ARGS, "--prefix-repetition-num-prefixes", "4", "--num-prompts", "32"]),
    "chat": _bench(["--dataset-name", "random", "--random-input-len", "900", "--random-output-len", "600",
                    "--num-prompts", "16", "--ignore-eos"], backend="openai-chat"),
    "multiturn": _sdk(multiturn),
    "n4": _sdk(n_sampling),
}

# The overload's gateways keep the default 30-s queue timeout, as a user runs them: these flags come after
# GATEWAY_ARGS, and the last --queue-timeout wins.
WORKLOAD_GATEWAY_ARGS: dict[str, tuple[str, ...]] = {"overload": ("--queue-timeout", "30")}
MODES["strict-noshed"] = ("--admission-policy", "strict", "--shed-early", "off")  # what shedding early changes
_OVERLOAD_BENCH = _bench(
    # After ``_bench``'s own ``--request-rate inf``: argparse keeps the last.
    ["--dataset-name", "random", "--random-input-len", "700", "--random-output-len", "500",
     "--random-range-ratio", "0.9", "--num-prompts", "64", "--ignore-eos", "--request-rate", "6"],
    backend="openai-chat",
)


def _overload(base: str, model: Path, seed: int) -> Run:
    before = gateway_refusals(base)
    run = _OVERLOAD_BENCH(base, model, seed)
    after = gateway_refusals(base)
    run.shed = after.get("queue_timeout_expected", 0.0) - before.get("queue_timeout_expected", 0.0)
    run.timed_out = after.get("queue_timeout", 0.0) - before.get("queue_timeout", 0.0)
    return run


WORKLOADS["overload"] = _overload


def gateway_key(target: str, workload: str) -> str:
    """The gateway a workload runs against: one per target, and one more per target for workloads with flags of
    their own."""
    return f"{target}@{workload}" if workload in WORKLOAD_GATEWAY_ARGS else target


def overload_table(by_target: dict[str, list[Run]], targets: Sequence[str]) -> str:
    """The overload against its targets: completed requests, refused by the forecast and after the whole timeout
    (all runs), and the medians' ratios to direct."""
    lines = ["| overload | completed (runs) | refused early by the forecast | refused after the whole timeout | "
             "output tok/s x direct | p99 TTFT ms (x direct) |", "|" + " --- |" * 6]
    direct = by_target["direct"]
    direct_tps = statistics.median(r.tokens_per_s for r in direct)
    direct_p99 = statistics.median(r.p99_ttft_ms for r in direct)
    for target in targets:
        runs = by_target[target]
        completed = ", ".join(str(64 - r.failed) for r in runs)
        p99 = statistics.median(r.p99_ttft_ms for r in runs)
        shed, timed_out = sum(r.shed for r in runs), sum(r.timed_out for r in runs)
        lines.append(
            f"| {target} | {completed} of 64 | {shed:.0f} | {timed_out:.0f} | "
            f"{statistics.median(r.tokens_per_s for r in runs) / direct_tps:.2f} | {p99:.0f} ({p99 / direct_p99:.2f}) |"
        )
    return "\n".join(lines)


def wait_idle(vllm: ServerProcess, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = sum(scrape_counter(f"{vllm.url}/metrics", n) for n in ("vllm:num_requests_running",
                                                                     "vllm:num_requests_waiting"))
        if busy == 0:
            return
        time.sleep(0.5)
    raise RuntimeError("vLLM still busy after the run")


def measure(vllm: ServerProcess, workload: Workload, base: str, model: Path, seed: int) -> Run:
    wait_idle(vllm)
    before = {n: scrape_counter(f"{vllm.url}/metrics", n) for n in COUNTERS}
    run = workload(base, model, seed)
    wait_idle(vllm)
    after = {n: scrape_counter(f"{vllm.url}/metrics", n) for n in COUNTERS}
    delta = {n: after[n] - before[n] for n in COUNTERS}
    run.preemptions = delta[COUNTERS[0]]
    run.hit_rate = delta[COUNTERS[1]] / delta[COUNTERS[2]] if delta[COUNTERS[2]] else None
    return run


def table(results: dict[str, dict[str, list[Run]]], targets: Sequence[str]) -> str:
    # tok/s x TPOT: the sequences running at once, on average, as the median run's decode saw them; on this CPU
    # the batch, more than anything the gateway does per request, sets the throughput.
    lines = ["| workload | target | output tok/s (runs) | x direct | mean TTFT ms | p99 TTFT ms | mean TPOT ms | "
             "sequences at once (tok/s x TPOT) | preemptions (all runs) | prefix-cache hit rate | failed |",
             "|" + " --- |" * 11]
    for name, by_target in results.items():
        direct = statistics.median(r.tokens_per_s for r in by_target["direct"])
        for target in targets:
            runs = by_target[target]
            med = sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]
            each = ", ".join(f"{r.tokens_per_s:.0f}" for r in runs)
            ratio = statistics.median(r.tokens_per_s for r in runs) / direct if direct else float("nan")
            hit = "—" if med.hit_rate is None else f"{med.hit_rate:.2f}"
            lines.append(
                f"| {name} | {target} | {med.tokens_per_s:.0f} ({each}) | {ratio:.2f} | {med.mean_ttft_ms:.0f} | "
                f"{med.p99_ttft_ms:.0f} | {med.mean_tpot_ms:.1f} | {med.tokens_per_s * med.mean_tpot_ms / 1000:.1f} | "
                f"{sum(r.preemptions for r in runs):.0f} | {hit} | "
                f"{sum(r.failed for r in runs)} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable; default all")
    parser.add_argument("--policy", action="append", choices=sorted([*MODES, WATERMARK]),
                        help="default strict and adaptive; 'watermark' is vLLM alone with --watermark 0.05")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell, taken in turns (3)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    parser.add_argument("--engine-core-nice", type=int, default=None, help="run each vLLM's engine core process "
                        "at this niceness (a setting of the host: every target gets it; docs/realistic.md)")
    args = parser.parse_args(argv)
    names = args.workload or list(WORKLOADS)
    policies = args.policy or ["strict", "adaptive"]
    logs = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    print(f"prefix: logs in {logs}", file=sys.stderr)
    model = ensure_tiny_model(DEFAULT_MAX_MODEL_LEN)
    vllm = vllm_server(model, logs / "vllm.log")
    watermarked = vllm_server(model, logs / "vllm-watermark.log", extra_args=WATERMARK_ARGS)
    gateways: dict[str, ServerProcess] = {}
    results: dict[str, dict[str, list[Run]]] = {n: {} for n in names}
    targets = ["direct", *policies]
    try:
        vllm.start()
        if WATERMARK in policies:
            watermarked.start()
            watermarked.wait_ready(VLLM_READY_PATHS, 600)
        vllm.wait_ready(VLLM_READY_PATHS, 600)
        if args.engine_core_nice is not None:
            for engine in (vllm, watermarked):
                if engine.alive() and not renice_engine_core(engine, args.engine_core_nice):
                    raise SystemExit(f"prefix: no engine core process found under {engine.name}'s pid")
        version = get_json(f"{vllm.url}/version").get("version", "?")
        gated = [p for p in policies if p != WATERMARK]
        for key, (p, n) in {gateway_key(p, n): (p, n) for p in gated for n in names}.items():
            extra = WORKLOAD_GATEWAY_ARGS.get(n, ())
            gateways[key] = gateway_server(vllm.url, logs / f"{key}.log", [*GATEWAY_ARGS, *MODES[p], *extra])
            gateways[key].start()
            gateways[key].wait_ready(GATEWAY_READY_PATHS, 120)
        for rep in range(args.repeat):
            for i, name in enumerate(names):
                # Rotate the order each round: the first run of a round is not always the same target.
                order = targets[rep % len(targets):] + targets[: rep % len(targets)]
                for j, target in enumerate(order):
                    engine = watermarked if target == WATERMARK else vllm
                    base = engine.url if target in ("direct", WATERMARK) else gateways[gateway_key(target, name)].url
                    seed = 1000 * rep + 10 * i + j
                    run = measure(engine, WORKLOADS[name], base, model, seed)
                    results[name].setdefault(target, []).append(run)
                    print(f"prefix: run {rep + 1} {name} {target}: {run}", file=sys.stderr)
    finally:
        for g in gateways.values():
            g.stop()
        vllm.stop()
        if watermarked.alive():
            watermarked.stop()
    report = (f"vLLM {version} (CPU build), prefix caching on, 32-block KV cache; {args.repeat} runs per cell in "
              f"turns; command: `.venv/bin/python bench/prefix.py {' '.join(argv or sys.argv[1:])}`\n\n"
              + table(results, targets)
              + ("\n\n" + overload_table(results["overload"], targets) if "overload" in results else ""))
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
