"""Runs in turns and what they are compared by.

On a shared machine one run moves by tens of percent from the next; two targets measured one after the other
differ by the moment as much as by themselves. So every target runs once per turn, on the same traffic (the same
arrivals and lengths for the turn), in an order that rotates from turn to turn (who goes first is often slower),
and a comparison is the median over turns of each turn's ratio (or difference) to a named target: a slow turn
slows both sides of its own ratio.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

Figures = dict[str, float]
Runs = dict[str, list[Figures]]


def rotated(names: Sequence[str], turn: int) -> list[str]:
    """The order of turn ``turn``: the list rotated by one place per turn."""
    if not names:
        return []
    k = turn % len(names)
    return [*names[k:], *names[:k]]


def in_turns(targets: Sequence[str], repeat: int, measure: Callable[[str, int], Figures],
             report: Callable[[str, int, Figures], None] | None = None) -> Runs:
    """``measure(target, turn)`` for every target in each of ``repeat`` turns, the order rotating; the figures of
    each target in turn order."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    runs: Runs = {t: [] for t in targets}
    for turn in range(repeat):
        for target in rotated(targets, turn):
            figures = measure(target, turn)
            runs[target].append(figures)
            if report is not None:
                report(target, turn, figures)
    return runs


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if v is not None and not math.isnan(v)]


def median(values: Iterable[float]) -> float:
    """The median of the known values (NaN when none is)."""
    known = _finite(values)
    return statistics.median(known) if known else math.nan


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (a value that was seen; NaN of nothing)."""
    ordered = sorted(_finite(values))
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def paired(runs: Mapping[str, Sequence[Figures]], target: str, base: str, key: str,
           how: Callable[[float, float], float]) -> float:
    """The median over turns of ``how(target's figure, base's figure)``, turns paired by position; turns where
    either figure is missing, NaN, or (for a ratio) the base is 0 are left out."""
    values = []
    for mine, theirs in zip(runs.get(target, ()), runs.get(base, ()), strict=False):
        a, b = mine.get(key, math.nan), theirs.get(key, math.nan)
        if math.isnan(a) or math.isnan(b):
            continue
        try:
            values.append(how(a, b))
        except ZeroDivisionError:
            continue
    return median(values)


def median_ratio(runs: Mapping[str, Sequence[Figures]], target: str, base: str, key: str) -> float:
    return paired(runs, target, base, key, lambda a, b: a / b)


def median_delta(runs: Mapping[str, Sequence[Figures]], target: str, base: str, key: str) -> float:
    return paired(runs, target, base, key, lambda a, b: a - b)


def medians(runs: Mapping[str, Sequence[Figures]]) -> dict[str, Figures]:
    """Each target's median of each figure over its runs."""
    out: dict[str, Figures] = {}
    for target, rows in runs.items():
        keys = {k for row in rows for k in row}
        out[target] = {k: median(row.get(k, math.nan) for row in rows) for k in sorted(keys)}
    return out


def comparisons(runs: Mapping[str, Sequence[Figures]],
                references: Sequence[str]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """For each target and each reference target present (not itself): per figure, the median of the per-turn
    ratios and differences. ``out[target][reference][key] = {"ratio": r, "delta": d}``."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for target, rows in runs.items():
        keys = sorted({k for row in rows for k in row})
        for ref in references:
            if ref == target or ref not in runs:
                continue
            out.setdefault(target, {})[ref] = {
                k: {"ratio": median_ratio(runs, target, ref, k), "delta": median_delta(runs, target, ref, k)}
                for k in keys
            }
    return out
