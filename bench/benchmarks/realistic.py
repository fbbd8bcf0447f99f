"""Chat traffic shaped like production on a real vLLM (CPU build, the tiny model): vLLM alone, vLLM with its own
``--watermark 0.05``, and through the gateway (strict, and the default policy), runs in turns.

    python -m bench run realistic --find-capacity 0.5,1,1.5,2,3
    python -m bench run realistic --rate 1.5 --workload capacity --workload double
    python -m bench run realistic --rate 1.5 --workload overload --client sdk
    python -m bench run realistic --rate 24 --workload capacity --variant budget4=HEAD::--preemption-budget=4
    python -m bench run realistic --rate 1.5 --baseline-commit HEAD~5         # + target 'baseline'
    python -m bench run realistic --rate 24 --workload overload-1.5x --workload overload-3x --repeat 3
    python -m bench run realistic --rate 24 --workload overload --mix long --hog 1
    python -m bench run realistic --quick                                    # a short smoke run of every load

Traffic: Poisson arrivals of streamed chat requests, prompts of 150-400 words, every request asking ``max_tokens``
1024 and really stopping where the engine draws EOS: a ``logit_bias`` on EOS alone makes each token end it with
the chance 1/L, L lognormal with mean 200 and sigma 0.8 (``length_body``; nobody, the gateway included, knows the
length in advance: a ``min_tokens`` would declare it). The KV cache is 64 MiB: 512 blocks of 128 tokens (a
token of the tiny model costs 1 KiB), max_model_len 2,048.

Loads (``--workload``, repeatable): ``capacity`` (``--rate`` requests a second, the rate where vLLM alone's mean
TTFT stays under 1 s on this machine: find it with ``--find-capacity``), ``double`` (twice that), ``overload``
(twice that for 60 s with the clients' read timeout at 30 s, sent as ``x-stainless-read-timeout`` as the OpenAI
SDKs do), and the grid's other overloads ``overload-1.5x`` and ``overload-3x`` (1.5 and 3 times the rate, the
same otherwise). ``--mix long`` draws the grid's second distribution (longer prompts, shorter answers) in place of
the chat one; ``--hog CORES`` runs a CPU hog in a session of its own beside every target's run. Each turn draws
its own seed of arrivals (the same for every target of the turn).

Targets: ``direct`` (vLLM), ``watermark`` (a second vLLM with ``--watermark 0.05``, what a user would set instead
of a gateway), ``strict`` (the gateway with ``--admission-policy strict``), ``default`` (the gateway as it starts
without a flag; ``--gateway-commit`` runs a commit's instead of this tree's), ``objective`` (the default gateway
with ``--ttft-objective`` at ``--objective``, the goodput's objective), ``default+watermark`` (the default gateway
in front of the watermark's vLLM, told of it with ``--engine-watermark``), ``baseline`` (the default
policy at ``--baseline-commit``), ``busy`` (only when asked for: vLLM alone beside a process spinning
``--busy-cores`` of one core, what the gateway's CPU alone costs an engine it shares the cores with), and each
``--variant NAME=COMMIT[::FLAG,FLAG][@nice=N|@batch|@cpus=LIST]`` (a gateway at a commit, ``.`` for this tree,
with flags; after ``@`` how its threads run: at a niceness, under ``SCHED_BATCH``, on given cores). The gateways
front the first vLLM. Every run of a load draws one plan of arrivals and lengths; each target gets that plan with
words of its own, so none finds another's prompts in the prefix cache; the order rotates from turn to turn.

Reported per load: medians and the median per-turn ratios to direct of output tokens/s, mean and p99 TTFT,
goodput (completed within the objective, a second); completed within the objective; preemptions, refusals
(429/503), client timeouts and failures summed over the runs; the CPU seconds of the engine, the gateway and the
client, the gateway's CPU per output token and the cores they kept busy; where the time went (vLLM's own TTFT and
queue time, the gateway's admission wait and its exchange with vLLM, its loop's lateness). ``--ttft-split`` splits
each client's TTFT at the gateway's handler (before it, in it, after its first write; from its access log);
``--schedstat`` adds the seconds each process waited for a core. A picture per load of each request's TTFT over
the first turn.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.benchmarks.realistic_run import ENGINE_OF, LOADS, Bench, Load, picture, quick_loads
from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.processes import cpu_list
from bench.harness.results import Measure, Result
from bench.harness.target import Target
from bench.targets import engines, proxies
from bench.workloads.realistic import MIXES, Outcome, capacity
from bench.workloads.realistic_clients import CLIENTS

SUMMARY = "production-shaped chat streams on a real vLLM: alone, with --watermark, through the gateway's policies"
TARGETS = ["direct", "watermark", "strict", "default", "objective", "default+watermark", "busy"]
DEFAULT_TARGETS = ["direct", "watermark", "strict", "default", "objective"]
KV_CACHE_MIB = 64
WATERMARK = ("--watermark", "0.05")
# The gateway's flags per gateway target (the variants bring their own).
GATEWAY_FLAGS = {"strict": ("--admission-policy", "strict"), "default": (), "baseline": (),
                 "default+watermark": ("--engine-watermark", WATERMARK[1])}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)  # vLLM spreads over the cores as a user runs it; --*-cpus pin anyway
    parser.add_argument("--workload", action="append", choices=sorted(LOADS), help="repeatable; default all")
    parser.add_argument("--rate", type=float, default=1.0, help="the capacity rate, requests a second (1)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals of capacity and double")
    parser.add_argument("--objective", type=float, default=5.0, help="TTFT objective of goodput, s (5)")
    parser.add_argument("--client", choices=[*sorted(CLIENTS), "vllm"], default="aiohttp",
                        help="aiohttp (light), sdk (the OpenAI SDK) or vllm (vLLM's benchmark client)")
    parser.add_argument("--find-capacity", default=None, help="comma-separated rates to try vLLM alone at")
    parser.add_argument("--gateway-commit", default=None, help="run targets strict and default from this commit")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=COMMIT[::FLAG,FLAG][@MODE]",
                        help="a gateway at a commit ('.': this tree) with flags, as target NAME (repeatable); MODE: "
                        "nice=N, batch or cpus=LIST, how its threads run")
    parser.add_argument("--client-nice", type=int, default=None, help="run the load client (this process) at this "
                        "niceness once the servers run")
    parser.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB, help="each engine's KV cache, MiB (64: "
                        "512 blocks of 128 tokens); a smaller one makes the cache, not the CPU, bind first")
    parser.add_argument("--engine-core-nice", type=int, default=None, help="run every vLLM's engine core process "
                        "at this niceness (a setting of the host: every target gets it)")
    parser.add_argument("--busy-cores", type=float, default=0.3, help="what target 'busy' keeps busy beside vLLM "
                        "alone, of one core (0.3: the default policy's gateway at twice capacity)")
    parser.add_argument("--mix", choices=sorted(MIXES), default="chat", help="prompts and answers: chat (150-400 "
                        "words, answers ~200 tokens) or long (500-850 words, answers ~60 tokens, max_tokens 512)")
    parser.add_argument("--hog", type=float, default=0.0, metavar="CORES", help="a process of its own session "
                        "spinning this much of one core beside every target's run (the grid's CPU hog cell)")
    parser.add_argument("--ttft-split", action="store_true", help="split each TTFT at the gateway's handler")
    parser.add_argument("--schedstat", action="store_true", help="add each process's seconds waiting for a core")
    parser.add_argument("--quick", action="store_true", help="one short turn of each load (a smoke test)")


@dataclass(frozen=True)
class GatewaySpec:
    commit: str | None  # None: this tree
    flags: tuple[str, ...]
    mode: str = ""  # how its threads run: "nice=N", "batch", "cpus=LIST" or "" (as started)


def variant(spec: str) -> tuple[str, GatewaySpec]:
    """``NAME=COMMIT[::FLAG,FLAG][@MODE]`` as (name, spec)."""
    name, sep, rest = spec.partition("=")
    rest, _, mode = rest.partition("@")
    if not sep or not name or (mode and not re.fullmatch(r"nice=-?\d+|batch|cpus=[\d,-]+", mode)):
        raise SystemExit(f"realistic: a variant is NAME=COMMIT[::FLAG,FLAG][@nice=N|@batch|@cpus=LIST], got {spec!r}")
    commit, _, flags = rest.partition("::")
    return name, GatewaySpec(None if commit in ("", ".") else commit, tuple(f for f in flags.split(",") if f), mode)


def gateway_specs(args: argparse.Namespace, targets: list[str]) -> dict[str, GatewaySpec]:
    """Each gateway target's commit, flags and mode."""
    specs: dict[str, GatewaySpec] = {}
    for t in targets:
        if t in ("strict", "default", "default+watermark"):
            specs[t] = GatewaySpec(args.gateway_commit, GATEWAY_FLAGS[t])
        elif t == "objective":
            specs[t] = GatewaySpec(args.gateway_commit, ("--ttft-objective", f"{args.objective:g}"))
        elif t == "baseline":
            specs[t] = GatewaySpec(args.baseline_commit, ())
    specs.update(variant(v) for v in args.variant)
    return specs


def run_as(target: Target, mode: str) -> None:
    """Every thread of a started gateway at a niceness, under SCHED_BATCH, or on given cores (threads it starts
    later inherit it). A niceness is given to the gateway's autogroup as well, where the kernel groups by session
    (``/proc/sys/kernel/sched_autogroup_enabled``): each server runs in a session of its own, and a thread's own
    niceness weighs only against the threads of its session, so alone it changed nothing between the gateway
    and vLLM (docs/realistic.md)."""
    kind, _, value = mode.partition("=")
    autogroup = Path(f"/proc/{target.pid}/autogroup")
    if kind == "nice" and autogroup.exists():
        autogroup.write_text(value)
    for task in Path(f"/proc/{target.pid}/task").iterdir():
        tid = int(task.name)
        if kind == "nice":
            os.setpriority(os.PRIO_PROCESS, tid, int(value))
        elif kind == "batch":
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        elif kind == "cpus":
            os.sched_setaffinity(tid, cpu_list(value))


def start(ctx: Context, targets: list[str], loads: list[str]) -> Bench:
    args = ctx.args
    model = engines.tiny_model()
    kv = args.kv_cache_mib << 20
    started = {name: engines.vllm(ctx, name, flags=WATERMARK if name == "watermark" else (), kv_cache_bytes=kv,
                                  model=model) for name in sorted({ENGINE_OF.get(t, "direct") for t in targets})}
    ctx.start(*started.values())
    bench = Bench(ctx, started, {}, engines.eos_id(model), model)
    for engine in started.values():
        if args.engine_core_nice is not None and not engines.renice_engine_core(engine, args.engine_core_nice):
            raise SystemExit(f"realistic: no engine core process found under {engine.name}'s pid")
    gateways: list[Target] = []
    modes: dict[str, str] = {}
    for name, spec in gateway_specs(args, targets).items():
        gw = proxies.gateway(ctx, name, [started[ENGINE_OF.get(name, "direct")]], flags=list(spec.flags),
                             commit=spec.commit)
        bench.gateways[name] = gw
        gateways.append(gw)
        if spec.mode:
            modes[name] = spec.mode
    ctx.start(*gateways)
    for gw in gateways:
        if gw.name in modes:
            run_as(gw, modes[gw.name])
            gw.about["mode"] = modes[gw.name]
    if args.client_nice is not None:  # once the servers run: they would inherit it
        os.setpriority(os.PRIO_PROCESS, 0, args.client_nice)
    return bench


def measures(loads: list[str], split: bool, waits: list[str], hog: bool = False) -> list[Measure]:
    out: list[Measure] = []
    for load in loads:
        def m(key: str, label: str, fmt: str = ".2f", compare: str = "ratio", aggregate: str = "median",
              load: str = load) -> Measure:
            return Measure(f"{load}_{key}", f"{load}: {label}", fmt, compare, aggregate)

        out += [m("tokens_per_s", "output tok/s", ".0f"), m("mean_ttft", "mean TTFT s"), m("p99_ttft", "p99 TTFT s"),
                m("goodput", "goodput /s"), m("completed", "completed (all runs)", ".0f", "none", "sum"),
                m("within_pct", "completed within the objective %", ".0f", "none"),
                m("preemptions", "preemptions (all runs)", ".0f", "none", "sum"),
                m("refused", "refused (all runs)", ".0f", "none", "sum"),
                m("refusal_p99_ms", "p99 ms to a refusal (worst run)", ".0f", "none", "max"),
                m("timeouts", "client timeouts (all runs)", ".0f", "none", "sum"),
                m("failed", "failed (all runs)", ".0f", "none", "sum"),
                m("engine_cpu_s", "CPU s engine", ".0f"), m("gateway_cpu_s", "CPU s gateway (or spinner)", ".1f"),
                m("client_cpu_s", "CPU s client", ".1f"), m("gateway_cpu_us_token", "gateway CPU per token us", ".0f"),
                m("frontend_cpu_us_token", "vLLM API server's own CPU per token us", ".0f"),
                m("cores_busy", "cores busy"), m("t_engine_ttft_s", "vLLM's own mean TTFT s"),
                m("t_engine_queue_s", "of it in vLLM's queue s"), m("t_gateway_queue_s", "gateway's admission wait s"),
                m("t_gateway_ttft_s", "gateway's request to vLLM to first event s"),
                m("t_loop_lag_s", "gateway's loop lateness a wakeup s", ".3f")]  # fmt: skip
        if split:
            out += [m("split_before_s", "TTFT before the gateway's handler s", ".3f"),
                    m("split_inside_s", "TTFT in the handler to its first write s", ".3f"),
                    m("split_after_s", "TTFT after that write s", ".3f")]
        out += [m(f"waited_{w}_s", f"{w} waited for a core s", ".2f") for w in waits]
        if hog:
            out.append(m("hog_cpu_s", "CPU s the hog took", ".1f"))
    return out


def find_capacity(ctx: Context, bench: Bench, rates: list[float], duration_s: float) -> Result:
    runs: dict[str, list[dict[str, float]]] = {"direct": [{}]}
    lines = ["| rate /s | mean TTFT s | p99 TTFT s | output tok/s | preemptions |", "|" + " --- |" * 5]
    mean_ttft: dict[float, float] = {}
    for i, rate in enumerate(rates):
        fig, _, _ = bench.run("direct", Load(1.0, duration_s, 600.0), rate, 9000 + i, 0)
        mean_ttft[rate] = fig.mean_ttft
        runs["direct"][0] |= fig.as_dict(f"r{rate:g}_")
        lines.append(f"| {rate:g} | {fig.mean_ttft:.2f} | {fig.p99_ttft:.2f} | {fig.tokens_per_s:.0f} | "
                     f"{fig.preemptions:.0f} |")
    found = capacity(mean_ttft)
    said = f"{found:g}/s" if found is not None else "below every rate tried"
    text = "\n".join(lines) + f"\n\ncapacity (the highest rate with vLLM alone's mean TTFT under 1 s): {said}"
    ms = [Measure(f"r{r:g}_{k}", f"at {r:g}/s: {label}", fmt) for r in rates
          for k, label, fmt in (("mean_ttft", "mean TTFT s", ".2f"), ("tokens_per_s", "output tok/s", ".0f"))]
    return ctx.result(ms, runs, [], extra_markdown=text, notes=["vLLM alone at each rate, one run each"])


def run(ctx: Context) -> Result:
    args = ctx.args
    loads = args.workload or list(LOADS)
    specs = dict(LOADS)
    if args.quick:
        args.repeat, specs = 1, quick_loads()
    elif args.duration is not None:
        specs = {n: Load(s.rate_factor, s.duration_s if s.sustained else args.duration, s.read_timeout_s)
                 for n, s in specs.items()}
    targets = list(args.targets) + [variant(v)[0] for v in args.variant if variant(v)[0] not in args.targets]
    if "direct" not in targets:
        targets.insert(0, "direct")
    if args.find_capacity is not None:
        bench = start(ctx, ["direct"], [])
        return find_capacity(ctx, bench, [float(r) for r in args.find_capacity.split(",")], args.duration or 30.0)
    bench = start(ctx, targets, loads)
    first: dict[str, dict[str, list[Outcome]]] = {n: {} for n in loads}
    reasons: dict[str, Counter[str]] = {}
    waits: set[str] = set()

    def measure(target: str, turn: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, name in enumerate(loads):
            fig, outcomes, extra = bench.run(target, specs[name], args.rate, 100 * turn + i, targets.index(target),
                                             reasons=reasons)
            out |= fig.as_dict(f"{name}_") | {f"{name}_{k}": v for k, v in extra.items()}
            waits.update(k[len("waited_"):-2] for k in extra if k.startswith("waited_"))
            if turn == 0:
                first[name][target] = outcomes
        return out

    runs = in_turns(targets, args.repeat, measure, lambda t, n, f: ctx.say(f"turn {n + 1} {t}: {len(f)} figures"))
    pictures = [picture(ctx, name, first[name], specs[name], args.objective) for name in loads]
    said = "; ".join(f"{key}: " + ", ".join(f"{n} {reason}" for reason, n in sorted(c.items()) if n)
                     for key, c in reasons.items() if sum(c.values()))
    blocks = (args.kv_cache_mib << 20) // (1024 * 128)
    mix = MIXES[args.mix]
    hog = f"; a CPU hog spinning {args.hog:g} of a core beside every run" if args.hog > 0 else ""
    notes = [f"vLLM {bench.version()} (CPU build), tiny model, {args.kv_cache_mib} MiB KV cache ({blocks} blocks of "
             f"128); capacity rate {args.rate:g}/s; client {args.client}; objective {args.objective:g} s; "
             f"{os.cpu_count()} cores shared by vLLM, the gateways and the client{hog}",
             f"mix {args.mix}: prompts of {mix.min_words}-{mix.max_words} words, answers around "
             f"{mix.mean_length:g} tokens, max_tokens {mix.max_tokens}; each turn its own seed of arrivals",
             f"the gateways' refusals by reason (all runs): {said or 'none'}"]
    return ctx.result(measures(loads, args.ttft_split, sorted(waits), args.hog > 0), runs, ["direct", "baseline"],
                      notes=notes, pictures=[p for p in pictures if p])
