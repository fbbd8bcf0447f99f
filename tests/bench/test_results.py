"""A result as JSON beside its Markdown: standard JSON (no NaN), figures and comparisons that read back as they
were, and the table of medians with each target's per-turn ratios to the references."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.harness.results import Measure, Result, latest, load, markdown, stem, table, table_pairs, write

MEASURES = [Measure("p50_ms", "p50 (ms)", ".2f", "delta"), Measure("per_s", "chats/s", ".0f"),
            Measure("errors", "errors", ".0f", "none")]  # fmt: skip


def result(**runs: list[dict[str, float]]) -> Result:
    return Result(
        benchmark="overhead", command="python -m bench run overhead --repeat 2", options={"repeat": 2},
        targets={"engine": {"kind": "fake"}}, measures=MEASURES, runs=runs, references=["engine", "router"],
        started="2026-11-28T04:14:59Z",
        source={"commit": "abc1234", "gateway_commit": "def5678", "gateway_dirty": "no"},
        host={"cpus": 2, "load_avg": [1.5, 1.0, 0.5], "python": "3.11", "machine": "x86_64"},
    )  # fmt: skip


RUNS = {
    "engine": [{"p50_ms": 0.25, "per_s": 14000.0, "errors": 0.0}, {"p50_ms": 0.30, "per_s": 12000.0, "errors": 0.0}],
    "gateway": [{"p50_ms": 3.25, "per_s": 600.0, "errors": 0.0}, {"p50_ms": 4.30, "per_s": math.nan, "errors": 1.0}],
    "router": [{"p50_ms": 0.45, "per_s": 8000.0, "errors": 0.0}, {"p50_ms": 0.50, "per_s": 7000.0, "errors": 0.0}],
}


def test_a_result_is_written_as_standard_json_and_markdown_named_by_time_and_commit(tmp_path: Path) -> None:
    path, text = write(result(**RUNS), tmp_path)
    assert path == tmp_path / "overhead" / "20261128T0414-abc1234.json"
    raw = path.read_text()
    json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # no NaN in the file
    assert path.with_suffix(".md").read_text() == f"# overhead\n\n{text}"
    assert latest("overhead", tmp_path) == path


def test_a_written_result_reads_back_with_its_unknown_figures_as_nan(tmp_path: Path) -> None:
    path, _ = write(result(**RUNS), tmp_path)
    data = load(path)
    assert math.isnan(data["runs"]["gateway"][1]["per_s"])
    assert data["medians"]["gateway"]["per_s"] == 600.0  # the median of what is known
    assert data["comparisons"]["gateway"]["engine"]["p50_ms"]["delta"] == 3.5  # (3.0 + 4.0) / 2
    assert data["source"]["gateway_commit"] == "def5678"


def test_the_table_has_a_row_per_measure_and_compares_each_target_with_the_references(tmp_path: Path) -> None:
    data = load(write(result(**RUNS), tmp_path)[0])
    lines = table(data).splitlines()
    assert lines[0] == ("| measure | engine | gateway | router | gateway vs engine | router vs engine "
                        "| gateway vs router |")
    assert lines[2] == "| p50 (ms) | 0.28 | 3.77 | 0.47 | +3.50 (13.67x) | +0.20 (1.73x) | +3.30 (7.91x) |"
    assert lines[3].startswith("| chats/s | 13000 | 600 | 7500 | 0.04x |")
    assert lines[4] == "| errors | 0 | 0 | 0 |  |  |  |"  # counts are not compared


def test_the_references_order_decides_who_is_compared_with_whom() -> None:
    comps = {"gateway": {"engine": {}, "router": {}, "baseline": {}}, "router": {"engine": {}, "baseline": {}},
             "baseline": {"engine": {}, "router": {}}, "engine": {"router": {}, "baseline": {}}}
    pairs = table_pairs(["engine", "gateway", "router", "baseline"], ["engine", "router", "baseline"], comps)
    assert pairs == [("gateway", "engine"), ("router", "engine"), ("baseline", "engine"), ("gateway", "router"),
                     ("baseline", "router"), ("gateway", "baseline")]


def test_the_markdown_says_the_command_the_date_and_the_commit_measured(tmp_path: Path) -> None:
    data = load(write(result(**RUNS), tmp_path)[0])
    text = markdown(data)
    assert text.startswith("`python -m bench run overhead --repeat 2`\n\n2026-11-28, gateway at commit def5678 ")
    assert "2 turn(s)" in text


def test_a_stem_sorts_by_time() -> None:
    assert stem("2026-11-28T04:14:59Z", "abc1234") < stem("2026-11-28T10:00:00Z", "0000000")


def test_counts_are_summed_over_the_runs_and_worst_cases_taken_at_their_worst(tmp_path: Path) -> None:
    r = result(engine=[{"errors": 1.0, "p99": 3.0}, {"errors": 2.0, "p99": 9.0}, {"errors": 0.0, "p99": 4.0}])
    r.measures = [Measure("errors", "errors", ".0f", "none", "sum"), Measure("p99", "p99", ".1f", "ratio", "max")]
    data = load(write(r, tmp_path)[0])
    assert data["medians"]["engine"] == {"errors": 3.0, "p99": 9.0}


def test_a_measure_no_target_has_a_figure_for_is_left_out_of_the_table(tmp_path: Path) -> None:
    r = result(engine=[{"p50_ms": 0.2}], gateway=[{"p50_ms": 3.0}])
    lines = table(load(write(r, tmp_path)[0])).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| p50 (ms)"]


def test_a_comparison_with_no_figure_in_common_is_no_column(tmp_path: Path) -> None:
    # vLLM's frontend is measured on one row only, which the engine has no figure for: no "frontend vs engine".
    r = result(engine=[{"p50_ms": 0.2, "per_s": 9000.0}], frontend=[{"errors": 0.0, "per_s": math.nan}],
               gateway=[{"p50_ms": 3.0, "per_s": 600.0}])
    r.references = ["engine", "frontend"]
    head = table(load(write(r, tmp_path)[0])).splitlines()[0]
    assert "gateway vs engine" in head and "frontend vs engine" not in head and "gateway vs frontend" not in head
