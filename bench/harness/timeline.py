"""Samples a Prometheus /metrics endpoint in a background thread while a benchmark runs.

A thread (not a task on the benchmark's event loop) so that the samples keep their pace however busy the
client loop is. Each sample sums every named metric over its label sets, as the reports do.

    with MetricsSampler(f"{vllm.url}/metrics", ("vllm:kv_cache_usage_perc",), interval_s=0.1) as sampler:
        run_the_flood()
    sampler.samples  # [(monotonic time, {name: value}), ...]
"""

from __future__ import annotations

import itertools
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from types import TracebackType

from testing.servers import metric_sum

Sample = tuple[float, dict[str, float]]


class MetricsSampler:
    """Scrapes ``url`` every ``interval_s`` from ``__enter__`` to ``__exit__`` (the thread is joined there)."""

    def __init__(self, url: str, names: Sequence[str], interval_s: float = 0.1) -> None:
        # prometheus_client's ``name[]`` filter: the engine then formats these few samples rather than every
        # histogram, which matters at ten scrapes a second on a busy host (without the filter: the full text).
        self.url = f"{url}?{urllib.parse.urlencode([('name[]', name) for name in names])}"
        self.names = tuple(names)
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        # Scrapes that failed (the engine busy past the timeout, or gone): gaps in the picture, not errors.
        self.missed = 0
        self.scrape_s: list[float] = []  # how long each scrape took: what sampling costs the engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MetricsSampler:
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._scrape()
            # A fixed pace rather than a fixed pause: a slow scrape does not stretch the interval after it.
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))
        self._scrape()  # the state at the end, so the picture reaches the moment the run was over

    def _scrape(self) -> None:
        at = time.monotonic()
        try:
            with urllib.request.urlopen(self.url, timeout=5.0) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            self.missed += 1
            return
        self.scrape_s.append(time.monotonic() - at)
        self.samples.append((at, {name: metric_sum(text, name) for name in self.names}))

    def summary(self) -> str:
        """One line on how faithful the samples are: count, widest gap, scrape time, misses."""
        times = [at for at, _ in self.samples]
        gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        scrape = sorted(self.scrape_s)[len(self.scrape_s) // 2] if self.scrape_s else 0.0
        return (
            f"{len(times)} samples every {self.interval_s:g} s, widest gap {gap:.2f} s, "
            f"median scrape {1000 * scrape:.0f} ms, {self.missed} missed"
        )
