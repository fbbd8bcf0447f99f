"""Two separate vLLM servers and one gateway over both (``--upstream`` twice), and the two-prefix-group workload
over them: placement by prefix (the gateway) against round-robin (``bench/round_robin.py``, one proxy hop in its
own process that sends each request to the next server in turn) and against a second gateway over the same servers
placing by free blocks alone (``--placement headroom``: the same gateway work per request, without the prefix).

Each server: the tiny model, a 4 MiB KV cache (32 blocks of 128 tokens), max_model_len 2,048, prefix caching on
(vLLM's default). Workload: vLLM's own benchmark client, ``prefix_repetition`` dataset, two random shared
prefixes, as ``bench/engines.py --workload prefix-groups`` drives one data-parallel server. Every run has its own
seed, so its prefixes are new and no run finds the previous run's cached. Per target: the prefix-cache hit rate
(the run's deltas of ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``, both servers and
each), output tokens/s, mean TTFT, requests per server, preemptions, failed requests, and the gateway's medians
over round-robin's and over the headroom gateway's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from bench.prefix_clients import vllm_bench
from bench.workloads.prefix_groups import GROUPS, prefix_groups_args
from tests.e2e.servers import (
    GATEWAY_READY_PATHS,
    VLLM_READY_PATHS,
    ServerProcess,
    ensure_tiny_model,
    free_port,
    gateway_server,
    get_json,
    scrape_counter,
    vllm_server,
)

SERVERS = 2
# vLLM's CPU build pins a server's worker to a core it picks alone: the same core for both servers, where a server
# started again under load waited minutes to be scheduled at all. Unpinned, their spinning workers share the cores
# badly (a fifth of the throughput). So each server gets its own core, as each would get its own GPU.
CORE_BIND = "VLLM_CPU_OMP_THREADS_BIND"
VLLM_START_S = 900.0  # two servers start at once on a small CPU box
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
FINISHED = "vllm:request_success_total"
PREEMPTED = "vllm:num_preemptions_total"
COUNTERS = (HITS, QUERIES, FINISHED, PREEMPTED)
# The gateway places by prefix (its default); "headroom" is the same gateway placing by free blocks alone.
TARGETS = ("round-robin", "headroom", "gateway")


@dataclass
class Pair:
    """The two servers, in ``--upstream`` order, and the gateway over them."""

    servers: list[ServerProcess]
    gateway: ServerProcess


@contextmanager
def two_servers(logs: Path, gateway_args: Sequence[str]) -> Iterator[Pair]:
    """Both servers and the gateway, started and ready (each engine ``ready`` in ``/guard/status``); every
    process, restarted ones included, is stopped on the way out."""
    model = ensure_tiny_model()
    servers = [vllm_server(model, logs / f"vllm{i}.log") for i in range(SERVERS)]
    for core, server in enumerate(servers):
        server.env = {CORE_BIND: str(core % (os.cpu_count() or 1))}
    gateway = gateway_server(servers[0].url, logs / "gateway.log", ["--upstream", servers[1].url, *gateway_args])
    pair = Pair(servers, gateway)
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(VLLM_READY_PATHS, VLLM_START_S)
        gateway.start()
        gateway.wait_ready(GATEWAY_READY_PATHS, 120)
        wait_until_ready(gateway)
        yield pair
    finally:
        gateway.stop()
        for server in pair.servers:
            server.stop()


def engine_states(gateway: ServerProcess) -> list[str]:
    return [str(row["state"]) for row in get_json(f"{gateway.url}/guard/status")["engines"]]


def wait_until_ready(gateway: ServerProcess, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (states := engine_states(gateway)) != ["ready"] * SERVERS:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the gateway's engines are {states} after {timeout_s:.0f} s, not all ready")
        time.sleep(0.5)


def restarted(server: ServerProcess) -> ServerProcess:
    """The same server command started again on the same port (the gateway's upstream URL), logging on. Call it
    from the main thread: the server is sent SIGTERM when the thread that started it ends."""
    return ServerProcess(server.name, server.argv, server.port, server.log_path, dict(server.env)).start()


@dataclass
class PrefixRun:
    tokens_per_s: float
    mean_ttft_ms: float
    failed: int
    counters: dict[str, list[float]] = field(default_factory=dict)  # each counter's delta per server

    @property
    def hit_rate(self) -> float:
        queried = sum(self.counters[QUERIES])
        return sum(self.counters[HITS]) / queried if queried else float("nan")

    def server_hit_rates(self) -> list[float]:
        return [h / q if q else float("nan") for h, q in zip(self.counters[HITS], self.counters[QUERIES], strict=True)]


def scrape_all(servers: Sequence[ServerProcess]) -> dict[str, list[float]]:
    return {name: [scrape_counter(f"{s.url}/metrics", name) for s in servers] for name in COUNTERS}


def wait_idle(servers: Sequence[ServerProcess], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    while sum(scrape_counter(f"{s.url}/metrics", g) for s in servers for g in gauges):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the servers are still busy {timeout_s:.0f} s after the run")
        time.sleep(0.5)


def measure(servers: Sequence[ServerProcess], argv: list[str]) -> PrefixRun:
    wait_idle(servers)
    before = scrape_all(servers)
    result = vllm_bench(argv)
    wait_idle(servers)
    after = scrape_all(servers)
    deltas = {n: [a - b for a, b in zip(after[n], before[n], strict=True)] for n in COUNTERS}
    return PrefixRun(
        float(result["output_throughput"]), float(result["mean_ttft_ms"]), int(result.get("failed", 0)), deltas
    )


def round_robin_server(servers: Sequence[ServerProcess], logs: Path) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "bench.servers.round_robin", "--port", str(port), *(s.url for s in servers)]
    return ServerProcess("round-robin", argv, port, logs / "round_robin.log")


def run_pair(args: argparse.Namespace, logs: Path) -> tuple[str, dict[str, list[PrefixRun]]]:
    model = ensure_tiny_model()
    results: dict[str, list[PrefixRun]] = {t: [] for t in TARGETS}
    with two_servers(logs, ("--queue-timeout", "600")) as pair:
        forwarder = round_robin_server(pair.servers, logs)
        headroom = gateway_server(
            pair.servers[0].url, logs / "gateway-headroom.log",
            ["--upstream", pair.servers[1].url, "--queue-timeout", "600", "--placement", "headroom"],
            name="gateway (headroom)",
        )
        try:
            forwarder.start()
            headroom.start()
            forwarder.wait_ready(("/health",), 60)
            headroom.wait_ready(GATEWAY_READY_PATHS, 120)
            wait_until_ready(headroom)
            version = str(get_json(f"{pair.servers[0].url}/version").get("version", "?"))
            bases = {"round-robin": forwarder.url, "headroom": headroom.url, "gateway": pair.gateway.url}
            for rep in range(args.repeat):
                # Rotate the order each round: the first run of a round is not always the same target.
                order = TARGETS[rep % len(TARGETS):] + TARGETS[: rep % len(TARGETS)]
                for j, target in enumerate(order):
                    argv = prefix_groups_args(args, model, bases[target], seed=100 * rep + j)
                    run = measure(pair.servers, argv)
                    results[target].append(run)
                    print(f"engines: run {rep + 1} {target}: {run}", file=sys.stderr)
        finally:
            forwarder.stop()
            headroom.stop()
    return version, results


def listed(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    return ", ".join(fmt(v) for v in values)


def pair_table(results: dict[str, list[PrefixRun]]) -> str:
    """Medians over the runs, each run's figure in turn order in brackets."""
    lines = ["| target | prefix-cache hit rate (runs) | hit rate per run (server 0 / server 1) | output tok/s (runs) | "
             "mean TTFT ms (runs) | requests per run (server 0 / server 1) | preemptions, all runs | failed |",
             "|" + " --- |" * 8]
    for target, runs in results.items():
        hits = [r.hit_rate for r in runs]
        tps = [r.tokens_per_s for r in runs]
        ttft = [r.mean_ttft_ms for r in runs]
        per_server = ", ".join(" / ".join(f"{v:.0%}" for v in r.server_hit_rates()) for r in runs)
        finished = ", ".join(" / ".join(f"{v:.0f}" for v in r.counters[FINISHED]) for r in runs)
        lines.append(
            f"| {target} | {statistics.median(hits):.1%} ({listed(hits, lambda v: f'{v:.1%}')}) | {per_server} | "
            f"{statistics.median(tps):.0f} ({listed(tps, lambda v: f'{v:.0f}')}) | {statistics.median(ttft):.0f} "
            f"({listed(ttft, lambda v: f'{v:.0f}')}) | {finished} | "
            f"{sum(sum(r.counters[PREEMPTED]) for r in runs):.0f} | {sum(r.failed for r in runs)} |"
        )
    return "\n".join(lines)


def pair_ratios(results: dict[str, list[PrefixRun]]) -> str:
    figures: dict[str, Callable[[PrefixRun], float]] = {
        "prefix-cache hit rate": lambda r: r.hit_rate, "output tokens/s": lambda r: r.tokens_per_s,
        "mean TTFT": lambda r: r.mean_ttft_ms,
    }
    lines = []
    for baseline in ("round-robin", "headroom"):
        parts = []
        for name, of in figures.items():
            base = statistics.median(of(r) for r in results[baseline])
            mine = statistics.median(of(r) for r in results["gateway"])
            parts.append(f"{name} {mine / base:.2f}" if base else f"{name} -")
        lines.append(f"Gateway (placement by prefix) over {baseline}, medians: " + "; ".join(parts) + ".")
    return "\n".join(lines)


def run_servers_prefix(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    logs = Path(tempfile.mkdtemp(prefix="engines-bench-"))
    print(f"engines: logs in {logs}", file=sys.stderr)
    started = time.monotonic()
    version, results = run_pair(args, logs)
    report = (
        f"{date.today().isoformat()}: vLLM {version} (CPU build), {SERVERS} servers of one 32-block KV cache each; "
        f"{GROUPS} prefix groups, {args.num_prompts} x ({args.prefix_len} shared + {args.suffix_len} unique "
        f"prompt + {args.output_len} output) tokens, --max-concurrency {args.max_concurrency}, --ignore-eos; "
        f"{args.repeat} runs per target in turns, {time.monotonic() - started:.0f} s in all; command: "
        f"`.venv/bin/python bench/engines.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
        f"{pair_table(results)}\n\n{pair_ratios(results)}\n"
    )
    print(report)
    if args.out is not None:
        args.out.write_text(report, encoding="utf-8")
    return 0
