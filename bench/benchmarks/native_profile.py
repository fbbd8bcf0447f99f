"""Where a proxy's CPU goes below Python: on-CPU samples (perf) split into the kernel's work by system call and the
user side's by library, system calls and context switches per request, and the time runnable but waiting for
a core.

    python -m bench run profile [--repeat 1] [--seconds 8] [--target gateway --target router]

The fast fake engine and the load (wrk; the relay benchmark's stream client) share core 0, the proxy runs alone
on core 1, as in ``overhead`` and ``relay``. Per target and load (``--load``: ``c1``, one short chat at a time;
``c64``, 64 at a time; ``streams``, 128 streams of 200 tokens at 20 ms a token), for the load's whole run:

- ``perf record -e cpu-clock -g`` on every process of the target (samples only while a thread runs), split by
  ``bench.workloads.native`` into categories; a category's figure is its share of the samples times the CPU per
  request (or per relayed token) read from /proc over the same run;
- ``perf stat`` of the system calls (all, write, read, epoll_pwait, getpid) and context switches per unit;
- from /proc/<pid>/task/*/schedstat, the time the target's threads were runnable but waited for a core, per unit
  (what a sampler that cannot tell it from work, py-spy's ``--nonblocking``, counts as the loop's own).

Each run's most sampled leaf functions go to ``<target>-<load>-<turn>.leaves.txt`` beside the logs. Needs perf
(``apt-get install linux-perf``; ``perf stat -e task-clock true`` must work); a machine without hardware counters
is fine (``cpu-clock`` is a software event). The profiler's own cost is in the CPU read (a few percent).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from bench.benchmarks import relay
from bench.harness.context import Context
from bench.harness.cpu import cpu_seconds, sched
from bench.harness.pairing import Figures, in_turns
from bench.harness.results import Measure, Result
from bench.harness.target import Target
from bench.targets import engines, proxies
from bench.workloads import native, wrk

SUMMARY = "a proxy's CPU per request and per token below Python: kernel by system call, libraries, syscalls, waits"
TARGETS = ["gateway", "router", "workers"]
DEFAULT_TARGETS = ["gateway", "router"]
GATEWAY_FLAGS = ("--log-level", "warning", "--max-queue", "10000")
LOADS = ("c1", "c64", "streams")
STREAMS = relay.Load(128, 200, 0.02)
SYSCALLS = ("syscalls", "writes", "reads", "epoll waits", "getpid", "switches")
RATE_HZ = 999


def key(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_").replace("__", "_")


def measures(loads: list[str]) -> list[Measure]:
    out: list[Measure] = []
    for ld in loads:
        unit = "token" if ld == "streams" else "chat"
        at = f" ({ld})"
        out += [Measure(f"{ld}_rate", f"{unit}s/s{at}", ".0f"),
                Measure(f"{ld}_cpu_us", f"CPU per {unit} (us){at}", ".1f"),
                Measure(f"{ld}_wait_us", f"runnable, waiting for a core, per {unit} (us){at}", ".1f"),
                *(Measure(f"{ld}_n_{key(s)}", f"{s} per {unit}{at}", ".2f") for s in SYSCALLS),
                *(Measure(f"{ld}_us_{key(c)}", f"of the CPU: {c} (us){at}", ".1f") for c in native.CATEGORIES)]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(seconds=8.0, repeat=1)
    parser.add_argument("--load", action="append", choices=LOADS, default=None, help="repeatable; default all")
    parser.add_argument("--workers", type=int, default=2, help="the 'workers' target: --workers N (2)")


def perf() -> str:
    found = shutil.which("perf")
    if found is None:
        raise SystemExit("profile: perf is not installed (apt-get install linux-perf)")
    return found


def tree_pids(pid: int) -> list[int]:
    """The target's process and its children (a gateway's workers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return [pid]


def waited_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += sched(pid).waited
    return total


@contextlib.contextmanager
def profiled(pids: list[int], data: Path, stat: Path) -> Iterator[None]:
    """perf record and perf stat on ``pids`` for the block (SIGINT ends them, as a user's Ctrl-C); what perf
    says goes to ``<data>.log``."""
    tool, who = perf(), ",".join(map(str, pids))
    events = ",".join(native.SYSCALL_EVENTS.values())
    with data.with_suffix(".log").open("ab") as log:
        procs = [
            subprocess.Popen([tool, "record", "-e", "cpu-clock", "-F", str(RATE_HZ), "-g", "-p", who, "-o",
                              str(data)], stdout=log, stderr=log),
            subprocess.Popen([tool, "stat", "-x,", "-e", events, "-p", who, "-o", str(stat)], stdout=log, stderr=log),
        ]  # fmt: skip
    time.sleep(0.5)  # attached
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def script_lines(data: Path) -> list[str]:
    done = subprocess.run([perf(), "script", "-i", str(data), "-F", "tid,ip,sym,dso"], capture_output=True,
                          text=True, errors="replace", timeout=600, check=False)
    if done.returncode != 0:
        with data.with_suffix(".log").open("a") as log:
            log.write(done.stderr)
    return done.stdout.splitlines()


def drive(ctx: Context, target: Target, load: str) -> tuple[float, float]:
    """Runs one load against ``target``: (units done, units a second)."""
    url, cores = target.url + "/v1/chat/completions", ctx.cores.client
    if load in ("c1", "c64"):
        done = wrk.run(url, wrk.SHORT_CHAT, 1 if load == "c1" else 64, ctx.args.seconds, cores)
        return float(done.requests), done.per_second
    usage = "final" if target.kind == "gateway" else "continuous"
    seen = relay.client(ctx, target, STREAMS, usage)
    return float(seen["tokens"]), seen["tokens"] / seen["wall_s"] if seen["wall_s"] else math.nan


def one_run(ctx: Context, target: Target, load: str, turn: int) -> Figures:
    pids = tree_pids(target.pid)
    stem = f"{target.name}-{load}-{turn + 1}"
    data, stat = ctx.logs / f"{stem}.perf", ctx.logs / f"{stem}.stat"
    with profiled(pids, data, stat):
        cpu0, wait0 = cpu_seconds(target.pid), waited_s(pids)
        units, rate = drive(ctx, target, load)
        cpu, wait = cpu_seconds(target.pid) - cpu0, waited_s(pids) - wait0
    found = native.split(native.samples(script_lines(data)), top=40)
    (ctx.logs / f"{stem}.leaves.txt").write_text(
        "".join(f"{n:7} {100 * n / max(1, found.total):5.1f}%  {leaf}\n" for leaf, n in found.leaves))
    if found.total:
        data.unlink(missing_ok=True)  # tens of MB; the split and the leaves are kept
    else:
        ctx.say(f"{stem}: perf recorded no sample: see {data.with_suffix('.log')}")
    cpu_us = cpu * 1e6 / units if units else math.nan
    counts = native.grouped(native.stat_counts(stat.read_text().splitlines())) if stat.exists() else {}
    out: Figures = {f"{load}_rate": rate, f"{load}_cpu_us": cpu_us,
                    f"{load}_wait_us": wait * 1e6 / units if units else math.nan}
    out |= {f"{load}_n_{key(k)}": v for k, v in native.per_unit(counts, units, SYSCALLS).items()}
    out |= {f"{load}_us_{key(c)}": found.share(c) * cpu_us for c in native.CATEGORIES}
    return out


def run(ctx: Context) -> Result:
    perf()
    names, loads = ctx.args.targets, ctx.args.load or list(LOADS)
    engine = engines.fake(ctx, "engine", token_delay=0.0)
    tok = proxies.tokenizer_dir()
    started = [engine]
    for name in names:
        if name in ("gateway", "baseline", "workers"):
            flags = (*GATEWAY_FLAGS, "--workers", str(ctx.args.workers)) if name == "workers" else GATEWAY_FLAGS
            commit = ctx.args.baseline_commit if name == "baseline" else None
            started.append(proxies.gateway(ctx, name, [engine], flags=flags, tokenizer=tok, commit=commit))
        elif name == "router":
            started.append(proxies.router(ctx, "router", [engine]))
    ctx.start(*started)
    targets = {t.name: t for t in started}
    for name in names:  # warm-up: connections, caches, lazy imports
        wrk.run(targets[name].url + "/v1/chat/completions", wrk.SHORT_CHAT, 4, 1.0, ctx.cores.client)

    def measure(name: str, turn: int) -> Figures:
        figures: Figures = {}
        for load in loads:
            figures |= one_run(ctx, targets[name], load, turn)
        return figures

    def said(name: str, turn: int, f: Figures) -> None:
        top = {k: v for k, v in f.items() if "_us_" not in k}
        ctx.say(f"turn {turn + 1} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in top.items()))

    runs = in_turns(names, ctx.args.repeat, measure, said)
    notes = [f"perf record -e cpu-clock -F {RATE_HZ} -g and perf stat over each load's run; streams: "
             f"{STREAMS.label}, the gateway's client asking for the final usage; the leaves of each run: {ctx.logs}",
             f"cores: proxies {ctx.cores.proxy or 'any'}, engine {ctx.cores.engine or 'any'}, load "
             f"{ctx.cores.client or 'any'}; {ctx.args.seconds:g} s a load"]
    return ctx.result(measures(loads), runs, ["router", "baseline", "gateway"], notes=notes)
