"""The gateway's own CPU per streamed request, against the simulator, paired with another build.

    .venv/bin/python bench/relay_cpu.py [--rate 12] [--seconds 20] [--repeat 3] [--baseline-src DIR]

On a machine where the engine and the gateway share the cores (``bench/realistic.py`` on two), every CPU
second the gateway spends is one the engine does not get: at twice capacity the engine's tokens/s follow its
share of the CPU. This measures that cost alone, free of the engine's pace: chat streams shaped as in
``bench/realistic.py`` (prompts of 150-400 words, ``max_tokens`` 1024, answers stopping at a lognormal length of
mean 200 through ``min_tokens`` and a logit bias on EOS) go through the gateway to the simulator (20 ms a token,
a cache that never fills), and the gateway's process CPU time (user and system, every thread) over each run is
divided by the requests and the events it relayed. The gateway runs alone on CPU 1, the simulator and the client
on CPU 0. With ``--baseline-src`` (a checkout of another commit) that build's gateway runs the same arrivals in
turns with this one; each line gives the median of the runs and the median of the per-run ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.overhead import free_port, pinned  # noqa: E402
from bench.realistic_clients import run_aiohttp  # noqa: E402
from bench.realistic_load import plan, prompt  # noqa: E402
from bench.soak import process  # noqa: E402

SIM_CODE = """
import sys, uvicorn
sys.path.insert(0, {root!r})
from transformers import AutoTokenizer
from tests.support.vllm_sim import SimConfig, create_sim_app
app = create_sim_app(SimConfig(model="tiny", max_model_len=4096, num_blocks=1_000_000, block_size=16,
                               max_num_seqs=100_000, token_delay={token_delay},
                               tokenizer=AutoTokenizer.from_pretrained({tokenizer!r})))
import gc
gc.collect()
gc.freeze()
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", access_log=False, loop="uvloop",
            http="httptools")
"""


@dataclass(frozen=True)
class Run:
    requests: int  # completed
    events: int  # output tokens of the completed streams: one event each at a stream interval of 1
    cpu_s: float
    failed: int
    mean_ttft_ms: float  # the client's, through the gateway
    loop_lag_ms: float  # the gateway's event loop: mean lateness of its 0.1-s timer over the run

    @property
    def ms_per_request(self) -> float:
        return 1000.0 * self.cpu_s / max(1, self.requests)

    @property
    def us_per_token(self) -> float:
        return 1e6 * self.cpu_s / max(1, self.events)


def gateway_argv(src: Path | None, sim_url: str, port: int, tokenizer: Path) -> list[str]:
    if src is None:
        head = [sys.executable, "-m", "gateway.cli"]
    else:
        boot = f"import sys; sys.path.insert(0, {str(src)!r}); from gateway.cli import main; sys.exit(main())"
        head = [sys.executable, "-c", boot]
    return [*pinned(1), *head, "serve", "--upstream", sim_url, "--host", "127.0.0.1", "--port", str(port),
            "--tokenizer", str(tokenizer), "--max-queue", "10000"]  # fmt: skip


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def loop_lag(url: str) -> tuple[float, float]:
    """The gateway's loop-lag histogram: (sum of seconds, count)."""
    return lag_totals(httpx.get(url + "/metrics", timeout=10).text)


def lag_totals(text: str) -> tuple[float, float]:
    """(sum of seconds, count) of the loop-lag histogram on a metrics page; zeros where it has none."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm_guard_event_loop_lag_seconds":
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    found[sample.name.rsplit("_", 1)[1]] = sample.value
    return found.get("sum", 0.0), found.get("count", 0.0)


def one_run(url: str, pid: int, rate: float, seconds: float, seed: int, eos: int, target: int) -> Run:
    plans = plan(rate, seconds, seed)
    texts = [prompt(p, i, seed, target) for i, p in enumerate(plans)]
    lag_before = loop_lag(url)
    before = cpu_seconds(pid)
    outcomes = asyncio.run(run_aiohttp(url, plans, texts, eos, 600.0))
    time.sleep(0.5)  # the gateway's last releases and access-log lines
    used = cpu_seconds(pid) - before
    lag_after = loop_lag(url)
    lag = 1000.0 * (lag_after[0] - lag_before[0]) / max(1.0, lag_after[1] - lag_before[1])
    done = [o for o in outcomes if o.status == 200 and o.tokens > 0]
    ttft = statistics.fmean(o.ttft for o in done if o.ttft is not None) * 1000.0 if done else 0.0
    return Run(len(done), sum(o.tokens for o in done), used, len(outcomes) - len(done), ttft, lag)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=12.0, help="chat streams a second (Poisson)")
    parser.add_argument("--seconds", type=float, default=20.0, help="arrivals per run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--token-delay", type=float, default=0.02, help="the simulator's seconds a token")
    parser.add_argument("--baseline-src", type=Path, help="a checkout of another commit, run in turns as 'before'")
    args = parser.parse_args()

    from gateway.tools.tinymodel import build_tokenizer

    if pinned(0):
        os.sched_setaffinity(0, {0})  # the client beside the simulator; the gateway alone on CPU 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-relay-cpu-"))
    tok_dir = build_tokenizer(tmp / "tokenizer")
    eos = _eos_id(tok_dir)
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    code = SIM_CODE.format(root=str(ROOT), port=sim_port, token_delay=args.token_delay, tokenizer=str(tok_dir))
    with contextlib.ExitStack() as stack:
        sim_log = stack.enter_context((tmp / "simulator.log").open("wb"))
        stack.enter_context(process([*pinned(0), sys.executable, "-c", code], sim_url + "/v1/models", sim_log))
        builds: dict[str, tuple[str, int]] = {}
        for name, src in (("now", None), ("before", args.baseline_src)):
            if name == "before" and src is None:
                continue
            port = free_port()
            # The access log to a file, as a log shipper's pipe would take it.
            log = stack.enter_context((tmp / f"gateway-{name}.log").open("wb"))
            proc = stack.enter_context(process(gateway_argv(src, sim_url, port, tok_dir),
                                               f"http://127.0.0.1:{port}/health", log))
            builds[name] = (f"http://127.0.0.1:{port}", proc.pid)
        names = list(builds)
        runs: dict[str, list[Run]] = {n: [] for n in names}
        for rep in range(args.repeat):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                url, pid = builds[name]
                run = one_run(url, pid, args.rate, args.seconds, 1000 + rep, eos, names.index(name))
                runs[name].append(run)
                print(f"relay_cpu: run {rep + 1} {name}: {run.requests} streams, {run.events} tokens, "
                      f"{run.cpu_s:.2f} CPU s: {run.ms_per_request:.2f} ms a stream, {run.us_per_token:.1f} us a "
                      f"token, mean TTFT {run.mean_ttft_ms:.1f} ms, loop lag {run.loop_lag_ms:.2f} ms, "
                      f"{run.failed} failed", file=sys.stderr)
        print(report(runs, args))
    return 0


def _eos_id(tok_dir: Path) -> int:
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(tok_dir)).eos_token_id
    return int(eos if eos is not None else 0)


def report(runs: dict[str, list[Run]], args: argparse.Namespace) -> str:
    lines = [f"gateway CPU against the simulator: {args.rate:g} streams/s for {args.seconds:g} s, {args.repeat} runs",
             "", "| build | streams a run | ms CPU a stream | us CPU a token | x now | mean TTFT ms | loop lag ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    now = runs.get("now", [])
    for name, rs in runs.items():
        ratios = [r.ms_per_request / n.ms_per_request for r, n in zip(rs, now, strict=True)]
        lines.append(f"| {name} | {statistics.median(r.requests for r in rs):.0f} | "
                     f"{statistics.median(r.ms_per_request for r in rs):.2f} | "
                     f"{statistics.median(r.us_per_token for r in rs):.1f} | {statistics.median(ratios):.2f}x | "
                     f"{statistics.median(r.mean_ttft_ms for r in rs):.1f} | "
                     f"{statistics.median(r.loop_lag_ms for r in rs):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
