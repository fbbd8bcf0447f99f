"""Two separate vLLM servers and the two-prefix-group workload over them: placement by prefix (the gateway over
both, ``--upstream`` twice) against round-robin (``bench.servers.round_robin``, one proxy hop in its own process
that sends each request to the next server in turn) and against a second gateway placing by free blocks alone
(``--placement headroom``: the same gateway work per request, without the prefix).

    python -m bench run servers-prefix [--repeat 3]

Each server: the tiny model, a 4 MiB KV cache (32 blocks of 128 tokens), max_model_len 2,048, prefix caching on,
its worker on a core of its own (as each would have its own GPU). Workload: vLLM's own benchmark client,
``prefix_repetition`` dataset, two random shared prefixes (``--prefix-len`` 1,000, ``--suffix-len`` 32,
``--output-len`` 32, ``--max-concurrency`` 8), as ``engines --workload prefix-groups`` drives one data-parallel
server. Every run has its own seed, so its prefixes are new. Per target: the prefix-cache hit rate (both servers
and each), output tokens/s, mean TTFT, requests per server, preemptions, failed requests, and the gateway's
median per-turn ratios to round-robin and to the headroom gateway.
"""

from __future__ import annotations

import argparse

from bench.benchmarks.engines import engine_measures
from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.harness.scrape import get_json
from bench.harness.target import Target
from bench.targets import engines, proxies
from bench.workloads.engine_runs import EngineRun, failures, measure
from bench.workloads.prefix_groups import GROUPS, prefix_groups_args

SUMMARY = "two servers, two prefix groups: the gateway's placement by prefix vs round-robin and by free blocks"
TARGETS = ["round-robin", "headroom", "gateway"]
DEFAULT_TARGETS = ["round-robin", "headroom", "gateway"]
SERVERS = 2
GATEWAY_ARGS = ("--queue-timeout", "600")
VLLM_START_S = 900.0  # two servers start at once on a small CPU box


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per run (16)")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens per request (32)")
    parser.add_argument("--prefix-len", type=int, default=1000, help="shared prefix tokens (1000)")
    parser.add_argument("--suffix-len", type=int, default=32, help="unique suffix tokens (32)")
    parser.add_argument("--max-concurrency", type=int, default=8, help="requests at a time (8)")


def measures() -> list[Measure]:
    return engine_measures([str(i) for i in range(SERVERS)], "server")


def run(ctx: Context) -> Result:
    args = ctx.args
    if args.num_prompts < GROUPS or args.num_prompts % GROUPS:
        raise SystemExit(f"servers-prefix: --num-prompts must be a positive multiple of {GROUPS}")
    targets = list(args.targets)
    model = engines.tiny_model()
    servers = [engines.vllm(ctx, f"vllm{i}", model=model, core=i) for i in range(SERVERS)]
    for s in servers:
        s.ready_timeout = VLLM_START_S
    ctx.start(*servers)
    proxies_: dict[str, Target] = {}
    if "round-robin" in targets:
        proxies_["round-robin"] = proxies.round_robin(ctx, "round-robin", servers)
    for name, extra in (("gateway", ()), ("headroom", ("--placement", "headroom")), ("baseline", ())):
        if name in targets:
            proxies_[name] = proxies.gateway(ctx, name, servers, flags=[*GATEWAY_ARGS, *extra],
                                             commit=args.baseline_commit if name == "baseline" else None)
    ctx.start(*proxies_.values())
    for p in proxies_.values():
        if p.kind == "gateway":
            proxies.wait_engines_ready(p, SERVERS)
    urls = [s.url for s in servers]
    seen: dict[str, list[EngineRun]] = {}

    def one(target: str, turn: int) -> dict[str, float]:
        base = proxies_[target].url
        for s in servers:
            engines.wait_idle(s)
        r = measure(urls, base, prefix_groups_args(args, model, base, 100 * turn + targets.index(target)),
                    proxies_[target].kind == "gateway")
        for s in servers:
            engines.wait_idle(s)
        seen.setdefault(target, []).append(r)
        return r.as_dict()

    runs = in_turns(targets, args.repeat, one, lambda t, n, f: ctx.say(f"turn {n + 1} {t}: {f}"))
    version = get_json(f"{servers[0].url}/version").get("version", "?")
    notes = [f"vLLM {version} (CPU build), {SERVERS} servers of one 32-block KV cache each; {GROUPS} prefix groups, "
             f"{args.num_prompts} x ({args.prefix_len} shared + {args.suffix_len} unique prompt + {args.output_len} "
             f"output) tokens, --max-concurrency {args.max_concurrency}, --ignore-eos"]
    return ctx.result(measures(), runs, ["round-robin", "headroom", "baseline"], notes=notes,
                      extra_markdown=failures(seen))
