"""Realistic benchmark: chat traffic shaped like production on a real vLLM (CPU build, the tiny model), straight,
with vLLM's own ``--watermark 0.05``, and through the gateway (strict, and the default policy), runs in turns.

Traffic: Poisson arrivals of streamed chat requests, prompts of 150-400 words, every request asking
``max_tokens`` 1024 and really stopping at L tokens (``min_tokens: L - 1`` and a +100 ``logit_bias`` on EOS, so
the engine's own EOS check ends it: only the client knows L), L lognormal with mean 200 and sigma 0.8. The KV
cache is 64 MiB: 512 blocks of 128 tokens (a token of the tiny model costs 1 KiB), max_model_len 2,048.

Loads (``--workload``, repeatable):
- ``capacity``: ``--rate`` requests a second (the rate where direct's mean TTFT stays under 1 s on this machine:
  find it with ``--find-capacity``) for ``--duration`` seconds;
- ``double``: twice that rate;
- ``overload``: twice that rate for 60 s with the clients' read timeout at 30 s (sent as
  ``x-stainless-read-timeout``, as the OpenAI SDKs do) and the gateways run with ``--ttft-objective 5`` when
  they have that flag.

Targets: ``direct`` (vLLM), ``watermark`` (a second vLLM with ``--watermark 0.05``, what a user would set
instead of a gateway), ``strict`` (the gateway with ``--admission-policy strict``) and ``default`` (the gateway as
it starts without a policy flag; ``--gateway-src`` runs a checkout of one commit instead of this tree), and
``before``: the default policy of another commit (``--baseline-src``), beside it; the gateways front the first
vLLM. ``busy`` (only when asked for) is vLLM alone beside a process spinning ``--busy-cores`` of one core at
niceness 0, as much CPU as a gateway takes: what the gateway's CPU alone costs an engine it shares the cores with
(its CPU is shown as the gateway's). Every run of a load draws one plan of arrivals and lengths; each target gets
that plan with words of its own, so no target finds another's prompts in the prefix cache; the targets take
turns, the order rotating from run to run. Reported: medians over the runs and the median of the per-run ratios
to direct: output tokens/s, mean and p99 TTFT, goodput (requests completed with TTFT within the objective, per
second), completed within the objective, preemptions (the engine's ``vllm:num_preemptions_total`` delta),
refused (429/503), client timeouts, the CPU time of the engine, the gateway and the client, and the cores they
kept busy together; a picture per load of each request's TTFT over the first run.

    .venv/bin/python bench/realistic.py --find-capacity 0.5,1,1.5,2,3
    .venv/bin/python bench/realistic.py --rate 1.5 --workload capacity --workload double
    .venv/bin/python bench/realistic.py --rate 1.5 --workload overload --client sdk
    .venv/bin/python bench/realistic.py --rate 1.5 --workload double --client vllm
    .venv/bin/python bench/realistic.py --rate 1.5 --baseline-src /tmp/old-checkout   # + target 'before'
    .venv/bin/python bench/realistic.py --quick                      # a short smoke run of every load
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402 - vLLM requires it; the benchmark runs beside vLLM

from bench.cpu_share import Spinner, own_cpu_seconds  # noqa: E402
from bench.harness import plots  # noqa: E402
from bench.prefix_clients import gateway_refusals  # noqa: E402
from bench.realistic_clients import CLIENTS, run_vllm_bench  # noqa: E402
from bench.realistic_load import (  # noqa: E402
    TABLE_HEAD,
    Figures,
    Outcome,
    capacity,
    figures,
    plan,
    prompt,
    table,
)
from tests.e2e.servers import (  # noqa: E402
    DEFAULT_MAX_MODEL_LEN,
    GATEWAY_READY_PATHS,
    VLLM_READY_PATHS,
    ServerProcess,
    ensure_tiny_model,
    free_port,
    get_json,
    scrape_counter,
    vllm_server,
)

KV_CACHE_BYTES = 64 * 1024 * 1024  # 65,536 tokens of 1 KiB: 512 blocks of 128
WATERMARK = ("--watermark", "0.05")
PREEMPTIONS = "vllm:num_preemptions_total"
# Which engine each target runs on, and the gateway's flags (None: the engine itself).
TARGETS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "direct": ("direct", None),
    "watermark": ("watermark", None),
    "strict": ("direct", ("--admission-policy", "strict")),
    "default": ("direct", ()),
    # The default policy of another commit (--baseline-src): the policy before a change, run beside it.
    "before": ("direct", ()),
    # vLLM alone beside a process that keeps --busy-cores of the CPU busy, as a gateway's relaying does: what
    # the gateway's CPU alone costs an engine that shares the machine's cores with it.
    "busy": ("direct", None),
}


@dataclass(frozen=True)
class Load:
    rate_factor: float  # of --rate
    duration_s: float
    read_timeout_s: float
    objective_flag: bool  # the gateways run with --ttft-objective


LOADS = {
    "capacity": Load(1.0, 30.0, 600.0, False),
    "double": Load(2.0, 30.0, 600.0, False),
    "overload": Load(2.0, 60.0, 30.0, True),
}


def gateway_command(src: Path | None) -> list[str]:
    """The gateway's command line: the working tree's, or the package under ``src`` (a checkout of a commit)."""
    if src is None:
        return [sys.executable, "-m", "gateway.cli"]  # run from the repository root: the working tree's package
    boot = f"import sys; sys.path.insert(0, {str(src)!r}); from gateway.cli import main; sys.exit(main())"
    return [sys.executable, "-c", boot]


def has_flag(command: list[str], flag: str) -> bool:
    done = subprocess.run([*command, "serve", "--help"], capture_output=True, text=True, timeout=120, check=False)
    return flag in done.stdout


def wait_idle(engine: ServerProcess, timeout_s: float = 300.0) -> None:
    """Until the engine runs and queues nothing (it notices a client that gave up only at its next output)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = sum(scrape_counter(f"{engine.url}/metrics", n)
                   for n in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        if busy == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{engine.name} still busy after {timeout_s:.0f} s")


@dataclass
class Bench:
    """The servers of one invocation and how to send a run through each target."""

    engines: dict[str, ServerProcess]
    gateways: dict[tuple[str, bool], ServerProcess]
    eos_id: int
    client: str
    objective: float
    model: Path
    busy_cores: float = 0.0  # what target ``busy``'s spinning process takes of one core
    # Refusals the gateways counted (vllm_guard_rejections_total), by (target, load rate) then reason.
    reasons: dict[str, Counter[str]] = field(default_factory=dict)

    def only(self, engine: ServerProcess) -> None:
        """Stop the engines a run does not use (SIGSTOP to each server's process group), resume the one it does:
        an idle vLLM's CPU build still polls, and on two cores its processes took the CPU from the gateway in
        the runs that went through one (the gateway's loop answered /guard/status seconds late)."""
        for other in self.engines.values():
            if other.proc is not None and other.proc.poll() is None:
                os.killpg(other.proc.pid, signal.SIGCONT if other is engine else signal.SIGSTOP)

    def base(self, target: str, objective_flag: bool) -> str:
        engine, flags = TARGETS[target]
        return self.engines[engine].url if flags is None else self.gateways[(target, objective_flag)].url

    def run(self, target: str, load: Load, rate: float, seed: int, target_index: int) -> tuple[Figures, list[Outcome]]:
        plans = plan(rate * load.rate_factor, load.duration_s, seed)
        texts = [prompt(p, i, seed, target_index) for i, p in enumerate(plans)]
        engine = self.engines[TARGETS[target][0]]
        self.only(engine)
        wait_idle(engine)
        before = scrape_counter(f"{engine.url}/metrics", PREEMPTIONS)
        base = self.base(target, load.objective_flag)
        refused_before = gateway_refusals(base) if TARGETS[target][1] is not None else {}
        gateway = self.gateways[(target, load.objective_flag)] if TARGETS[target][1] is not None else None
        cpu_before = (cpu_seconds(engine), cpu_seconds(gateway), own_cpu_seconds())
        spinner = Spinner(self.busy_cores) if target == "busy" else None
        with spinner if spinner is not None else contextlib.nullcontext():
            if self.client == "vllm":
                outcomes = asyncio.run(run_vllm_bench(base, plans, texts, self.eos_id, load.read_timeout_s,
                                                      str(self.model)))
            else:
                outcomes = asyncio.run(CLIENTS[self.client](base, plans, texts, self.eos_id, load.read_timeout_s))
        wait_idle(engine)
        preempted = scrape_counter(f"{engine.url}/metrics", PREEMPTIONS) - before
        taken = spinner.cpu_s if spinner is not None else cpu_seconds(gateway) - cpu_before[1]
        cpu = (cpu_seconds(engine) - cpu_before[0], taken, own_cpu_seconds() - cpu_before[2])
        if TARGETS[target][1] is not None:
            counted = self.reasons.setdefault(f"{target} at {rate * load.rate_factor:g}/s", Counter())
            for reason, value in gateway_refusals(base).items():
                counted[reason] += round(value - refused_before.get(reason, 0.0))
        errors = sorted({o.error for o in outcomes if o.error})
        if errors:
            print(f"realistic: {target}: errors seen: {errors[:3]}", file=sys.stderr)
        return figures(outcomes, self.objective, preempted, cpu), outcomes


def cpu_seconds(server: ServerProcess | None) -> float:
    """User and system CPU time of a server and its children (vLLM's engine core is one), so far."""
    if server is None or server.proc is None:
        return 0.0
    try:
        root = psutil.Process(server.proc.pid)
        total = 0.0
        for proc in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total
    except psutil.Error:
        return 0.0


def renice_engine_core(engine: ServerProcess, niceness: int) -> int:
    """Every thread of vLLM's engine core process (``VLLM::EngineCore``) at ``niceness`` (Linux keeps a niceness
    per thread; threads it starts later inherit it); returns how many were set. Its busy loop waits for its worker
    by spinning on ``sched_yield``, which on a shared core takes the turns of the API server, the client and a
    gateway (docs/realistic.md, "Where a first token's time goes at capacity")."""
    if engine.proc is None:
        return 0
    count = 0
    for child in psutil.Process(engine.proc.pid).children(recursive=True):
        if child.name().startswith("VLLM::EngineCor"):
            for thread in child.threads():
                os.setpriority(os.PRIO_PROCESS, thread.id, niceness)
                count += 1
    return count


def start_servers(args: argparse.Namespace, targets: Sequence[str], loads: Sequence[str], logs: Path) -> Bench:
    model = ensure_tiny_model(DEFAULT_MAX_MODEL_LEN)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    engines: dict[str, ServerProcess] = {}
    for name in sorted({TARGETS[t][0] for t in targets} | {"direct"}):
        extra = WATERMARK if name == "watermark" else ()
        engines[name] = vllm_server(model, logs / f"vllm-{name}.log", kv_cache_memory_bytes=args.kv_cache_mib << 20,
                                    extra_args=extra).start()
    gateways: dict[tuple[str, bool], ServerProcess] = {}
    bench = Bench(engines, gateways, int(eos[0] if isinstance(eos, list) else eos), args.client, args.objective,
                  model, args.busy_cores)
    for engine in engines.values():
        engine.wait_ready(VLLM_READY_PATHS, 900)
        if args.engine_core_nice is not None and not renice_engine_core(engine, args.engine_core_nice):
            raise SystemExit(f"realistic: no engine core process found under {engine.name}'s pid")
    wanted = {LOADS[n].objective_flag for n in loads}
    for target in targets:
        flags = TARGETS[target][1]
        if flags is None:
            continue
        command = gateway_command(args.baseline_src if target == "before" else args.gateway_src)
        # A gateway without --ttft-objective serves the overload as it is.
        variants = wanted if has_flag(command, "--ttft-objective") else {False}
        for with_objective in sorted(variants):
            extra = ("--ttft-objective", f"{args.objective:g}") if with_objective else ()
            port = free_port()
            argv = [*command, "serve", "--upstream", engines["direct"].url, "--host", "127.0.0.1", "--port",
                    str(port), *flags, *extra]
            key = f"{target}{'-objective' if with_objective else ''}"
            gateways[(target, with_objective)] = ServerProcess(key, argv, port, logs / f"gateway-{key}.log").start()
        for with_objective in wanted - variants:
            gateways[(target, with_objective)] = gateways[(target, False)]
    for gateway in {id(g): g for g in gateways.values()}.values():
        gateway.wait_ready(GATEWAY_READY_PATHS, 180)
    return bench


def find_capacity(bench: Bench, rates: Sequence[float], duration_s: float) -> str:
    mean_ttft: dict[float, float] = {}
    lines = ["| rate /s | mean TTFT s | p99 TTFT s | output tok/s | preemptions |", "|" + " --- |" * 5]
    for i, rate in enumerate(rates):
        fig, _ = bench.run("direct", Load(1.0, duration_s, 600.0, False), rate, 9000 + i, 0)
        mean_ttft[rate] = fig.mean_ttft
        lines.append(f"| {rate:g} | {fig.mean_ttft:.2f} | {fig.p99_ttft:.2f} | {fig.tokens_per_s:.0f} | "
                     f"{fig.preemptions:.0f} |")
        print(f"realistic: direct at {rate:g}/s: {fig}", file=sys.stderr)
    found = capacity(mean_ttft)
    said = f"{found:g}/s" if found is not None else "below every rate tried"
    return "\n".join(lines) + f"\n\ncapacity (the highest rate with direct's mean TTFT under 1 s): {said}"


def picture(path: Path, load: str, first_run: dict[str, list[Outcome]], load_spec: Load, objective: float) -> str:
    why = plots.unavailable()
    if why is not None:
        return f"(picture skipped: {why})"
    series = [plots.TtftSeries(
        target, [o.at for o in out if o.completed], [o.ttft or 0.0 for o in out if o.completed],
        [o.at for o in out if o.status in (429, 503)], [o.at for o in out if o.timed_out],
    ) for target, out in first_run.items()]  # fmt: skip
    plots.ttft_figure(path, f"Time to first token over the run: {load} (first run)", series, objective,
                      load_spec.read_timeout_s if load_spec.read_timeout_s < 600 else None)
    return f"![{load}]({path})"


def measure(bench: Bench, args: argparse.Namespace, targets: list[str], loads: list[str],
            pictures: Path) -> str:
    results: dict[str, dict[str, list[Figures]]] = {n: {t: [] for t in targets} for n in loads}
    first: dict[str, dict[str, list[Outcome]]] = {n: {} for n in loads}
    for rep in range(args.repeat):
        for i, name in enumerate(loads):
            seed = 100 * rep + i
            order = targets[rep % len(targets):] + targets[: rep % len(targets)]
            for target in order:
                fig, outcomes = bench.run(target, LOADS[name], args.rate, seed, targets.index(target))
                results[name][target].append(fig)
                if rep == 0:
                    first[name][target] = outcomes
                print(f"realistic: run {rep + 1} {name} {target}: {fig}", file=sys.stderr)
    rows = [table(name, results[name], targets) for name in loads]
    drawn = [picture(pictures / f"realistic-{name}.png", name, first[name], LOADS[name], args.objective)
             for name in loads]
    return "\n".join([TABLE_HEAD, *rows]) + "\n\n" + "\n".join(drawn)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", choices=sorted(LOADS), help="repeatable; default all")
    parser.add_argument("--target", action="append", choices=list(TARGETS), help="repeatable; default all")
    parser.add_argument("--rate", type=float, default=1.0, help="the capacity rate, requests a second (1)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals of capacity and double")
    parser.add_argument("--repeat", type=int, default=3, help="runs per load, targets in turns (3)")
    parser.add_argument("--objective", type=float, default=5.0, help="TTFT objective of goodput, s (5)")
    parser.add_argument("--client", choices=[*sorted(CLIENTS), "vllm"], default="aiohttp",
                        help="aiohttp (light), sdk (the OpenAI SDK) or vllm (vLLM's benchmark client)")
    parser.add_argument("--find-capacity", type=str, default=None, help="comma-separated rates to try direct")
    parser.add_argument("--gateway-src", type=Path, default=None, help="run the gateway package under this dir "
                        "(a checkout of one commit); default: this working tree's")
    parser.add_argument("--baseline-src", type=Path, default=None, help="the gateway package of target 'before'")
    parser.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_BYTES >> 20, help="each engine's KV cache, "
                        "MiB (64: 512 blocks of 128 tokens); a smaller one makes the cache, not the CPU, bind first")
    parser.add_argument("--engine-core-nice", type=int, default=None, help="run every vLLM's engine core process "
                        "at this niceness (a setting of the host: every target gets it)")
    parser.add_argument("--busy-cores", type=float, default=0.3, help="what target 'busy' keeps busy beside vLLM "
                        "alone, of one core (0.3: the default policy's gateway at twice capacity)")
    parser.add_argument("--quick", action="store_true", help="one short run of each load (a smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--pictures", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args(argv)
    loads = args.workload or list(LOADS)
    targets = args.target or [t for t in TARGETS if t != "busy" and (t != "before" or args.baseline_src is not None)]
    if "direct" not in targets:
        targets.insert(0, "direct")
    if args.quick:
        args.repeat = 1
        for name, spec in LOADS.items():
            LOADS[name] = Load(spec.rate_factor, 8.0 if name != "overload" else 12.0, spec.read_timeout_s,
                               spec.objective_flag)
    elif args.duration is not None:
        for name in ("capacity", "double"):
            LOADS[name] = Load(LOADS[name].rate_factor, args.duration, LOADS[name].read_timeout_s, False)
    logs = Path(tempfile.mkdtemp(prefix="realistic-bench-"))
    print(f"realistic: logs in {logs}", file=sys.stderr)
    started = time.monotonic()
    bench = start_servers(args, targets if args.find_capacity is None else ["direct"], loads, logs)
    try:
        version = get_json(f"{bench.engines['direct'].url}/version").get("version", "?")
        if args.find_capacity is not None:
            body = find_capacity(bench, [float(r) for r in args.find_capacity.split(",")], args.duration or 30.0)
        else:
            body = measure(bench, args, targets, loads, args.pictures)
            said = "; ".join(f"{key}: " + ", ".join(f"{n} {reason}" for reason, n in sorted(c.items()) if n)
                             for key, c in bench.reasons.items() if sum(c.values()))
            body += f"\n\nThe gateways' refusals by reason (all runs): {said or 'none'}"
    finally:
        for engine in bench.engines.values():
            if engine.proc is not None and engine.proc.poll() is None:
                os.killpg(engine.proc.pid, signal.SIGCONT)  # a stopped server cannot take its SIGTERM
        for server in [*{id(g): g for g in bench.gateways.values()}.values(), *bench.engines.values()]:
            server.stop()
    runs = ("direct alone at each rate" if args.find_capacity is not None else
            f"capacity rate {args.rate:g}/s; {args.repeat} run(s) per load in turns")
    blocks = (args.kv_cache_mib << 20) // (1024 * 128)
    report = (f"vLLM {version} (CPU build), tiny model, {args.kv_cache_mib} MiB KV cache ({blocks} blocks of 128); "
              f"{runs}; client "
              f"{args.client}; objective {args.objective:g} s; {time.monotonic() - started:.0f} s in all; command: "
              f"`.venv/bin/python bench/realistic.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
              + body)
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
