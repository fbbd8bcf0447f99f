"""The pure parts of bench/realistic.py: the traffic (Poisson arrivals, prompt sizes, true answer lengths), each
request's outcome, a run's figures and the report's ratios. Nothing here does I/O.

A run's traffic is one plan of arrivals and lengths; every target of the run gets the same plan with words of its
own (``prompt``), so no target finds another's prompts in the prefix cache.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_TOKENS = 1024
MEAN_LENGTH = 200.0
SIGMA = 0.8
MIN_WORDS, MAX_WORDS = 150, 400
REFUSED = frozenset({429, 503})

# Words of one or two tokens each in the tiny model's tokenizer (counted when the list was made): 400 of them
# make at most ~660 prompt tokens, which leaves room for max_tokens 1024 in the 2,048-token context.
WORDS = (
    "a", "an", "and", "answer", "answered", "answers", "are", "arguments", "as", "assistant", "at", "before", "but",
    "by", "cache", "capital", "card", "content", "dog", "for", "has", "i", "if", "in", "is", "it", "like", "list",
    "main", "model", "models", "name", "never", "of", "ok", "on", "once", "one", "or", "out", "over", "prompt",
    "ran", "role", "run", "say", "some", "step", "text", "than", "that", "the", "them", "there", "three", "time",
    "to", "token", "tokens", "too", "tool", "tools", "up", "upon", "user", "was", "with", "word", "work",
)


@dataclass(frozen=True)
class Planned:
    """One request of a run: when it arrives (s after the start), its prompt's words, and the answer's true
    length (tokens, EOS the last of them) that only the client knows."""

    at: float
    words: int
    length: int


def lognormal_length(rng: random.Random, mean: float = MEAN_LENGTH, sigma: float = SIGMA,
                     cap: int = MAX_TOKENS) -> int:
    """An answer length: lognormal with this mean (and sigma of the log), at least 1, at most ``cap``."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def plan(rate: float, duration_s: float, seed: int) -> list[Planned]:
    """Poisson arrivals at ``rate`` a second for ``duration_s`` seconds, each with its prompt size and length."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    rng = random.Random(seed)
    out: list[Planned] = []
    at = rng.expovariate(rate)
    while at < duration_s:
        out.append(Planned(at, rng.randint(MIN_WORDS, MAX_WORDS), lognormal_length(rng)))
        at += rng.expovariate(rate)
    return out


def prompt(planned: Planned, index: int, seed: int, target: int) -> str:
    """The words of request ``index`` for ``target``: as many as planned, drawn apart for each target."""
    rng = random.Random(f"{seed}:{target}:{index}")
    return " ".join(rng.choice(WORDS) for _ in range(planned.words))


def length_body(length: int, eos_id: int) -> dict[str, object]:
    """What makes a random-weight model stop at ``length`` tokens: EOS masked until ``min_tokens``, then a +100
    logit bias makes it the next draw (vLLM counts the EOS among the completion tokens)."""
    return {"min_tokens": length - 1, "logit_bias": {str(eos_id): 100}}


@dataclass(frozen=True)
class Outcome:
    """What the client saw of one request; times in seconds since the run's start."""

    at: float
    status: int | None  # None: no response (a timeout or a transport error)
    ttft: float | None  # from sending to the first streamed event
    tokens: int
    end: float
    timed_out: bool = False
    error: str = ""  # what went wrong, for the log

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.tokens > 0 and not self.timed_out


@dataclass(frozen=True)
class Figures:
    """One target's run: output tokens/s, TTFT (s), goodput (completed within the objective, a second) and the
    counts the table sums."""

    tokens_per_s: float
    mean_ttft: float
    p99_ttft: float
    goodput: float
    completed: int
    within: int  # completed within the objective
    refused: int
    timeouts: int
    failed: int
    preemptions: float = 0.0
    refusal_p99_ms: float = math.nan  # from sending to the refusal's answer
    engine_cpu_s: float = 0.0  # CPU time of the engine's processes during the run
    gateway_cpu_s: float = 0.0  # and of the gateway's (0 for direct targets)
    client_cpu_s: float = 0.0  # and of the client (the benchmark's own process)
    wall_s: float = 0.0  # from the start to the last answer

    @property
    def cores_busy(self) -> float:
        """The three together over the run's wall time: near the machine's cores, the run was CPU-bound, and what
        one of them takes the others did not get."""
        return (self.engine_cpu_s + self.gateway_cpu_s + self.client_cpu_s) / self.wall_s if self.wall_s else 0.0


def nearest_rank(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def figures(outcomes: Sequence[Outcome], objective: float, preemptions: float = 0.0,
            cpu: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> Figures:
    """A run's figures; its duration runs from the start to the last answer, refusal or timeout."""
    wall = max((o.end for o in outcomes), default=0.0)
    done = [o for o in outcomes if o.completed]
    ttfts = [o.ttft for o in done if o.ttft is not None]
    within = sum(1 for t in ttfts if t <= objective)
    refusals = [1000 * (o.end - o.at) for o in outcomes if o.status in REFUSED]
    refused = len(refusals)
    timeouts = sum(1 for o in outcomes if o.timed_out)
    return Figures(
        tokens_per_s=sum(o.tokens for o in done) / wall if wall else 0.0,
        mean_ttft=statistics.fmean(ttfts) if ttfts else math.nan,
        p99_ttft=nearest_rank(ttfts, 0.99),
        goodput=within / wall if wall else 0.0,
        completed=len(done), within=within, refused=refused, timeouts=timeouts,
        failed=len(outcomes) - len(done) - refused - timeouts, preemptions=preemptions,
        refusal_p99_ms=nearest_rank(refusals, 0.99), engine_cpu_s=cpu[0], gateway_cpu_s=cpu[1],
        client_cpu_s=cpu[2], wall_s=wall,
    )


RATIO_FIELDS = ("tokens_per_s", "mean_ttft", "p99_ttft", "goodput")


def median_ratios(runs: Mapping[str, Sequence[Figures]], target: str, base: str = "direct") -> dict[str, float]:
    """The median over runs of each run's ratio of ``target`` to ``base`` (runs paired by position)."""
    out: dict[str, float] = {}
    for name in RATIO_FIELDS:
        ratios = [getattr(t, name) / getattr(b, name) for t, b in zip(runs[target], runs[base], strict=True)
                  if getattr(b, name) and not math.isnan(getattr(b, name)) and not math.isnan(getattr(t, name))]
        out[name] = statistics.median(ratios) if ratios else math.nan
    return out


def _cell(value: float, ratio: float, fmt: str, base: bool) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:{fmt}}" if base else f"{value:{fmt}} ({ratio:.2f}x)"


def table(load: str, runs: Mapping[str, Sequence[Figures]], targets: Sequence[str]) -> str:
    """One markdown row per target: medians of its runs, with the median per-run ratio to direct; counts summed
    over the runs."""
    lines = []
    for target in targets:
        rows = runs[target]
        med = {name: statistics.median(getattr(r, name) for r in rows) for name in RATIO_FIELDS}
        ratio = median_ratios(runs, target)
        base = target == "direct"
        admitted = sum(r.completed for r in rows)
        within = sum(r.within for r in rows)
        lines.append(
            f"| {load} | {target} | {_cell(med['tokens_per_s'], ratio['tokens_per_s'], '.0f', base)} | "
            f"{_cell(med['mean_ttft'], ratio['mean_ttft'], '.2f', base)} | "
            f"{_cell(med['p99_ttft'], ratio['p99_ttft'], '.2f', base)} | "
            f"{_cell(med['goodput'], ratio['goodput'], '.2f', base)} | "
            f"{100 * within / admitted if admitted else 0:.0f}% | {sum(r.preemptions for r in rows):.0f} | "
            f"{sum(r.refused for r in rows)} | {_ms(rows)} | {sum(r.timeouts for r in rows)} | "
            f"{sum(r.failed for r in rows)} | {_cpu(rows)} |"
        )
    return "\n".join(lines)


def _ms(rows: Sequence[Figures]) -> str:
    """The slowest run's p99 time to a refusal."""
    known = [r.refusal_p99_ms for r in rows if not math.isnan(r.refusal_p99_ms)]
    return f"{max(known):.0f}" if known else "-"


def _cpu(rows: Sequence[Figures]) -> str:
    """Median CPU seconds a run took of the engine, the gateway and the client (they share the machine's cores),
    and the cores they kept busy together."""
    engine = statistics.median(r.engine_cpu_s for r in rows)
    gateway = statistics.median(r.gateway_cpu_s for r in rows)
    client = statistics.median(r.client_cpu_s for r in rows)
    busy = statistics.median(r.cores_busy for r in rows)
    return f"{engine:.0f} / {gateway:.0f} / {client:.0f} | {busy:.2f}"


TABLE_HEAD = (
    "| load | target | output tok/s (x direct) | mean TTFT s (x) | p99 TTFT s (x) | goodput /s (x) | completed within "
    "objective | preemptions (all runs) | refused | p99 ms to a refusal | client timeouts | failed | CPU s engine "
    "/ gateway / client | cores busy |\n" + "|" + " --- |" * 15
)


def capacity(mean_ttft_by_rate: Mapping[float, float], bound: float = 1.0) -> float | None:
    """The highest rate whose mean TTFT stayed under ``bound``, every lower rate's too (None: not even the
    lowest)."""
    best = None
    for rate in sorted(mean_ttft_by_rate):
        if not mean_ttft_by_rate[rate] < bound:
            break
        best = rate
    return best
