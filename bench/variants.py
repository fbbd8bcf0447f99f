"""Gateway builds side by side on one vLLM: which change made a difference, in paired runs.

Starts one vLLM (the CPU build, the realistic benchmark's tiny model and 64 MiB cache) and one gateway per
checkout given (``git worktree add --detach /tmp/gw-X <commit>``), then sends ``bench/realistic.py``'s chat
traffic (Poisson arrivals, prompts of 150-400 words, ``max_tokens`` 1024, answers really ending at a lognormal
length around 200) at ``--rate`` for ``--duration`` seconds to vLLM alone and to each gateway in turns, the order
rotating each round; every target of a round gets the same arrivals and lengths with words of its own. Prints one
line per run (output tokens/s, mean and p99 TTFT, goodput, preemptions, refusals, and the CPU seconds the engine's
processes took), then each target's medians of its per-round ratios to vLLM alone.

A checkout may carry gateway flags after ``::`` (``/tmp/gw-a::--preemption-budget=4``, several joined by ``,``):
the same code under another setting is then a target of its own.

    .venv/bin/python bench/variants.py --rate 24 --repeat 3 /tmp/gw-a /tmp/gw-b
    .venv/bin/python bench/variants.py --rate 48 /tmp/gw-a /tmp/gw-a::--preemption-budget=4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.realistic import KV_CACHE_BYTES, PREEMPTIONS, cpu_seconds, gateway_command, renice_engine_core  # noqa: E402
from bench.realistic_clients import run_aiohttp  # noqa: E402
from bench.realistic_load import Figures, figures, median_ratios, plan, prompt  # noqa: E402
from tests.e2e.servers import (  # noqa: E402
    DEFAULT_MAX_MODEL_LEN,
    GATEWAY_READY_PATHS,
    VLLM_READY_PATHS,
    ServerProcess,
    ensure_tiny_model,
    free_port,
    metric_sum,
    scrape_counter,
    vllm_server,
)

# Where a first token's time goes, each as (sum, count) of a histogram: vLLM's own time to first token (from its
# API server's arrival to the token), its time in its waiting queue, the gateway's wait for admission, and the
# gateway's own time to first token (from its request sent to vLLM to the first event read back).
ENGINE_TTFT = "vllm:time_to_first_token_seconds"
ENGINE_QUEUE = "vllm:request_queue_time_seconds"
GATEWAY_QUEUE = "vllm_guard_queue_wait_seconds"
GATEWAY_TTFT = "vllm_guard_time_to_first_token_seconds"
GATEWAY_LAG = "vllm_guard_event_loop_lag_seconds"  # how late its loop woke a timer due every 0.1 s
ENGINE_KEYS = (ENGINE_TTFT, ENGINE_QUEUE)
GATEWAY_KEYS = (GATEWAY_QUEUE, GATEWAY_TTFT, GATEWAY_LAG)


def time_split(means: dict[str, float]) -> str:
    """One run's means, in words."""
    text = f"vLLM's own TTFT {means[ENGINE_TTFT]:.2f} s, of it in vLLM's queue {means[ENGINE_QUEUE]:.2f} s"
    if GATEWAY_QUEUE not in means:
        return text
    return (f"{text}; the gateway's admission wait {means[GATEWAY_QUEUE]:.2f} s, from its request sent to vLLM to "
            f"the first event it read {means[GATEWAY_TTFT]:.2f} s, its loop late by {means[GATEWAY_LAG] * 1000:.0f} ms "
            "a wakeup")


def histogram_totals(page: str, name: str) -> tuple[float, float]:
    """A histogram's (sum, count) in a Prometheus page, over all its label sets."""
    return metric_sum(page, f"{name}_sum"), metric_sum(page, f"{name}_count")


def mean_since(before: tuple[float, float], now: tuple[float, float]) -> float:
    """The mean of what a histogram observed between two of its (sum, count) readings (0 when nothing was)."""
    count = now[1] - before[1]
    return (now[0] - before[0]) / count if count else 0.0


def histogram_now(server: ServerProcess, name: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10.0) as resp:
        return histogram_totals(resp.read().decode(), name)


def server_of(metric: str, engine: ServerProcess, gateway: ServerProcess | None) -> ServerProcess:
    return gateway if gateway is not None and metric.startswith("vllm_guard_") else engine


def split_target(spec: str) -> tuple[Path, list[str]]:
    """``PATH[::FLAG,FLAG...]``: a checkout and the gateway flags it runs with."""
    path, _, flags = spec.partition("::")
    return Path(path), [f for f in flags.split(",") if f]


def preemptions(url: str) -> float:
    return scrape_counter(f"{url}/metrics", PREEMPTIONS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkouts", nargs="+", help="gateway checkouts (git worktrees), each PATH[::FLAG,...]")
    parser.add_argument("--rate", type=float, default=24.0)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/bench-variants"))
    parser.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_BYTES >> 20, help="the engine's KV cache, MiB")
    parser.add_argument("--renice", type=int, help="also run each gateway at this niceness (as a second target)")
    parser.add_argument("--engine-core-nice", type=int, help="run vLLM's engine core process at this niceness")
    parser.add_argument("--client-nice", type=int, help="run the load client (this process) at this niceness")
    parser.add_argument("--pin", help="also run each gateway with all its threads on these CPUs (1, or 0,1)")
    parser.add_argument("--batch", action="store_true",
                        help="also run each gateway under the kernel's SCHED_BATCH policy (as a target of its own)")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model(DEFAULT_MAX_MODEL_LEN)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    eos_id = int(eos[0] if isinstance(eos, list) else eos)
    engine = vllm_server(model, args.logs / "vllm.log", kv_cache_memory_bytes=args.kv_cache_mib << 20).start()
    gateways: dict[str, ServerProcess] = {}
    try:
        engine.wait_ready(VLLM_READY_PATHS, 900)
        niceness: dict[str, int] = {}
        batch: set[str] = set()
        pinned: set[str] = set()
        modes: list[int | str | None] = [None]
        modes += [] if args.renice is None else [args.renice]
        modes += ["batch"] if args.batch else []
        modes += ["pin"] if args.pin else []
        for spec in args.checkouts:
            src, flags = split_target(spec)
            for nice in modes:
                suffix = ("" if nice is None else " @batch" if nice == "batch" else f" @cpu{args.pin}" if nice == "pin"
                          else f" @nice{nice}")
                name = src.name + "".join(f" {f}" for f in flags) + suffix
                port = free_port()
                argv = [*gateway_command(src), "serve", "--upstream", engine.url, "--host", "127.0.0.1",
                        "--port", str(port), *flags]
                gateways[name] = ServerProcess(name, argv, port, args.logs / f"gateway-{name}.log").start()
                if nice == "batch":
                    batch.add(name)
                elif nice == "pin":
                    pinned.add(name)
                elif isinstance(nice, int):
                    niceness[name] = nice
        for name, gateway in gateways.items():
            gateway.wait_ready(GATEWAY_READY_PATHS, 180)
            if name in niceness and gateway.proc is not None:
                os.setpriority(os.PRIO_PROCESS, gateway.proc.pid, niceness[name])
            if name in pinned and gateway.proc is not None:
                cpus = {int(c) for c in args.pin.split(",")}
                for task in Path(f"/proc/{gateway.proc.pid}/task").iterdir():  # threads started later inherit it
                    os.sched_setaffinity(int(task.name), cpus)
            if name in batch and gateway.proc is not None:
                for task in Path(f"/proc/{gateway.proc.pid}/task").iterdir():
                    os.sched_setscheduler(int(task.name), os.SCHED_BATCH, os.sched_param(0))
        if args.engine_core_nice is not None:
            renice_engine_core(engine, args.engine_core_nice)
        if args.client_nice is not None:
            # Once the servers run (they would inherit it): only this process, the load client, is reniced.
            os.setpriority(os.PRIO_PROCESS, 0, args.client_nice)
        targets = [("direct", engine.url), *((name, g.url) for name, g in gateways.items())]
        runs: dict[str, list[Figures]] = {name: [] for name, _ in targets}  # paired by round
        for rep in range(args.repeat):
            shift = rep % len(targets)
            for name, url in targets[shift:] + targets[:shift]:
                seed = 200 + rep
                plans = plan(args.rate, args.duration, seed)
                words = [n for n, _ in targets].index(name)
                texts = [prompt(p, i, seed, words) for i, p in enumerate(plans)]
                before, preempted = cpu_seconds(engine), preemptions(engine.url)
                gateway = gateways.get(name)
                keys = ENGINE_KEYS + (GATEWAY_KEYS if gateway is not None else ())
                marks = {key: histogram_now(server_of(key, engine, gateway), key) for key in keys}
                outcomes = asyncio.run(run_aiohttp(url, plans, texts, eos_id, 30.0))
                fig = figures(outcomes, 5.0, preemptions(engine.url) - preempted)
                runs[name].append(fig)
                print(f"round {rep + 1} {name}: {fig.tokens_per_s:.0f} tokens/s, mean TTFT {fig.mean_ttft:.2f} s, "
                      f"p99 {fig.p99_ttft:.2f} s, goodput {fig.goodput:.2f}/s, {fig.completed} completed, "
                      f"{fig.preemptions:.0f} preemptions, {fig.refused} refused, {fig.timeouts} timeouts, "
                      f"engine CPU {cpu_seconds(engine) - before:.1f} s", flush=True)
                means = {key: mean_since(mark, histogram_now(server_of(key, engine, gateway), key))
                         for key, mark in marks.items()}
                print(f"  where the time went (means): {time_split(means)}", flush=True)
                time.sleep(3)
        for name, _ in targets[1:]:
            ratios = median_ratios(runs, name)
            print(f"{name}: medians of the ratios to vLLM alone: "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
                  + f"; preemptions {sum(f.preemptions for f in runs[name]):.0f} "
                  f"(vLLM alone {sum(f.preemptions for f in runs['direct']):.0f})", flush=True)
    finally:
        for gateway in gateways.values():
            gateway.stop()
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
