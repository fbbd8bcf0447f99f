"""The entry point: every benchmark is listed and takes the common options; the baseline target comes with a
commit; a run's options reach the benchmark."""

from __future__ import annotations

import argparse

import pytest

from bench import registry
from bench.cli import chosen_targets, main, parser


def test_list_names_every_benchmark_with_its_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in registry.names():
        assert name in out


@pytest.mark.parametrize("name", registry.names())
def test_every_benchmark_takes_the_common_options(name: str) -> None:
    args = parser().parse_args(["run", name, "--repeat", "5", "--gateway-arg=--workers=2",
                                "--gateway-arg=--access-log=off", "--gateway-cpus", "1,2", "--no-save"])
    assert args.repeat == 5 and args.gateway_arg == ["--workers=2", "--access-log=off"]
    assert args.gateway_cpus == "1,2" and args.no_save
    mod = registry.module(name)
    assert mod.SUMMARY and set(mod.DEFAULT_TARGETS) <= set(mod.TARGETS)


def namespace(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**({"target": None, "baseline_commit": None} | kw))


def test_a_baseline_commit_adds_the_baseline_target() -> None:
    assert chosen_targets(namespace(), ["engine", "gateway"]) == ["engine", "gateway"]
    assert chosen_targets(namespace(baseline_commit="HEAD~1"), ["engine", "gateway"]) == ["engine", "gateway",
                                                                                           "baseline"]
    assert chosen_targets(namespace(target=["gateway"]), ["engine"]) == ["gateway"]
    with pytest.raises(SystemExit, match="needs --baseline-commit"):
        chosen_targets(namespace(target=["baseline"]), ["engine"])
