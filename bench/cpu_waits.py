"""Who waits for the CPU: the kernel's account of each process while the realistic chat traffic runs.

Starts one vLLM (the CPU build, the realistic benchmark's tiny model; 64 MiB cache unless ``--kv-cache-mib``)
and one gateway in front of it, sends ``bench/realistic.py``'s chat traffic at ``--rate`` for ``--duration``
seconds to vLLM alone (which also warms the engine), then the same arrivals with other words through the
gateway, and reports for each run what ``/proc/<pid>/task/*/schedstat`` says of every process: the seconds its
threads ran, and the seconds they were runnable but waited for a core, with the number of times they were
scheduled. The load client runs in this process and is counted as ``client``. vLLM's CPU build pins its worker to
one core and leaves the other to its API server, its engine core, the client and the gateway: a process that
waits long there is one the core cannot serve in time. Also printed: each run's output tokens/s and mean TTFT,
and the gateway's event-loop lag (``vllm_guard_event_loop_lag_seconds``) past 0.25 s. Linux only.

    .venv/bin/python bench/cpu_waits.py --rate 48 --duration 6
    .venv/bin/python bench/cpu_waits.py --rate 24 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.realistic import KV_CACHE_BYTES, gateway_command  # noqa: E402
from bench.realistic_clients import run_aiohttp  # noqa: E402
from bench.realistic_load import figures, plan, prompt  # noqa: E402
from tests.e2e.servers import (  # noqa: E402
    DEFAULT_MAX_MODEL_LEN,
    GATEWAY_READY_PATHS,
    VLLM_READY_PATHS,
    ServerProcess,
    ensure_tiny_model,
    free_port,
    vllm_server,
)


@dataclass(frozen=True)
class Sched:
    """What the kernel counted for one process's threads: seconds run, seconds runnable but waiting, slices."""

    ran: float
    waited: float
    slices: int

    def __sub__(self, other: Sched) -> Sched:
        return Sched(self.ran - other.ran, self.waited - other.waited, self.slices - other.slices)


def sched(pid: int) -> Sched:
    """The sums over a process's threads of ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds run and waited)."""
    ran = waited = slices = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue  # the thread ended meanwhile
        ran, waited, slices = ran + int(fields[0]), waited + int(fields[1]), slices + int(fields[2])
    return Sched(ran / 1e9, waited / 1e9, slices)


def processes(engine: ServerProcess, gateway: ServerProcess) -> dict[str, int]:
    """The processes to account, by name: vLLM's (its API server, engine core and worker), the gateway, the
    client (this process)."""
    named: dict[str, int] = {"client": os.getpid()}
    for server, label in ((engine, "vLLM"), (gateway, "gateway")):
        assert server.proc is not None
        root = psutil.Process(server.proc.pid)
        for proc in (root, *root.children(recursive=True)):
            name = proc.name()
            if name.startswith("VLLM::"):
                named[name.removeprefix("VLLM::")] = proc.pid
            elif proc.pid == root.pid:
                named["API server" if label == "vLLM" else label] = proc.pid
    return named


def loop_lags(metrics_text: str, past: float = 0.25) -> int:
    """How many of the gateway's event-loop lag observations on a ``/metrics`` page exceeded ``past`` seconds
    (``past`` one of the histogram's bucket bounds)."""
    total = within = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "vllm_guard_event_loop_lag_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                total = sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == past:
                within = sample.value
    return int(total - within)


def metrics_text(url: str) -> str:
    return urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()


def run(name: str, url: str, pids: dict[str, int], args: argparse.Namespace, eos_id: int, words: int) -> None:
    plans = plan(args.rate, args.duration, args.seed)
    texts = [prompt(p, i, args.seed, words) for i, p in enumerate(plans)]
    before = {label: sched(pid) for label, pid in pids.items()}
    outcomes = asyncio.run(run_aiohttp(url, plans, texts, eos_id, 30.0))
    after = {label: sched(pid) for label, pid in pids.items()}
    fig = figures(outcomes, 5.0)
    print(f"\n{name}: {fig.tokens_per_s:.0f} output tokens/s, mean TTFT {fig.mean_ttft:.2f} s, "
          f"{fig.completed} completed\n")
    print("| process | ran s | waited for a core s | times scheduled |\n| --- | --- | --- | --- |")
    for label in pids:
        d = after[label] - before[label]
        print(f"| {label} | {d.ran:.2f} | {d.waited:.2f} | {d.slices} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=48.0, help="chat streams a second (48)")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals per run (6)")
    parser.add_argument("--seed", type=int, default=200)
    parser.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_BYTES >> 20)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/bench-cpu-waits"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model(DEFAULT_MAX_MODEL_LEN)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    eos_id = int(eos[0] if isinstance(eos, list) else eos)
    engine = vllm_server(model, args.logs / "vllm.log", kv_cache_memory_bytes=args.kv_cache_mib << 20).start()
    port = free_port()
    gateway = ServerProcess("gateway", [*gateway_command(None), "serve", "--upstream", engine.url, "--host",
                                        "127.0.0.1", "--port", str(port)], port, args.logs / "gateway.log")
    try:
        engine.wait_ready(VLLM_READY_PATHS, 900)
        gateway.start().wait_ready(GATEWAY_READY_PATHS, 180)
        pids = processes(engine, gateway)
        print(f"vLLM's CPU build, tiny model, {args.kv_cache_mib} MiB KV cache; {args.rate:g} chat streams/s for "
              f"{args.duration:g} s; command: `.venv/bin/python bench/cpu_waits.py {' '.join(sys.argv[1:])}`")
        direct = {label: pid for label, pid in pids.items() if label != "gateway"}
        run("vLLM alone", engine.url, direct, args, eos_id, 0)
        time.sleep(3)
        lags_before = loop_lags(metrics_text(gateway.url))
        run("through the gateway", gateway.url, pids, args, eos_id, 1)
        late = loop_lags(metrics_text(gateway.url)) - lags_before
        print(f"\nthe gateway's event loop woke more than 0.25 s late {late} times")
    finally:
        gateway.stop()
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
