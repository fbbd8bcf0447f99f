"""docs/benchmarks.md is written from the latest result of each benchmark: its command, date and commit, its
table, its pictures copied beside the page; a benchmark without a result says how to make one."""

from __future__ import annotations

from pathlib import Path

from bench.harness.results import Measure, Result, write
from bench.report import write_report


def result(started: str, per_s: float, pictures: list[str] | None = None) -> Result:
    return Result(
        benchmark="overhead", command="python -m bench run overhead", options={}, targets={},
        measures=[Measure("per_s", "chats/s", ".0f")],
        runs={"engine": [{"per_s": 10000.0}], "gateway": [{"per_s": per_s}]},
        references=["engine"], started=started, pictures=pictures or [],
        source={"commit": "abc1234", "gateway_commit": "def5678", "gateway_dirty": "no"},
        host={"cpus": 2, "load_avg": [0.5, 0.5, 0.5], "python": "3.11", "machine": "x86_64"},
    )  # fmt: skip


def test_the_page_shows_each_benchmarks_latest_result_with_its_command_date_and_commit(tmp_path: Path) -> None:
    results = tmp_path / "results"
    write(result("2026-11-27T10:00:00Z", 500.0), results)
    picture = "20261128T1000-abc1234-c64.png"
    (results / "overhead").mkdir(parents=True, exist_ok=True)
    (results / "overhead" / picture).write_bytes(b"\x89PNG")
    write(result("2026-11-28T10:00:00Z", 3000.0, [picture]), results)
    page = write_report(results, tmp_path / "docs" / "benchmarks.md").read_text()
    overhead = page.split("## overhead")[1].split("## ")[0]
    assert "`python -m bench run overhead`" in overhead
    assert "2026-11-28, gateway at commit def5678" in overhead
    assert "| chats/s | 10000 | 3000 | 0.30x |" in overhead and "500" not in overhead
    assert f"![img/benchmarks/{picture}](img/benchmarks/{picture})" in overhead
    assert (tmp_path / "docs" / "img" / "benchmarks" / picture).read_bytes() == b"\x89PNG"


def test_a_benchmark_without_a_result_says_how_to_make_one(tmp_path: Path) -> None:
    page = write_report(tmp_path / "none", tmp_path / "benchmarks.md").read_text()
    assert "No result yet: `python -m bench run relay`." in page
