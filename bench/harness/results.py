"""A benchmark's result: its runs, medians and comparisons, as JSON beside the Markdown and pictures made from it.

Files go to ``bench/results/<benchmark>/<date>T<time>-<commit>.{json,md}`` (pictures beside them, named by the
benchmark). The JSON holds everything the Markdown says and more (every run's figures, the targets' commands, the
machine's load), so that ``python -m bench report`` can write ``docs/benchmarks.md`` again from it alone.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.harness.pairing import Runs, comparisons, medians
from bench.harness.processes import ROOT
from gateway import native

RESULTS = ROOT / "bench" / "results"
SCHEMA = 1


@dataclass(frozen=True)
class Measure:
    """One figure of a benchmark: its key in the runs' figures, how it reads, and how targets compare on it
    (``ratio`` for rates and costs; ``delta`` where the difference is the point, as added latency)."""

    key: str
    label: str
    fmt: str = ".2f"
    compare: str = "ratio"  # or "delta" (the difference first), or "none" (counts: no comparison)
    aggregate: str = "median"  # over the turns; or "sum" (counts of every run), "max" (the worst run's)


@dataclass
class Result:
    benchmark: str
    command: str
    options: dict[str, Any]
    targets: dict[str, dict[str, Any]]  # name -> what it was (kind, command, cores, commit)
    measures: list[Measure]
    runs: Runs
    references: list[str]  # the targets every other is compared with, in the table's order
    notes: list[str] = field(default_factory=list)
    extra_markdown: str = ""  # tables of the benchmark's own (counting, refusals by reason...)
    pictures: list[str] = field(default_factory=list)  # file names beside the JSON
    started: str = field(default_factory=lambda: now_iso())
    host: dict[str, Any] = field(default_factory=lambda: host_facts())
    source: dict[str, str] = field(default_factory=lambda: source_facts())

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "benchmark": self.benchmark, "command": self.command, "started": self.started,
            "finished": now_iso(), "source": self.source, "host": self.host, "options": self.options,
            "targets": self.targets, "measures": [asdict(m) for m in self.measures], "references": self.references,
            "runs": self.runs, "medians": aggregated(self.runs, self.measures),
            "comparisons": comparisons(self.runs, self.references),
            "notes": self.notes, "extra_markdown": self.extra_markdown, "pictures": self.pictures,
        }  # fmt: skip


def aggregated(runs: Runs, measures: Sequence[Measure]) -> dict[str, dict[str, float]]:
    """Each target's figure over its runs: the median, or the sum or the maximum where the measure says so (the
    key ``medians`` in the JSON holds these)."""
    out = medians(runs)
    how = {m.key: m.aggregate for m in measures if m.aggregate != "median"}
    for target, rows in runs.items():
        for key, kind in how.items():
            known = [r[key] for r in rows if key in r and not math.isnan(r[key])]
            if known:
                out[target][key] = sum(known) if kind == "sum" else max(known)
    return out


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def source_facts() -> dict[str, str]:
    """The commit measured: HEAD, the last commit that changed the gateway, whether the gateway's files differ
    from it (then the figures are of uncommitted code), and whether its admission ran compiled (gateway/native.py:
    a build for these sources)."""
    return {"commit": git("rev-parse", "--short=7", "HEAD"),
            "gateway_commit": git("log", "-1", "--format=%h", "--abbrev=7", "--", "gateway"),
            "gateway_dirty": "yes" if git("status", "--porcelain", "--", "gateway") else "no",
            "admission": "compiled" if native.built(ROOT) is not None else "pure"}  # fmt: skip


def host_facts() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "machine": platform.machine()}  # fmt: skip


def fmt(value: float, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def compared(ratio: float | None, delta: float | None, measure: Measure) -> str:
    """A comparison's cell: the ratio; the difference first where it is the point (added latency); nothing for
    counts (errors)."""
    # A ratio of nothing to nothing (a hit rate of 0 against 0) is written to JSON as null and read back as None.
    ratio = math.nan if ratio is None else ratio
    delta = math.nan if delta is None else delta
    if measure.compare == "none" or math.isnan(delta):
        return ""
    if measure.compare == "delta":
        return f"{delta:+{measure.fmt}}" + (f" ({ratio:.2f}x)" if not math.isnan(ratio) else "")
    return f"{ratio:.2f}x" if not math.isnan(ratio) else ""


def table_pairs(targets: Sequence[str], references: Sequence[str],
                comps: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The comparisons the table shows: each target against each reference that comes before it in the
    references' order (the gateway against the engine and the router, the router against the engine, never the
    engine against the router)."""
    pairs = []
    for i, ref in enumerate(references):
        earlier = set(references[: i + 1])
        pairs += [(t, ref) for t in targets if t not in earlier and ref in comps.get(t, {})]
    return pairs


def table(data: Mapping[str, Any]) -> str:
    """The Markdown table of a result's JSON: a row per measure, the median of each target, then each target's
    median per-turn ratio (or difference) to each reference."""
    targets = list(data["runs"])
    measures = [Measure(**m) for m in data["measures"]]
    meds, comps = data["medians"], data["comparisons"]
    pairs = table_pairs(targets, data["references"], comps)
    shown = [m for m in measures if not all(_missing(meds[t].get(m.key)) for t in targets)]  # a phase left out
    rows = [[compared(c["ratio"], c["delta"], m)
             for c in (comps[t][r].get(m.key, {"ratio": math.nan, "delta": math.nan}) for t, r in pairs)]
            for m in shown]  # fmt: skip
    # A pair with no figure in common (the gateway against vLLM's frontend, measured on one row) is no column.
    kept = [i for i in range(len(pairs)) if any(row[i] for row in rows)]
    head = ["measure", *targets, *(f"{pairs[i][0]} vs {pairs[i][1]}" for i in kept)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for m, row in zip(shown, rows, strict=True):
        cells = [m.label, *(fmt(meds[t].get(m.key, math.nan), m.fmt) for t in targets), *(row[i] for i in kept)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(data: Mapping[str, Any]) -> str:
    """The whole report of one result: what was run, where, the table, the benchmark's own tables, pictures."""
    src, host = data["source"], data["host"]
    dirty = " (uncommitted changes)" if src.get("gateway_dirty") == "yes" else ""
    dirty += ", admission compiled" if src.get("admission") == "compiled" else ""
    lines = [
        f"`{data['command']}`",
        "",
        f"{data['started'][:10]}, gateway at commit {src['gateway_commit']}{dirty} (tree {src['commit']}); "
        f"{host['cpus']} cores, load average {host['load_avg'][0]:g} at the start; "
        f"{len(next(iter(data['runs'].values()), []))} turn(s), medians; comparisons are medians of per-turn ratios.",
        "",
        table(data),
    ]
    lines += [f"\n- {note}" if i == 0 else f"- {note}" for i, note in enumerate(data.get("notes", []))]
    if data.get("extra_markdown"):
        lines += ["", data["extra_markdown"]]
    lines += [f"\n![{p}]({p})" for p in data.get("pictures", [])]
    return "\n".join(lines) + "\n"


def stem(started: str, commit: str) -> str:
    """A result's file name without suffix: when it started (UTC, to the minute) and the tree's commit."""
    when = started.replace(":", "").replace("-", "")[:13]  # 20261128T0414
    return f"{when}-{commit}"


def write(result: Result, out_dir: Path = RESULTS) -> tuple[Path, str]:
    """Writes the JSON and the Markdown of a result; returns the JSON's path and the Markdown."""
    data = _clean(result.to_json())
    where = out_dir / result.benchmark
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{stem(data['started'], data['source']['commit'])}.json"
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    text = markdown(data)
    path.with_suffix(".md").write_text(f"# {result.benchmark}\n\n{text}")
    return path, text


def _clean(value: Any) -> Any:
    """NaN and infinities become null: the JSON stays standard."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def load(path: Path) -> dict[str, Any]:
    """A result's JSON, with the nulls of unknown figures back as NaN."""
    data: dict[str, Any] = json.loads(path.read_text())
    for key in ("runs", "medians", "comparisons"):
        data[key] = _unclean(data.get(key, {}))
    return data


def _unclean(value: Any) -> Any:
    if value is None:
        return math.nan
    if isinstance(value, dict):
        return {k: _unclean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unclean(v) for v in value]
    return value


def latest(benchmark: str, out_dir: Path = RESULTS) -> Path | None:
    files = sorted((out_dir / benchmark).glob("*.json"))
    return files[-1] if files else None


def all_benchmarks(out_dir: Path = RESULTS) -> Sequence[str]:
    return sorted(p.name for p in out_dir.iterdir() if p.is_dir()) if out_dir.is_dir() else []


def _missing(value: float | None) -> bool:
    """No figure: absent, or NaN (written to JSON as null, read back as None)."""
    return value is None or math.isnan(value)
