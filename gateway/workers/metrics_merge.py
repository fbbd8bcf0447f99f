"""``/metrics`` for every process at once: each worker's samples added to the authority's.

Each process keeps its own ``Metrics`` (its registry): the request path counts in the process that served the
request. When ``/metrics`` is read the authority asks every worker for its samples (``families_of``, sent as
JSON) and adds them to its own, sample by sample: counters, histograms' buckets, sums and counts, and the gauges
that count something (requests in flight) add up across processes. A few gauges say a state every process
knows alike (whether counting fell back to the engine's tokenizer): those take the largest value, not the sum.
Per-worker series carry no label of their own: the whole is reported, as one process would report it.

A counter must never read lower than it was once scraped, or Prometheus takes it for a reset (``rate()`` spikes,
alerts fire). So the authority keeps each worker's newest families (``WorkerCounts``: every reply to a scrape,
and a snapshot it asks for every ``SNAPSHOT_EVERY`` seconds), and when a worker dies folds its counters and
histograms into a retired total that every later exposition adds; its gauges go with it. A restarted worker
counts from zero on top. What a worker counted after its last snapshot is lost with it (a second at most), but
never what was scraped. A worker that misses a scrape's deadline is reported at its newest snapshot.

Why not prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``: every value in a shared mmap file,
the dead processes' files kept)? Measured with ``python -m timeit`` (prometheus_client 0.26, CPython 3.11), a
counter's ``inc()`` costs 0.67 us there against 0.29 us, a histogram's ``observe()`` 1.51 us against 0.69 us:
about 8 us more per request, which records a dozen values. And it is a mode of the whole process: every
``Metrics`` in a process shares one value per name (a second app started from the first's counts: the tests run
several gateways in one process), and ``clear()`` of a labelled gauge is not implemented in it (the engines' and
the queue's gauges would keep series that are gone).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gateway.guard.parts import Parts
from gateway.metrics import Metrics

# Gauges every process sets alike: merged by their largest value, not summed.
SAME_IN_EVERY_PROCESS = frozenset({"vllm_guard_tokenizer_fallback"})
# The gauges a worker sets itself, which add to the authority's; the others (the engines' state, the KV books) only
# the authority sets.
WORKER_GAUGES = frozenset({"vllm_guard_in_flight_requests", "vllm_guard_tokenizer_fallback"})
# What a dead worker's families leave in the total: what counts up. A gauge says how things are now: it goes.
KEPT_TYPES = frozenset({"counter", "histogram", "summary"})
# Seconds between the snapshots the authority asks of each worker besides the scrapes: what a worker killed
# outright counted since is lost. A snapshot costs the worker ~1.2 ms (its registry as ~16 KB of JSON).
SNAPSHOT_EVERY = 1.0

Family = list[Any]  # [name, type, documentation, unit, [[sample name, labels, value], ...]]
_Key = tuple[str, tuple[tuple[str, str], ...]]  # a sample: its name and sorted labels


def families_of(parts: Parts) -> list[Family]:
    """This process's samples: the request path's counters and histograms, and its in-flight gauge."""
    out: list[Family] = []
    for metric in parts.metrics.registry.collect():
        if metric.type == "gauge" and metric.name not in WORKER_GAUGES:
            continue  # the authority's view of the engines and the books: the workers hold none of it
        samples = [[s.name, dict(s.labels), s.value] for s in metric.samples]
        out.append([metric.name, metric.type, metric.documentation, metric.unit, samples])
    return out


class WorkerCounts:
    """The workers' counts as the authority last saw them: each live worker's newest families, and the counters
    and histograms of the workers gone (``retired``)."""

    def __init__(self) -> None:
        self._newest: dict[object, list[Family]] = {}
        self._retired: dict[str, tuple[str, str, str, dict[_Key, float]]] = {}  # name -> type, doc, unit, samples

    def seen(self, worker: object, families: list[Family]) -> None:
        """``worker``'s families as it just sent them (its channel's messages come in order: the newest)."""
        self._newest[worker] = families

    def lost(self, worker: object) -> None:
        """``worker`` is gone: its counters and histograms stay in the total, its gauges go."""
        for name, kind, doc, unit, samples in self._newest.pop(worker, ()):
            if kind not in KEPT_TYPES:
                continue
            into = self._retired.setdefault(name, (kind, doc, unit, {}))[3]
            for sample_name, labels, value in samples:
                key = (sample_name, tuple(sorted(labels.items())))
                if sample_name.endswith("_created"):  # when the series began: the earliest
                    into[key] = min(into.get(key, value), value)
                else:
                    into[key] = into.get(key, 0.0) + value

    def families(self) -> list[list[Family]]:
        """What to add to the authority's own: each live worker's newest families, and the retired ones."""
        out = list(self._newest.values())
        if self._retired:
            out.append([
                [name, kind, doc, unit, [[s, dict(labels), v] for (s, labels), v in samples.items()]]
                for name, (kind, doc, unit, samples) in self._retired.items()
            ])
        return out


class Merged(Collector):
    """The authority's registry with the workers' samples added: a collector for one exposition."""

    def __init__(self, own: Iterable[Metric], workers: list[list[Family]]) -> None:
        self._own = list(own)
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        extra: dict[str, dict[_Key, float]] = {}
        for families in self._workers:
            for name, _kind, _doc, _unit, samples in families:
                into = extra.setdefault(name, {})
                for sample_name, labels, value in samples:
                    key = (sample_name, tuple(sorted(labels.items())))
                    if name in SAME_IN_EVERY_PROCESS:
                        into[key] = max(into.get(key, value), value)
                    elif sample_name.endswith("_created"):  # when the series began: the earliest
                        into[key] = min(into.get(key, value), value)
                    else:
                        into[key] = into.get(key, 0.0) + value
        for metric in self._own:
            adds = extra.pop(metric.name, None)
            if adds:
                metric = _with(metric, adds, same=metric.name in SAME_IN_EVERY_PROCESS)
            yield metric

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _with(metric: Metric, adds: dict[_Key, float], *, same: bool) -> Metric:
    merged = Metric(metric.name, metric.documentation, metric.type, metric.unit)
    seen = set()
    for s in metric.samples:
        key = (s.name, tuple(sorted(s.labels.items())))
        seen.add(key)
        add = adds.get(key)
        if add is None:
            value = s.value
        elif s.name.endswith("_created"):
            value = min(s.value, add)
        else:
            value = max(s.value, add) if same else s.value + add
        merged.add_sample(s.name, s.labels, value, s.timestamp, s.exemplar)
    for (name, labels), value in adds.items():
        if (name, labels) not in seen:
            merged.add_sample(name, dict(labels), value)
    return merged


def render_merged(metrics: Metrics, workers: list[list[Family]]) -> tuple[bytes, str]:
    """The exposition of ``metrics`` with every worker's samples added."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged(metrics.registry.collect(), workers))
    return generate_latest(registry), CONTENT_TYPE_LATEST
