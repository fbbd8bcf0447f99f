"""A data-parallel vLLM (CPU build, ``--data-parallel-size 2``) alone and through the gateway under each admission
policy, runs in turns.

    python -m bench run engines                                  # direct / strict / adaptive, 3 turns
    python -m bench run engines --num-prompts 8 --output-len 400 --repeat 5
    python -m bench run engines --workload prefix-groups --target direct --target adaptive
    python -m bench run engines --ranks 1 --target direct --target defaults    # one engine, the gateway's defaults

vLLM serves the tiny model on two ranks (``--ranks``), each with a 4 MiB KV cache (32 blocks of 128 tokens, one of
them vLLM's null block) and max_model_len 2,048; the gateway books each rank on its own once a scrape shows them.
Workloads:

- ``flood`` (default): vLLM's own benchmark client, completions backend, random dataset, N x (prompt + output)
  tokens (default 16 x (1,000 + 900): a request needs 15 of a rank's 32 blocks at its longest, so two run on each
  rank at a time), ``--ignore-eos``, all at once;
- ``prefix-groups``: two prefix groups, the traffic where placement by prefix pays: ``prefix_repetition``
  dataset, two random shared prefixes of ``--prefix-len`` tokens (1,000), each followed in half the requests by a
  unique ``--suffix-len``-token suffix (32), ``--output-len`` output tokens (32), ``--max-concurrency`` requests
  at a time (8). vLLM alone places by load, so each rank computes each prefix; the gateway prefers the rank that
  holds or lately held the request's prefix.

Targets: ``direct`` (vLLM), ``strict`` and ``adaptive`` (the gateway with that policy and ``--queue-timeout 600``:
they queue rather than shed), ``defaults`` (the gateway without a flag: what a user gets), ``baseline``.

Every run uses its own seed, so no run finds the previous run's prompts in the prefix cache. Per target: output
tokens/s, mean and p99 TTFT, preemptions (per rank, from vLLM's ``engine``-labelled counters), the requests each
rank finished, the prefix-cache hit rate (all ranks and per rank), failed requests. Two separate servers behind
the gateway: ``servers-prefix``; an engine killed or frozen: ``faults``; rolling restarts: ``rolling``.
"""

from __future__ import annotations

import argparse

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.harness.scrape import get_json
from bench.targets import engines, proxies
from bench.workloads.engine_runs import EngineRun, failures, measure
from bench.workloads.prefix_groups import GROUPS, prefix_groups_args
from testing.servers import SERVED_MODEL_NAME

SUMMARY = "a data-parallel vLLM (2 ranks) alone and through the gateway: a flood, or two prefix groups"
TARGETS = ["direct", "strict", "adaptive", "defaults"]
DEFAULT_TARGETS = ["direct", "strict", "adaptive", "defaults"]
RANKS = 2
GATEWAY_ARGS = ("--queue-timeout", "600")
MODES = {"strict": ("--admission-policy", "strict"), "adaptive": ("--admission-policy", "adaptive"), "baseline": ()}


def gateway_flags(target: str) -> list[str]:
    """A gateway target's flags: ``defaults`` none at all, the others a policy and a queue that holds the flood."""
    return [] if target == "defaults" else [*GATEWAY_ARGS, *MODES[target]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--workload", choices=("flood", "prefix-groups"), default="flood")
    parser.add_argument("--ranks", type=int, default=RANKS, help=f"vLLM's data-parallel ranks ({RANKS})")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per run (16)")
    parser.add_argument("--input-len", type=int, default=1000, help="flood: prompt tokens per request (1000)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens (flood 900, prefix-groups 32)")
    parser.add_argument("--prefix-len", type=int, default=1000, help="prefix-groups: shared prefix tokens (1000)")
    parser.add_argument("--suffix-len", type=int, default=32, help="prefix-groups: unique suffix tokens (32)")
    parser.add_argument("--max-concurrency", type=int, default=8, help="prefix-groups: requests at a time (8)")


def flood_args(args: argparse.Namespace, model: object, base: str, seed: int) -> list[str]:
    return [
        "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions", "--model", SERVED_MODEL_NAME,
        "--tokenizer", str(model), "--seed", str(seed), "--request-rate", "inf", "--disable-tqdm",
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos",
        "--percentile-metrics", "ttft", "--metric-percentiles", "99",
    ]  # fmt: skip


def engine_measures(engines_: list[str], what: str) -> list[Measure]:
    """The per-run figures of ``EngineRun.as_dict``; ``what`` names an engine (rank, server)."""
    out = [Measure("hit_rate", "prefix-cache hit rate", ".3f"), Measure("tokens_per_s", "output tok/s", ".0f"),
           Measure("mean_ttft_ms", "mean TTFT ms", ".0f"), Measure("p99_ttft_ms", "p99 TTFT ms", ".0f"),
           Measure("preemptions", "preemptions (all runs)", ".0f", "none", "sum"),
           Measure("failed", "failed (all runs)", ".0f", "none", "sum")]  # fmt: skip
    for e in engines_:
        out += [Measure(f"hit_rate_{e}", f"hit rate, {what} {e}", ".3f", "none"),
                Measure(f"finished_{e}", f"requests finished, {what} {e}", ".0f", "none"),
                Measure(f"preempted_{e}", f"preemptions, {what} {e} (all runs)", ".0f", "none", "sum")]
    return out


def describe(args: argparse.Namespace) -> str:
    if args.workload == "prefix-groups":
        return (f"{GROUPS} prefix groups, {args.num_prompts} x ({args.prefix_len} shared + {args.suffix_len} unique "
                f"prompt + {args.output_len} output) tokens, --max-concurrency {args.max_concurrency}, --ignore-eos")
    return (f"{args.num_prompts} x ({args.input_len} prompt + {args.output_len} output) tokens, all at once, "
            "--ignore-eos")


def run(ctx: Context) -> Result:
    args = ctx.args
    groups = args.workload == "prefix-groups"
    args.output_len = args.output_len or (32 if groups else 900)
    if groups and (args.num_prompts < GROUPS or args.num_prompts % GROUPS):
        raise SystemExit(f"engines: --num-prompts must be a positive multiple of {GROUPS}, not {args.num_prompts}")
    targets = list(args.targets)
    if "direct" not in targets:
        targets.insert(0, "direct")
    model = engines.tiny_model()
    vllm = engines.vllm(ctx, "direct", flags=("--data-parallel-size", str(args.ranks)), model=model)
    ctx.start(vllm)
    gateways = {t: proxies.gateway(ctx, t, [vllm], flags=gateway_flags(t),
                                   commit=args.baseline_commit if t == "baseline" else None)
                for t in targets if t != "direct"}  # fmt: skip
    ctx.start(*gateways.values())
    for g in gateways.values():  # each rank booked on its own once a scrape shows them
        proxies.wait_engines_ready(g, args.ranks)
    seen: dict[str, list[EngineRun]] = {}

    def one(target: str, turn: int) -> dict[str, float]:
        base = gateways[target].url if target in gateways else vllm.url
        argv = (prefix_groups_args if groups else flood_args)(args, model, base, 100 * turn + targets.index(target))
        engines.wait_idle(vllm)
        r = measure([vllm.url], base, argv, target in gateways)
        engines.wait_idle(vllm)
        seen.setdefault(target, []).append(r)
        return r.as_dict()

    runs = in_turns(targets, args.repeat, one, lambda t, n, f: ctx.say(f"turn {n + 1} {t}: {f}"))
    version = get_json(f"{vllm.url}/version").get("version", "?")
    notes = [f"vLLM {version} (CPU build), --data-parallel-size {args.ranks}, 32-block KV cache per rank; "
             f"{describe(args)}"]
    return ctx.result(engine_measures([str(r) for r in range(args.ranks)], "rank"), runs, ["direct", "baseline"],
                      notes=notes, extra_markdown=failures(seen))
