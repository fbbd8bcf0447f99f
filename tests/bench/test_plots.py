"""The benchmarks' pictures and the data behind them: the /metrics sampler, streamed TTFT, the PNGs."""

from __future__ import annotations

import asyncio
import http.server
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import plots
from bench.harness.timeline import MetricsSampler
from bench.workloads.flood import Column, Outcome, build_workloads, flood
from testing.vllm_sim import SimConfig, run_sim_server

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
METRICS_TEXT = b"""# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0
vllm:num_preemptions_total{engine="1",model_name="tiny"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:num_requests_running{engine="0",model_name="tiny"} 9.0
"""


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, list[str]]]:
    """A fixed Prometheus text on loopback; yields its URL and the paths it was asked for."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(METRICS_TEXT)))
            self.end_headers()
            self.wfile.write(METRICS_TEXT)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_sampler_sums_each_metric_over_its_label_sets_and_asks_only_for_them(
    metrics_server: tuple[str, list[str]],
) -> None:
    url, asked = metrics_server
    names = ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total")
    with MetricsSampler(url, names, interval_s=60.0) as sampler:
        pass
    # At least the scrape at the end, whatever the thread managed before the exit.
    assert sampler.samples
    assert sampler.samples[-1][1] == {"vllm:kv_cache_usage_perc": 0.25, "vllm:num_preemptions_total": 7.0}
    assert asked[0] == "/metrics?name%5B%5D=vllm%3Akv_cache_usage_perc&name%5B%5D=vllm%3Anum_preemptions_total"
    assert "samples every 60 s" in sampler.summary()


def test_sampler_counts_a_scrape_that_fails_as_missed_not_as_an_error() -> None:
    with MetricsSampler("http://127.0.0.1:9/metrics", ("vllm:kv_cache_usage_perc",), interval_s=60.0) as sampler:
        pass
    assert sampler.samples == []
    assert sampler.missed >= 1


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_flood_client_counts_tokens_and_measures_ttft_only_when_streamed(stream: bool) -> None:
    (workload,) = build_workloads(["full"], n=3, prompt_tokens=20, max_tokens=6, seed=0)
    with run_sim_server(SimConfig(num_blocks=64, token_delay=0.001)) as sim:
        outcomes, wall = asyncio.run(flood(sim.url, workload, eos_id=0, timeout_s=30.0, stream=stream))
    assert [(o.ok, o.tokens, o.as_planned) for o in outcomes] == [(True, 6, True)] * 3, outcomes
    assert wall > 0
    if stream:
        assert all(o.ttft_s is not None and 0 < o.ttft_s <= o.latency_s for o in outcomes)
    else:
        assert all(o.ttft_s is None for o in outcomes)


@pytest.mark.parametrize("ttft", [0.5, None], ids=["streamed", "not-streamed"])
def test_a_runs_ttft_is_known_only_for_a_streamed_run(ttft: float | None) -> None:
    column = Column("direct", [Outcome(True, 1.0, 10, as_planned=True, ttft_s=ttft),
                               Outcome(False, 2.0, 0, "HTTP 500")], wall_s=2.0)
    got = column.as_dict("full_")
    assert (got["full_p50_ttft_s"] == 0.5) is (ttft is not None)
    assert math.isnan(got["full_p50_ttft_s"]) is (ttft is None)
    assert (got["full_failed"], got["full_tokens_per_s"], got["full_as_planned"]) == (1.0, 5.0, 1.0)


def test_column_timeline_counts_preemptions_from_the_columns_start() -> None:
    samples = [
        (0.0, {"vllm:kv_cache_usage_perc": 0.5, "vllm:num_preemptions_total": 10.0}),
        (0.1, {"vllm:kv_cache_usage_perc": 1.0, "vllm:num_preemptions_total": 12.0}),
    ]
    column = Column("direct", samples=samples, preemptions_before=10.0)
    line = column.timeline()
    assert (list(line.t), list(line.kv_usage), list(line.preemptions)) == ([0.0, 0.1], [0.5, 1.0], [0.0, 2.0])


def test_without_matplotlib_the_benchmark_is_told_why_there_is_no_picture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plots.importlib.util, "find_spec", lambda name: None)
    reason = plots.unavailable()
    assert reason is not None
    assert "matplotlib" in reason and ".[bench]" in reason


def _needs_matplotlib() -> None:
    reason = plots.unavailable()
    if reason:
        pytest.skip(reason)


def test_flood_figure_is_a_small_png(tmp_path: Path) -> None:
    _needs_matplotlib()
    t = [i * 0.1 for i in range(80)]
    timelines = [
        plots.Timeline("vLLM direct", t, [min(1.0, x / 4) for x in t], [float(int(x)) for x in t]),
        plots.Timeline("gateway (strict)", t, [0.8] * len(t), [0.0] * len(t)),
        plots.Timeline("gateway (adaptive)", [], [], []),  # a column that was not sampled still draws
    ]
    bars = [
        plots.ColumnBars("vLLM direct", 1500.0, 2.0, 5.0),
        plots.ColumnBars("gateway (strict)", 1550.0, 3.0, 6.0),
        plots.ColumnBars("gateway (adaptive)", 1560.0, None, None),
    ]
    path = plots.flood_figure(tmp_path / "img" / "flood.png", "Flood", timelines, bars, "time to first token")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) < 150_000


def test_restart_figure_is_a_png(tmp_path: Path) -> None:
    _needs_matplotlib()
    marks = [plots.RequestMark(s, s + 0.5, ok=s != 3.0, retried=s == 2.0) for s in (0.0, 1.0, 2.0, 3.0, 9.0)]
    path = plots.restart_figure(tmp_path / "restart.png", "Restart", marks, killed_at=2.5, recovered_at=8.0)
    assert path.read_bytes().startswith(PNG_SIGNATURE)
