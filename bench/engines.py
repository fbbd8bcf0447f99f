"""Engines benchmark: a data-parallel vLLM (CPU build, ``--data-parallel-size 2``) straight and through the gateway
under each admission policy, runs taken in turns, medians reported.

vLLM serves the tiny model on two ranks, each with a 4 MiB KV cache (32 blocks of 128 tokens, one of them vLLM's
null block) and max_model_len 2,048; the gateway books each rank on its own once a scrape shows them. Workload:
vLLM's own benchmark client, completions backend, random dataset, N x (prompt + output) tokens (default
16 x (1,000 + 900): a request needs 15 of a rank's 32 blocks at its longest, so two run on each rank at a time),
``--ignore-eos`` (every request runs to its limit), all at once (``--request-rate inf``). Every run uses its own
seed, so no run finds the previous run's prompts in the prefix cache.

Per cell: output tokens/s and its ratio to direct (medians of the runs), mean and p99 TTFT of the median run,
vLLM's preemptions in each run (per rank, from its ``engine``-labelled counters), the requests each rank finished
in the median run, and failed requests.

``--workload prefix-groups``: two prefix groups, the traffic where placement by prefix pays. vLLM's client,
``prefix_repetition`` dataset: two random shared prefixes of ``--prefix-len`` tokens (1,000), each followed in
half the requests by a unique ``--suffix-len``-token suffix (32), ``--output-len`` output tokens (32, with
``--ignore-eos``), ``--max-concurrency`` requests at a time (8: both ranks busy). vLLM alone places by load, so
each rank computes each prefix; the gateway (adaptive by default) prefers the rank that holds or lately held the
request's prefix. Per target: the prefix-cache hit rate (the runs' deltas of ``vllm:prefix_cache_hits_total``
over ``vllm:prefix_cache_queries_total``, all ranks and per rank), output tokens/s, mean TTFT, requests per rank,
preemptions, and the gateway/direct ratios of the medians.

    .venv/bin/python bench/engines.py                                  # direct / strict / adaptive, 3 runs
    .venv/bin/python bench/engines.py --num-prompts 8 --output-len 400 --repeat 5
    .venv/bin/python bench/engines.py --workload prefix-groups         # direct / adaptive, 3 runs

``--workload servers-prefix`` (``bench/engine_servers.py``): the prefix-groups traffic over two separate servers,
the gateway (placement by prefix) against round-robin. ``--workload killed`` / ``frozen``
(``bench/engine_faults.py``): steady load through a gateway over two servers while one is SIGKILLed and started
again, or its engine core SIGSTOPped and SIGCONTed.

    .venv/bin/python bench/engines.py --workload servers-prefix        # round-robin / gateway, 3 runs
    .venv/bin/python bench/engines.py --workload killed                # 3 runs
    .venv/bin/python bench/engines.py --workload frozen                # 3 runs

``--workload rolling`` (``bench/engine_rolling.py``): two managed engines under load, restarted one at a time by
``POST /guard/restart``, ``--repeat`` rounds in one session.

    .venv/bin/python bench/engines.py --workload rolling               # 3 rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.prefix_clients import gateway_refusals, vllm_bench  # noqa: E402
from bench.workloads.prefix_groups import GROUPS, prefix_groups_args  # noqa: E402
from tests.e2e.servers import (  # noqa: E402
    DEFAULT_KV_CACHE_BYTES,
    GATEWAY_READY_PATHS,
    SERVED_MODEL_NAME,
    VLLM_READY_PATHS,
    ServerProcess,
    ensure_tiny_model,
    gateway_server,
    get_json,
    scrape_by_engine,
    scrape_counter,
    vllm_server,
)

RANKS = 2
GATEWAY_ARGS = ("--queue-timeout", "600")
MODES = {"strict": ("--admission-policy", "strict"), "adaptive": ("--admission-policy", "adaptive")}
PREEMPTED = "vllm:num_preemptions_total"
FINISHED = "vllm:request_success_total"
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
COUNTERS = (PREEMPTED, FINISHED, HITS, QUERIES)
WORKLOADS = ("flood", "prefix-groups", "servers-prefix", "killed", "frozen", "rolling")


@dataclass
class Run:
    tokens_per_s: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    failed: int
    preempted: dict[str, float] = field(default_factory=dict)  # per rank
    finished: dict[str, float] = field(default_factory=dict)  # per rank
    errors: list[str] = field(default_factory=list)  # what the client saw of each failed request
    refused: dict[str, float] = field(default_factory=dict)  # the gateway's refusals by reason
    hits: dict[str, float] = field(default_factory=dict)  # prefix-cache hit tokens per rank
    queries: dict[str, float] = field(default_factory=dict)  # prefix-cache queried tokens per rank

    @property
    def preemptions(self) -> float:
        return sum(self.preempted.values())

    @property
    def hit_rate(self) -> float:
        queried = sum(self.queries.values())
        return sum(self.hits.values()) / queried if queried else float("nan")

    def rank_hit_rates(self) -> dict[str, float]:
        return {k: self.hits.get(k, 0.0) / q if q else float("nan") for k, q in self.queries.items()}


def workload_args(args: argparse.Namespace, model: Path, base: str, seed: int) -> list[str]:
    if args.workload == "prefix-groups":
        return prefix_groups_args(args, model, base, seed)
    return [
        "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions", "--model", SERVED_MODEL_NAME,
        "--tokenizer", str(model), "--seed", str(seed), "--request-rate", "inf", "--disable-tqdm",
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos",
        "--percentile-metrics", "ttft", "--metric-percentiles", "99",
    ]  # fmt: skip


def wait_idle(vllm: ServerProcess, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = sum(scrape_counter(f"{vllm.url}/metrics", n) for n in ("vllm:num_requests_running",
                                                                     "vllm:num_requests_waiting"))
        if busy == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"vLLM still busy {timeout_s:.0f} s after the run")


def wait_for_ranks(gateway: ServerProcess, timeout_s: float = 120.0) -> None:
    """Until the gateway books each rank on its own (after a scrape shows the ranks, and nothing is in flight)."""
    want = [f"0.{r}" for r in range(RANKS)]
    deadline = time.monotonic() + timeout_s
    while (names := [row["name"] for row in get_json(f"{gateway.url}/guard/status")["engines"]]) != want:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the gateway's sites are {names} after {timeout_s:.0f} s, not {want}")
        time.sleep(0.5)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}


def measure(vllm: ServerProcess, base: str, argv: list[str]) -> Run:
    wait_idle(vllm)
    metrics = f"{vllm.url}/metrics"
    before = {n: scrape_by_engine(metrics, n) for n in COUNTERS}
    refused_before = gateway_refusals(base) if base != vllm.url else {}
    result = vllm_bench(argv)
    wait_idle(vllm)
    after = {n: scrape_by_engine(metrics, n) for n in COUNTERS}
    refused = delta(gateway_refusals(base), refused_before) if base != vllm.url else {}
    return Run(
        float(result["output_throughput"]), float(result["mean_ttft_ms"]), float(result["p99_ttft_ms"]),
        int(result.get("failed", 0)), delta(after[PREEMPTED], before[PREEMPTED]),
        delta(after[FINISHED], before[FINISHED]), [e[-300:] for e in result.get("errors", []) if e],
        {k: v for k, v in refused.items() if v}, delta(after[HITS], before[HITS]),
        delta(after[QUERIES], before[QUERIES]),
    )


def table(results: dict[str, list[Run]], targets: Sequence[str]) -> str:
    lines = ["| target | output tok/s (runs) | x direct | mean TTFT ms | p99 TTFT ms | preemptions per run "
             "(rank 0 + rank 1) | requests per rank | failed |", "|" + " --- |" * 8]
    direct = statistics.median(r.tokens_per_s for r in results["direct"])
    for target in targets:
        runs = results[target]
        med = sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]
        each = ", ".join(f"{r.tokens_per_s:.0f}" for r in runs)
        ratio = statistics.median(r.tokens_per_s for r in runs) / direct if direct else float("nan")
        preempted = ", ".join(" + ".join(f"{v:.0f}" for v in r.preempted.values()) for r in runs)
        ranks = " / ".join(f"{v:.0f}" for v in med.finished.values())
        lines.append(
            f"| {target} | {med.tokens_per_s:.0f} ({each}) | {ratio:.2f} | {med.mean_ttft_ms:.0f} | "
            f"{med.p99_ttft_ms:.0f} | {preempted} | {ranks} | {sum(r.failed for r in runs)} |"
        )
    return "\n".join(lines)


def prefix_table(results: dict[str, list[Run]], targets: Sequence[str]) -> str:
    """The prefix-groups figures: medians over the runs, and each run's in turn order."""
    lines = ["| target | prefix-cache hit rate (runs) | hit rate per run (rank 0 / rank 1) | output tok/s (runs) | "
             "mean TTFT ms (runs) | requests per run (rank 0 / rank 1) | preemptions, all runs | failed |",
             "|" + " --- |" * 8]
    for target in targets:
        runs = results[target]
        hit = statistics.median(r.hit_rate for r in runs)
        ranks = ", ".join(" / ".join(f"{v:.0%}" for v in r.rank_hit_rates().values()) for r in runs)
        tps = statistics.median(r.tokens_per_s for r in runs)
        ttft = statistics.median(r.mean_ttft_ms for r in runs)
        finished = ", ".join(" / ".join(f"{v:.0f}" for v in r.finished.values()) for r in runs)
        lines.append(
            f"| {target} | {hit:.1%} ({', '.join(f'{r.hit_rate:.1%}' for r in runs)}) | {ranks} | {tps:.0f} "
            f"({', '.join(f'{r.tokens_per_s:.0f}' for r in runs)}) | {ttft:.0f} "
            f"({', '.join(f'{r.mean_ttft_ms:.0f}' for r in runs)}) | {finished} | "
            f"{sum(r.preemptions for r in runs):.0f} | {sum(r.failed for r in runs)} |"
        )
    return "\n".join(lines)


def ratios(results: dict[str, list[Run]], policies: Sequence[str], workload: str) -> str:
    """Each gateway's medians over direct's: output tokens/s, and for prefix groups hit rate and mean TTFT."""
    figures: dict[str, Callable[[Run], float]] = {"output tokens/s": lambda r: r.tokens_per_s}
    if workload == "prefix-groups":
        figures = {"prefix-cache hit rate": lambda r: r.hit_rate, **figures, "mean TTFT": lambda r: r.mean_ttft_ms}
    parts = []
    for name, of in figures.items():
        direct = statistics.median(of(r) for r in results["direct"])
        each = ", ".join(
            f"{p}/direct {statistics.median(of(r) for r in results[p]) / direct:.2f}" if direct else f"{p}/direct -"
            for p in policies
        )
        parts.append(f"{name} {each}")
    return "Gateway over direct, medians: " + "; ".join(parts) + "."


def failures(results: dict[str, list[Run]]) -> str:
    """Each failed request as the client saw it, and the gateway's refusals, by target and run."""
    lines = []
    for target, runs in results.items():
        for i, run in enumerate(runs, 1):
            lines += [f"- {target}, run {i}: refused by the gateway {run.refused}"] if run.refused else []
            lines += [f"- {target}, run {i}: `{' '.join(error.split())}`" for error in run.errors]
    return "\n\nFailed requests:\n" + "\n".join(lines) if lines else ""


def run_all(args: argparse.Namespace, policies: list[str], logs: Path) -> tuple[str, dict[str, list[Run]]]:
    model = ensure_tiny_model()
    vllm = vllm_server(
        model, logs / "vllm.log", kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES,
        extra_args=["--data-parallel-size", str(RANKS)],
    )
    gateways: dict[str, ServerProcess] = {}
    targets = ["direct", *policies]
    results: dict[str, list[Run]] = {t: [] for t in targets}
    try:
        vllm.start()
        vllm.wait_ready(VLLM_READY_PATHS, 600)
        version = str(get_json(f"{vllm.url}/version").get("version", "?"))
        for p in policies:
            gateways[p] = gateway_server(vllm.url, logs / f"{p}.log", [*GATEWAY_ARGS, *MODES[p]])
            gateways[p].start()
            gateways[p].wait_ready(GATEWAY_READY_PATHS, 120)
            wait_for_ranks(gateways[p])
        for rep in range(args.repeat):
            # Rotate the order each round: the first run of a round is not always the same target.
            order = targets[rep % len(targets):] + targets[: rep % len(targets)]
            for j, target in enumerate(order):
                base = vllm.url if target == "direct" else gateways[target].url
                run = measure(vllm, base, workload_args(args, model, base, seed=100 * rep + j))
                results[target].append(run)
                print(f"engines: run {rep + 1} {target}: {run}", file=sys.stderr)
    finally:
        for g in gateways.values():
            g.stop()
        vllm.stop()
    return version, results


def describe(args: argparse.Namespace) -> str:
    if args.workload == "prefix-groups":
        return (
            f"{GROUPS} prefix groups, {args.num_prompts} x ({args.prefix_len} shared + {args.suffix_len} unique "
            f"prompt + {args.output_len} output) tokens, --max-concurrency {args.max_concurrency}, --ignore-eos"
        )
    return (
        f"{args.num_prompts} x ({args.input_len} prompt + {args.output_len} output) tokens, --request-rate inf, "
        "--ignore-eos"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="flood",
                        help="flood (default), prefix-groups, servers-prefix, killed, frozen or rolling")
    parser.add_argument("--policy", action="append", choices=sorted(MODES),
                        help="default strict and adaptive (flood), adaptive (prefix-groups)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per target, taken in turns (3)")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per run (16)")
    parser.add_argument("--input-len", type=int, default=1000, help="flood: prompt tokens per request (1000)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="output tokens per request (flood 900, prefix-groups 32)")
    parser.add_argument("--prefix-len", type=int, default=1000, help="prefix-groups: shared prefix tokens (1000)")
    parser.add_argument("--suffix-len", type=int, default=32, help="prefix-groups: unique suffix tokens (32)")
    parser.add_argument("--max-concurrency", type=int, default=8, help="prefix-groups: requests at a time (8)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.workload == "rolling":
        from bench.engine_rolling import main as rolling

        return rolling(["--rounds", str(args.repeat)])
    if args.workload in ("killed", "frozen"):
        from bench.engine_faults import run_faults

        return run_faults(args, argv)
    prefix_groups = args.workload in ("prefix-groups", "servers-prefix")
    if args.output_len is None:
        args.output_len = 32 if prefix_groups else 900
    if prefix_groups and (args.num_prompts < GROUPS or args.num_prompts % GROUPS):
        parser.error(f"--num-prompts must be a positive multiple of {GROUPS} (the prefix groups), not "
                     f"{args.num_prompts}")
    if args.workload == "servers-prefix":
        from bench.engine_servers import run_servers_prefix

        return run_servers_prefix(args, argv)
    policies = args.policy or (["adaptive"] if prefix_groups else ["strict", "adaptive"])
    logs = Path(tempfile.mkdtemp(prefix="engines-bench-"))
    print(f"engines: logs in {logs}", file=sys.stderr)
    started = time.monotonic()
    version, results = run_all(args, policies, logs)
    targets = ["direct", *policies]
    report = (
        f"{date.today().isoformat()}: vLLM {version} (CPU build), --data-parallel-size {RANKS}, 32-block KV cache "
        f"per rank; {describe(args)}; {args.repeat} runs per target in turns, "
        f"{time.monotonic() - started:.0f} s in all; command: "
        f"`.venv/bin/python bench/engines.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
        f"{prefix_table(results, targets) if prefix_groups else table(results, targets)}\n\n"
        f"{ratios(results, policies, args.workload)}{failures(results)}\n"
    )
    print(report)
    if args.out is not None:
        args.out.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
