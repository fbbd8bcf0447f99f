"""Where a run's time went, read off the servers: histogram means between two scrapes (vLLM's own time to first
token and queue time, the gateway's admission wait, its exchange with vLLM to the first event, its event loop's
lateness), a client's time to first token split at the gateway's handler by joining its access log, and the
kernel's account of each process's waits for a core."""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.cpu import Sched, sched
from bench.harness.scrape import metrics_page

ENGINE_TTFT = "vllm:time_to_first_token_seconds"
ENGINE_QUEUE = "vllm:request_queue_time_seconds"
GATEWAY_QUEUE = "vllm_guard_queue_wait_seconds"
GATEWAY_TTFT = "vllm_guard_time_to_first_token_seconds"
GATEWAY_LAG = "vllm_guard_event_loop_lag_seconds"  # how late its loop woke a timer due every 0.1 s
ENGINE_HISTOGRAMS = {"t_engine_ttft_s": ENGINE_TTFT, "t_engine_queue_s": ENGINE_QUEUE}
GATEWAY_HISTOGRAMS = {"t_gateway_queue_s": GATEWAY_QUEUE, "t_gateway_ttft_s": GATEWAY_TTFT,
                      "t_loop_lag_s": GATEWAY_LAG}  # fmt: skip


def histogram_totals(page: str, name: str) -> tuple[float, float]:
    """A histogram's (sum, count) on a Prometheus page, over all its label sets ((0, 0) when absent)."""
    total = count = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return total, count


def mean_since(before: tuple[float, float], now: tuple[float, float]) -> float:
    """The mean of what a histogram observed between two of its (sum, count) readings (0 when nothing was)."""
    count = now[1] - before[1]
    return (now[0] - before[0]) / count if count else 0.0


class Histograms:
    """(sum, count) of named histograms on a server's page at the start of a run; ``means()`` at its end."""

    def __init__(self, url: str, names: Mapping[str, str]) -> None:
        self.url, self.names = url, dict(names)
        page = metrics_page(url)
        self.before = {key: histogram_totals(page, name) for key, name in self.names.items()}

    def means(self) -> dict[str, float]:
        page = metrics_page(self.url)
        return {key: mean_since(self.before[key], histogram_totals(page, name)) for key, name in self.names.items()}


def loop_lags(page: str, past: float = 0.25) -> int:
    """How many of the gateway's event-loop lag observations on a page exceeded ``past`` seconds (one of the
    histogram's bucket bounds)."""
    total = within = 0.0
    for family in text_string_to_metric_families(page):
        if family.name != GATEWAY_LAG:
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                total = sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == past:
                within = sample.value
    return int(total - within)


# -- a client's time to first token, split at the gateway's handler -------------------------------------
@dataclass(frozen=True)
class Handled:
    """One request as the gateway's access log tells it: when its handler began, and its first event's write."""

    started: float
    ttft: float


def access_lines(text: str) -> dict[str, Handled]:
    """The guarded requests of a text access log (``key=value`` pairs) that wrote a first event, by request id."""
    handled: dict[str, Handled] = {}
    for line in text.splitlines():
        if not line.startswith("time="):
            continue
        fields = dict(pair.split("=", 1) for pair in line.split() if "=" in pair)
        rid, ttft_ms = fields.get("request_id", ""), fields.get("ttft_ms", "")
        if not rid or ttft_ms in ("", "None"):
            continue
        started = datetime.datetime.strptime(fields["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
        handled[rid] = Handled(started.replace(tzinfo=datetime.UTC).timestamp(), float(ttft_ms) / 1000)
    return handled


def p90(values: Sequence[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * 0.9))]


def ttft_split(seen: Iterable[tuple[str, float, float]], handled: Mapping[str, Handled]) -> dict[str, float]:
    """Each request the client saw (request id, wall-clock send, first event read) and the gateway logged: its
    time to first token before the gateway's handler, in it up to the first event written, and after that write;
    means and p90s in seconds (empty when none joined). Client and gateway share one clock: one machine."""
    before: list[float] = []
    inside: list[float] = []
    after: list[float] = []
    for rid, sent, first in seen:
        h = handled.get(rid)
        if h is None:
            continue
        before.append(h.started - sent)
        inside.append(h.ttft)
        after.append(first - (h.started + h.ttft))
    if not before:
        return {}
    return {"split_joined": float(len(before)), "split_before_s": statistics.fmean(before),
            "split_inside_s": statistics.fmean(inside), "split_after_s": statistics.fmean(after),
            "split_before_p90_s": p90(before), "split_inside_p90_s": p90(inside), "split_after_p90_s": p90(after)}


# -- who waited for a core ------------------------------------------------------------------------------
def labelled_processes(root_pid: int, label: str) -> dict[str, int]:
    """A server's processes by label: vLLM's children by their own names (``EngineCore``, ``Worker``...), the
    root as ``label``."""
    named: dict[str, int] = {}
    root = psutil.Process(root_pid)
    for proc in (root, *root.children(recursive=True)):
        name = proc.name()
        if name.startswith("VLLM::"):
            named[name.removeprefix("VLLM::")] = proc.pid
        elif proc.pid == root.pid:
            named[label] = proc.pid
    return named


class Waits:
    """The kernel's account (schedstat) of named processes over a run: seconds run and waited for a core."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self.before = self._now()

    def _now(self) -> dict[str, Sched]:
        out = {}
        for label, pid in self.pids.items():
            try:
                out[label] = sched(pid)
            except OSError:
                out[label] = Sched(0.0, 0.0, 0)
        return out

    def figures(self) -> dict[str, float]:
        now = self._now()
        out: dict[str, float] = {}
        for label in self.pids:
            d = now[label] - self.before[label]
            key = label.lower().replace(" ", "_")
            out[f"ran_{key}_s"], out[f"waited_{key}_s"] = d.ran, d.waited
        return out
