"""Shared-prompt workloads on a real vLLM (CPU build, prefix caching on), alone and through the gateway under each
admission policy, runs in turns.

    python -m bench run prefix                               # every workload, direct / strict / adaptive
    python -m bench run prefix --workload shared --repeat 5
    python -m bench run prefix --workload chat --target direct --target strict --target strict+time
    python -m bench run prefix --workload shared --workload overload --target direct --target watermark \\
        --target strict --target default                   # vLLM's --watermark 0.05 beside the gateway
    python -m bench run prefix ... --engine-core-nice 10      # every engine core at niceness 10

vLLM serves the tiny model with a 4,096-token KV cache (32 blocks of 128, one of them vLLM's null block) and
max_model_len 2,048, prefix caching on as by default. Workloads (``--workload``):

- ``shared``: vLLM's own benchmark client, dataset ``prefix_repetition``: 24 requests sharing one 1,200-token
  prefix plus 60 unique tokens, 200 output tokens, all at once, completions backend;
- ``groups``: the same with four prefixes (four system prompts), 32 requests;
- ``chat``: vLLM's benchmark client, chat backend, 16 x (900 prompt + 600 output) tokens, ``--ignore-eos``;
- ``multiturn``: the OpenAI SDK: 8 conversations of 4 turns, each turn re-sending the conversation so far plus a
  new question, streamed, 48 output tokens;
- ``n4``: the OpenAI SDK: 6 chat requests of ~700 prompt tokens with ``n = 4``, 120 output tokens, streamed;
- ``overload``: vLLM's benchmark client, chat backend: 64 requests arriving at 6 a second (Poisson), 700 prompt
  and 500 output tokens each +-90%, ``--ignore-eos``; its gateways keep the default 30-s queue timeout (the
  others run with 600 s). Counted too: refusals by the forecast (``queue_timeout_expected``) and after the whole
  timeout (``queue_timeout``), from the gateway's metrics.

Targets: ``direct`` (vLLM), ``watermark`` (a second vLLM with ``--watermark 0.05``), the gateway with ``strict``,
``adaptive``, ``strict+time`` (``--time-aware on``), ``strict-noshed`` (``--shed-early off``) or ``default``
(no policy flag), and ``baseline`` (the default policy at ``--baseline-commit``). Every run uses its own seed, so
no run finds the previous run's prompts in the cache. Per workload: output tokens/s, mean and p99 TTFT, mean
TPOT, the sequences at once (tok/s x TPOT), preemptions and the prefix-cache hit rate (vLLM's own counters),
failed requests.
"""

from __future__ import annotations

import argparse

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.harness.scrape import get_json, refusals, scrape
from bench.harness.target import Target
from bench.targets import engines, proxies
from bench.workloads.prefix import WORKLOADS, Run

SUMMARY = "shared-prefix, multi-turn, n>1 and overload workloads on a real vLLM, alone and under each policy"
MODES: dict[str, tuple[str, ...]] = {
    "strict": ("--admission-policy", "strict"), "adaptive": ("--admission-policy", "adaptive"),
    "strict+time": ("--admission-policy", "strict", "--time-aware", "on"),
    "strict-noshed": ("--admission-policy", "strict", "--shed-early", "off"), "default": (), "baseline": (),
}  # fmt: skip
TARGETS = ["direct", "strict", "adaptive", "watermark", "strict+time", "strict-noshed", "default"]
DEFAULT_TARGETS = ["direct", "strict", "adaptive"]
GATEWAY_ARGS = ("--queue-timeout", "600")
# The overload's gateways keep the default 30-s queue timeout, as a user runs them (the last flag wins).
WORKLOAD_GATEWAY_ARGS: dict[str, tuple[str, ...]] = {"overload": ("--queue-timeout", "30")}
COUNTERS = ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable; default all")
    parser.add_argument("--engine-core-nice", type=int, default=None, help="run each vLLM's engine core process "
                        "at this niceness (a setting of the host: every target gets it)")


def gateway_key(target: str, workload: str) -> str:
    """One gateway per target, and one more per target for workloads with flags of their own."""
    return f"{target}@{workload}" if workload in WORKLOAD_GATEWAY_ARGS else target


def measures(names: list[str]) -> list[Measure]:
    out: list[Measure] = []
    for w in names:
        out += [Measure(f"{w}_tokens_per_s", f"{w}: output tok/s", ".0f"),
                Measure(f"{w}_mean_ttft_ms", f"{w}: mean TTFT ms", ".0f"),
                Measure(f"{w}_p99_ttft_ms", f"{w}: p99 TTFT ms", ".0f"),
                Measure(f"{w}_mean_tpot_ms", f"{w}: mean TPOT ms", ".1f"),
                Measure(f"{w}_at_once", f"{w}: sequences at once (tok/s x TPOT)", ".1f"),
                Measure(f"{w}_preemptions", f"{w}: preemptions (all runs)", ".0f", "none", "sum"),
                Measure(f"{w}_hit_rate", f"{w}: prefix-cache hit rate", ".2f"),
                Measure(f"{w}_failed", f"{w}: failed (all runs)", ".0f", "none", "sum")]
        if w == "overload":
            out += [Measure("overload_shed", "overload: refused early by the forecast (all runs)", ".0f", "none",
                            "sum"),
                    Measure("overload_timed_out", "overload: refused after the whole timeout (all runs)", ".0f",
                            "none", "sum")]
    return out


def one(engine: Target, base: str, workload: str, model: object, seed: int, gated: bool) -> Run:
    engines.wait_idle(engine)
    before = {n: scrape(engine.url, n) for n in COUNTERS}
    refused = refusals(base) if gated else {}
    run = WORKLOADS[workload](base, model, seed)  # type: ignore[arg-type]
    engines.wait_idle(engine)
    delta = {n: scrape(engine.url, n) - before[n] for n in COUNTERS}
    run.preemptions = delta[COUNTERS[0]]
    run.hit_rate = delta[COUNTERS[1]] / delta[COUNTERS[2]] if delta[COUNTERS[2]] else float("nan")
    if gated:
        after = refusals(base)
        run.shed = after.get("queue_timeout_expected", 0.0) - refused.get("queue_timeout_expected", 0.0)
        run.timed_out = after.get("queue_timeout", 0.0) - refused.get("queue_timeout", 0.0)
    return run


def run(ctx: Context) -> Result:
    args = ctx.args
    names = args.workload or list(WORKLOADS)
    targets = list(args.targets)
    if "direct" not in targets:
        targets.insert(0, "direct")
    model = engines.tiny_model()
    vllms = {"direct": engines.vllm(ctx, "direct", model=model)}
    if "watermark" in targets:
        vllms["watermark"] = engines.vllm(ctx, "watermark", flags=("--watermark", "0.05"), model=model)
    ctx.start(*vllms.values())
    for engine in vllms.values():
        if args.engine_core_nice is not None and not engines.renice_engine_core(engine, args.engine_core_nice):
            raise SystemExit(f"prefix: no engine core process found under {engine.name}'s pid")
    gated = [t for t in targets if t not in vllms]
    gateways = {key: proxies.gateway(ctx, key, [vllms["direct"]], commit=args.baseline_commit if t == "baseline"
                                     else None, flags=[*GATEWAY_ARGS, *MODES[t], *WORKLOAD_GATEWAY_ARGS.get(w, ())])
                for t in gated for w in names for key in [gateway_key(t, w)]}  # fmt: skip
    ctx.start(*{id(g): g for g in gateways.values()}.values())

    def measure(target: str, turn: int) -> dict[str, float]:
        out: dict[str, float] = {}
        engine = vllms.get(target, vllms["direct"])
        for i, w in enumerate(names):
            base = engine.url if target in vllms else gateways[gateway_key(target, w)].url
            r = one(engine, base, w, model, 1000 * turn + 10 * i + targets.index(target), target not in vllms)
            out |= r.as_dict(f"{w}_")
        return out

    runs = in_turns(targets, args.repeat, measure, lambda t, n, f: ctx.say(f"turn {n + 1} {t}: {f}"))
    version = get_json(f"{vllms['direct'].url}/version").get("version", "?")
    notes = [f"vLLM {version} (CPU build), prefix caching on, 32-block KV cache; each workload's runs in turns"]
    return ctx.result(measures(names), runs, ["direct", "baseline"], notes=notes)
