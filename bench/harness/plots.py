"""Pictures for the benchmark reports (PNG, drawn with matplotlib's Agg renderer into files, nothing shown).

matplotlib is the optional ``bench`` extra (``pip install -e '.[bench]'``) and is imported only inside the
functions that draw, so a benchmark runs without it and reports the picture as skipped: call
:func:`unavailable` first. No pyplot: a bare ``Figure`` has no global state and needs no display.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# One colour per column, in column order; the first column (vLLM direct in every report) is red.
PALETTE = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown")
DPI = 100


def unavailable() -> str | None:
    """Why no picture can be drawn on this machine, or None when it can."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    return None


@dataclass(frozen=True)
class Timeline:
    """One column's engine metrics over time: seconds since its flood started, KV usage 0..1, preemptions."""

    label: str
    t: Sequence[float]
    kv_usage: Sequence[float]
    preemptions: Sequence[float]  # cumulative since the column started


@dataclass(frozen=True)
class ColumnBars:
    """One column's summary figures; ``wait_p50``/``wait_p99`` are TTFT when streamed, else latency."""

    label: str
    tokens_per_s: float
    wait_p50: float | None
    wait_p99: float | None


def flood_figure(
    path: Path, title: str, timelines: Sequence[Timeline], bars: Sequence[ColumnBars], wait_name: str
) -> Path:
    """One row per column: its KV usage over time, each preemption marked; below, cumulative preemptions of
    every column on one time axis, then throughput and wait bars.

    ``wait_name`` names what ``wait_p50``/``wait_p99`` measure ("time to first token" or "latency").
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = len(timelines)
    fig = Figure(figsize=(10, 4.6 + 1.45 * rows), dpi=DPI, layout="constrained")
    fig.suptitle(title, fontsize=12)
    grid = fig.add_gridspec(rows + 2, 2, height_ratios=(*([1.0] * rows), 1.25, 1.9))
    pre = fig.add_subplot(grid[rows, :])
    for i, line in enumerate(timelines):
        _kv_row(fig.add_subplot(grid[i, :], sharex=pre), line, PALETTE[i % len(PALETTE)], first=i == 0)
        pre.step(line.t, line.preemptions, where="post", color=PALETTE[i % len(PALETTE)], label=line.label)
    pre.set_title("Preemptions counted by the engine (vllm:num_preemptions_total, cumulative)", fontsize=10)
    pre.set_ylabel("preemptions")
    pre.set_xlabel("time since the flood started (s)")
    pre.set_ylim(bottom=0)
    pre.yaxis.set_major_locator(MaxNLocator(integer=True))
    pre.set_xlim(left=0)
    pre.grid(alpha=0.3)
    pre.legend(loc="upper left", fontsize=9)

    names = [_wrap(b.label) for b in bars]
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(bars))]
    tput = fig.add_subplot(grid[rows + 1, 0])
    drawn = tput.bar(names, [b.tokens_per_s for b in bars], color=colours)
    tput.bar_label(drawn, fmt="%.0f", fontsize=9)
    tput.set_title("Completed tokens per second (higher is better)", fontsize=10)
    tput.set_ylabel("tokens/s")
    _headroom(tput)
    _wait_bars(fig.add_subplot(grid[rows + 1, 1]), names, bars, wait_name)
    return _save(fig, path)


def _kv_row(axes: Axes, line: Timeline, colour: str, first: bool) -> None:
    # Steps: a sampled gauge is known only at its samples, and holds its last value until the next one.
    used = [100.0 * u for u in line.kv_usage]
    axes.fill_between(line.t, used, step="post", color=colour, alpha=0.25, linewidth=0)
    axes.step(line.t, used, where="post", color=colour, linewidth=1.1)
    # A preemption lands between two samples; mark the sample that first counted it.
    marked = False
    for j in range(1, len(line.t)):
        new = line.preemptions[j] - line.preemptions[j - 1]
        if new > 0:
            axes.axvline(line.t[j], color="black", linewidth=0.9, linestyle="--",
                         label=None if marked else "preemption")  # fmt: skip
            if new > 1:
                axes.text(line.t[j], 103, f"{new:.0f}", fontsize=7, ha="center", va="bottom")
            marked = True
    peak = 100.0 * max(line.kv_usage, default=0.0)
    total = line.preemptions[-1] if line.preemptions else 0.0
    axes.text(0.005, 0.93, f"{line.label}: peak {peak:.0f}% of the KV cache, {total:.0f} preemptions",
              transform=axes.transAxes, fontsize=9, va="top", fontweight="bold",
              bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0})  # fmt: skip
    if first:
        axes.set_title("Engine KV cache in use (vllm:kv_cache_usage_perc, as sampled)", fontsize=10)
    if marked:
        axes.legend(loc="upper right", fontsize=8)
    axes.set_ylim(0, 118)
    axes.set_yticks([0, 50, 100])
    axes.set_ylabel("KV used (%)", fontsize=9)
    axes.axhline(100, color="grey", linewidth=0.8, linestyle=":")
    axes.grid(alpha=0.3)
    axes.tick_params(labelbottom=False)


def _wait_bars(axes: Axes, names: Sequence[str], bars: Sequence[ColumnBars], wait_name: str) -> None:
    width = 0.38
    xs = range(len(bars))
    for offset, (q, values, shade) in enumerate(
        (("p50", [b.wait_p50 for b in bars], 0.55), ("p99", [b.wait_p99 for b in bars], 1.0))
    ):
        drawn = axes.bar(
            [x + (offset - 0.5) * width for x in xs],
            [v or 0.0 for v in values],
            width,
            label=q,
            color=[PALETTE[i % len(PALETTE)] for i in xs],
            alpha=shade,
            edgecolor="black",
            linewidth=0.5,
        )
        axes.bar_label(drawn, labels=["-" if v is None else f"{v:.2f}" for v in values], fontsize=8)
    axes.set_xticks(list(xs), names)
    axes.set_title(f"{wait_name.capitalize()}, p50 (light) and p99 (lower is better)", fontsize=10)
    axes.set_ylabel("seconds")
    axes.legend(fontsize=9, loc="upper left")
    _headroom(axes)


@dataclass(frozen=True)
class RequestMark:
    """One request of the restart benchmark: when it started and ended (s since the load started)."""

    start: float
    end: float
    ok: bool
    retried: bool  # answered 429/503 at least once and sent again


def restart_figure(
    path: Path, title: str, requests: Sequence[RequestMark], killed_at: float, recovered_at: float | None
) -> Path:
    """Completed requests per second, and each request's latency at its start, around an engine kill."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.8), dpi=DPI, layout="constrained")
    fig.suptitle(title, fontsize=12)
    rate, lat = fig.subplots(2, 1, sharex=True)
    end = max((r.end for r in requests), default=killed_at + 1.0)
    bins = [float(s) for s in range(int(end) + 2)]
    rate.hist([r.end for r in requests if r.ok], bins=bins, color="tab:blue")
    rate.set_title("Requests answered 200 per second", fontsize=10)
    rate.set_ylabel("requests / s")
    for name, kind, colour, marker in (
        ("answered at once", (True, False), "tab:blue", "o"),
        ("retried after 429/503, then answered", (True, True), "tab:orange", "s"),
    ):
        picked = [r for r in requests if (r.ok, r.retried) == kind]
        lat.scatter([r.start for r in picked], [r.end - r.start for r in picked], s=14, color=colour,
                    marker=marker, label=name)  # fmt: skip
    lost = [r for r in requests if not r.ok]
    lat.scatter([r.start for r in lost], [r.end - r.start for r in lost], s=40, color="tab:red", marker="x",
                label=f"lost ({len(lost)})")  # fmt: skip
    lat.set_title("Each request's latency, at the time it was sent (retries included)", fontsize=10)
    lat.set_ylabel("latency (s, log scale)")
    lat.set_yscale("log")
    lat.set_xlabel("time since the load started (s)")
    for axes in (rate, lat):
        axes.axvline(killed_at, color="tab:red", linestyle="--", linewidth=1.2, label="engine killed (SIGKILL)")
        if recovered_at is not None:
            axes.axvspan(killed_at, recovered_at, color="tab:red", alpha=0.08, label="until the first success")
        axes.grid(alpha=0.3)
        axes.set_xlim(left=0)
    # One legend under both panels: inside either it would hide the requests it describes.
    handles, labels = lat.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=9)
    return _save(fig, path)


@dataclass(frozen=True)
class TtftSeries:
    """One target's requests over a run: when each was sent (s since the run started) and what came of it."""

    label: str
    sent: Sequence[float]  # answered requests
    ttft: Sequence[float]  # their time to first token, s
    refused: Sequence[float] = ()  # when refused requests were sent
    timed_out: Sequence[float] = ()  # when requests the client gave up on were sent


def ttft_figure(path: Path, title: str, series: Sequence[TtftSeries], objective: float | None = None,
                timeout: float | None = None) -> Path:
    """One row per target: each answered request's time to first token at the time it was sent; refusals
    marked at the bottom, client timeouts at the client's timeout; the objective as a dashed line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 1.2 + 1.9 * len(series)), dpi=DPI, layout="constrained")
    fig.suptitle(title, fontsize=12)
    axes_list = fig.subplots(len(series), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    top = max([*(t for s in series for t in s.ttft), objective or 0.0, timeout or 0.0, 1.0])
    for i, (axes, line) in enumerate(zip(axes_list, series, strict=True)):
        colour = PALETTE[i % len(PALETTE)]
        axes.scatter(line.sent, line.ttft, s=9, color=colour, label=f"answered ({len(line.ttft)})")
        if line.refused:
            axes.scatter(line.refused, [0.0] * len(line.refused), s=22, marker="x", color="black",
                         label=f"refused ({len(line.refused)})")  # fmt: skip
        if line.timed_out:
            axes.scatter(line.timed_out, [timeout or top] * len(line.timed_out), s=22, marker="v", color="tab:red",
                         label=f"client timed out ({len(line.timed_out)})")  # fmt: skip
        if objective is not None:
            axes.axhline(objective, color="grey", linestyle="--", linewidth=0.9, label=f"objective {objective:g} s")
        axes.set_title(line.label, fontsize=10, loc="left")
        axes.set_ylabel("TTFT (s)", fontsize=9)
        axes.set_ylim(-0.03 * top, top * 1.08)
        axes.grid(alpha=0.3)
        axes.legend(loc="upper left", fontsize=8, ncol=4)
    axes_list[-1].set_xlabel("time the request was sent, since the run started (s)")
    return _save(fig, path)


def _wrap(label: str) -> str:
    return label.replace(" (", "\n(")


def _headroom(axes: Axes) -> None:
    # Room above the tallest bar for its value label and the legend.
    low, high = axes.get_ylim()
    axes.set_ylim(low, high * 1.18 if high > 0 else 1.0)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Pillow's optimiser keeps a line chart's PNG at tens of KB.
    fig.savefig(path, format="png", pil_kwargs={"optimize": True})
    return path
