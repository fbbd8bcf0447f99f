"""One invocation of a benchmark: its options, where its logs go, which cores each side gets, the targets it
started (stopped together at the end), and the result it builds."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from bench.harness.processes import ROOT, stop_all
from bench.harness.results import RESULTS, Measure, Result, now_iso, source_facts, stem
from bench.harness.target import Target

if TYPE_CHECKING:
    import argparse

CACHE = ROOT / ".cache" / "bench"


@dataclass(frozen=True)
class Cores:
    """Which cores each side runs on (taskset lists; None: not pinned)."""

    proxy: str | None
    engine: str | None
    client: str | None

    @staticmethod
    def default(proxy: str | None = None, engine: str | None = None, client: str | None = None,
                pin: bool = True) -> Cores:
        """The proxy alone on core 1, the engine and the client on core 0, on a machine of two cores or more;
        without ``pin`` (benchmarks of a real vLLM, which spreads over the cores) only what was asked for."""
        if len(os.sched_getaffinity(0)) < 2:
            return Cores(None, None, None)
        if not pin:
            return Cores(proxy, engine, client)
        return Cores(proxy or "1", engine or "0", client or engine or "0")


@dataclass
class Context:
    benchmark: str
    args: argparse.Namespace
    argv: Sequence[str]
    out_dir: Path = RESULTS
    started: str = field(default_factory=now_iso)
    source: dict[str, str] = field(default_factory=source_facts)
    targets: dict[str, Target] = field(default_factory=dict)
    cache: Path = CACHE  # logs go under its runs/
    _t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.stem = stem(self.started, self.source["commit"])
        self.logs = self.cache / "runs" / f"{self.benchmark}-{self.stem}"
        self.logs.mkdir(parents=True, exist_ok=True)
        a = self.args
        self.cores = Cores.default(getattr(a, "gateway_cpus", None), getattr(a, "engine_cpus", None),
                                   getattr(a, "client_cpus", None), getattr(a, "pin", True))

    @property
    def command(self) -> str:
        return "python -m bench " + " ".join(shlex.quote(a) for a in self.argv)

    def say(self, message: str) -> None:
        print(f"[{self.benchmark} {time.monotonic() - self._t0:6.0f}s] {message}", file=sys.stderr, flush=True)

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def picture(self, name: str) -> Path:
        """Where a picture of this result goes: beside its JSON, named after it."""
        where = self.out_dir / self.benchmark
        where.mkdir(parents=True, exist_ok=True)
        return where / f"{self.stem}-{name}.png"

    def start(self, *targets: Target) -> None:
        """Starts the targets together, then waits until each is ready."""
        for target in targets:
            self.targets[target.name] = target
            target.server.start()
        for target in targets:
            target.server.wait_ready(target.ready_paths, target.ready_timeout)
            self.say(f"{target.name} ({target.kind}) ready at {target.url}, cores {target.server.cpus or 'any'}")

    def stop(self, *names: str) -> None:
        stop_all(self.targets.pop(n).server for n in names if n in self.targets)

    def result(self, measures: Sequence[Measure], runs: dict[str, list[dict[str, float]]], references: Sequence[str],
               **extra: Any) -> Result:
        options = {k: v for k, v in sorted(vars(self.args).items()) if k not in ("func", "command")}
        return Result(benchmark=self.benchmark, command=self.command, options=_jsonable(options),
                      targets={n: t.describe() for n, t in self.targets.items()}, measures=list(measures), runs=runs,
                      references=[r for r in references if r in runs], started=self.started, source=self.source,
                      **extra)  # fmt: skip

    def __enter__(self) -> Context:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        stop_all(t.server for t in reversed(list(self.targets.values())))
        self.targets.clear()


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


@contextlib.contextmanager
def pinned_self(cpus: str | None) -> Iterator[None]:
    """This process (the client's side) on ``cpus`` for the block, back to what it had after."""
    from bench.harness.processes import cpu_list

    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpu_list(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
