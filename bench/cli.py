"""``python -m bench``: list the benchmarks, run one, or write docs/benchmarks.md from the latest results."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import registry
from bench.harness.context import Context
from bench.harness.results import RESULTS, write


def common_arguments(parser: argparse.ArgumentParser, targets: Sequence[str],
                     default_targets: Sequence[str]) -> None:
    """The options every benchmark takes; a benchmark's own defaults (``--repeat``, ``--seconds``) are set by it."""
    group = parser.add_argument_group("every benchmark")
    group.add_argument("--repeat", type=int, default=3, help="turns: each target runs once per turn, the order "
                       "rotating; figures are medians over turns (default 3)")
    group.add_argument("--seconds", type=float, default=None, help="how long each run sends traffic")
    group.add_argument("--target", action="append", choices=[*targets, "baseline"], default=None,
                       help=f"repeatable; default: {', '.join(default_targets)} (and baseline with "
                       "--baseline-commit)")
    group.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                       help="passed to every gateway's `vllm-guard serve` (repeatable; with '=' when it starts "
                       "with '-': --gateway-arg=--workers=2)")
    group.add_argument("--baseline-commit", default=None, metavar="SHA",
                       help="adds the gateway at this commit (its own source, extracted) as target 'baseline'")
    group.add_argument("--gateway-cpus", default=None, help="cores of the proxies (gateway, baseline, router), "
                       "a taskset list (default 1 where there are two cores or more)")
    group.add_argument("--engine-cpus", default=None, help="cores of the fake engine or simulator (default 0)")
    group.add_argument("--client-cpus", default=None, help="cores of the load generator (default: the engine's)")
    group.add_argument("--router-venv", type=Path, default=None, help="a virtual environment with "
                       "vllm-router 0.1.17 (default .cache/bench/router-venv, created with pip when missing)")
    group.add_argument("--out", type=Path, default=RESULTS, help="where results go (default bench/results)")
    group.add_argument("--no-save", action="store_true", help="print the table, write no result files")


def chosen_targets(args: argparse.Namespace, default_targets: Sequence[str]) -> list[str]:
    targets = list(args.target or default_targets)
    if args.baseline_commit and "baseline" not in targets:
        targets.append("baseline")
    if "baseline" in targets and not args.baseline_commit:
        raise SystemExit("target 'baseline' needs --baseline-commit SHA")
    return targets


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the benchmarks and what each measures")
    report = sub.add_parser("report", help="write docs/benchmarks.md from the latest result of each benchmark")
    report.add_argument("--results", type=Path, default=RESULTS)
    report.add_argument("--out", type=Path, default=None, help="default docs/benchmarks.md")
    run = sub.add_parser("run", help="run one benchmark")
    benches = run.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name in registry.names():
        mod = registry.module(name)
        p = benches.add_parser(name, help=mod.SUMMARY, description=mod.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        common_arguments(p, mod.TARGETS, mod.DEFAULT_TARGETS)
        mod.add_arguments(p)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.command == "list":
        for name in registry.names():
            mod = registry.module(name)
            print(f"{name:15} {mod.SUMMARY}\n{'':15} targets: {', '.join(mod.TARGETS)}")
        return 0
    if args.command == "report":
        from bench.report import write_report

        path = write_report(args.results, args.out)
        print(f"wrote {path}")
        return 0
    mod = registry.module(args.benchmark)
    args.targets = chosen_targets(args, mod.DEFAULT_TARGETS)
    with Context(args.benchmark, args, argv, out_dir=args.out) as ctx:
        if args.no_save:
            ctx.out_dir = ctx.logs  # its pictures beside its logs, not among the results
        result = mod.run(ctx)
    if args.no_save:
        from bench.harness.results import markdown

        print(markdown(result.to_json()))
        print(f"logs and pictures: {ctx.logs}", file=sys.stderr)
        return 0
    path, text = write(result, args.out)
    print(text)
    print(f"result: {path}", file=sys.stderr)
    return 0
