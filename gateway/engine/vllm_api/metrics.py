"""vLLM's ``/metrics`` page read into one typed record, whatever vLLM version family wrote it.

Names differ between families (see tests/fixtures/vllm/): the V0 engine and V1 up to 0.11 publish
``vllm:gpu_cache_usage_perc``, later V1 ``vllm:kv_cache_usage_perc`` (0.10-0.11 publish both); prefix-cache counters
lost their ``gpu_`` prefix the same way; ``vllm:cache_config_info`` names the capacity in ``num_gpu_blocks``
(``None`` before the cache is sized) and, since 0.26, in ``kv_cache_size_tokens`` as well. Counters appear with
Prometheus' ``_total`` suffix; an exporter that drops it is read too. With data parallelism every series comes once
per ``engine`` label: counts are summed over engines, KV usage is the highest engine's (the gateway cannot tell
which engine a request lands on), capacity is one engine's; ``ranks`` keeps each engine's own figures.

Only the lines of the series read here are parsed: measured on the 2-core test machine, the whole 536-line 0.32
page (tests/fixtures/vllm/v1-0.32.0) took prometheus_client's parser 11-15 ms, its 18 relevant lines 0.7-1.4 ms;
the 830-line two-engine page 20 ms against 1.5-2.4 ms. Those lines are in one plain shape, read by
``plain_sample`` as the library reads them, for a sixth of its time (any other line goes to the library): the
whole parse of the 0.32 page 0.90 -> 0.36 ms, of the two-engine page 1.67 -> 0.61 ms. The engine view parses on
the event loop at every scrape (four a second by default; tests: every 50 ms): what the parse takes, every request
in flight waits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

_CACHE_INFO = "vllm:cache_config_info"
_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"

# Each summed field and the names that feed it, the current name first: the first name present wins, so a
# version that publishes both spellings (V1 0.10-0.11) is not counted twice.
_SUMS: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "preemptions_total": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "prompt_tokens_total": ("vllm:prompt_tokens_total", "vllm:prompt_tokens"),
    "generation_tokens_total": ("vllm:generation_tokens_total", "vllm:generation_tokens"),
    "request_success_total": ("vllm:request_success_total", "vllm:request_success"),
    "prefix_cache_queries_total": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits_total": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "admission_rejections_total": ("vllm:admission_rejections_total", "vllm:admission_rejections"),
}
_ADMISSION = _SUMS["admission_rejections_total"]
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_READ = frozenset({*(n for names in _SUMS.values() for n in names), *_KV_USAGE, _CACHE_INFO, _WAITING_BY_REASON})
# Only lines that start with a name read here reach the parser; a longer name sharing that start
# (vllm:num_preemptions_created) is dropped after parsing.
_PREFIXES = tuple(sorted(_READ))


@dataclass(frozen=True)
class RankMetrics:
    """One data-parallel engine's own figures (the series carrying its ``engine`` label)."""

    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions_total: float | None = None
    generation_tokens_total: float | None = None
    num_gpu_blocks: int | None = None


@dataclass(frozen=True)
class EngineMetrics:
    """What the gateway reads from one ``/metrics`` page; ``None`` where the page does not say."""

    # Any of the vLLM series read here: False under ``--disable-log-stats``, or for a page that is not vLLM's.
    has_metrics: bool = False
    kv_usage: float | None = None  # 0..1; unused cached prefix blocks count as free
    running: int | None = None
    waiting: int | None = None
    waiting_by_reason: Mapping[str, int] = field(default_factory=dict)  # 0.33+
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    request_success_total: float | None = None  # every finished_reason together
    prefix_cache_queries_total: float | None = None  # tokens
    prefix_cache_hits_total: float | None = None  # tokens
    admission_rejections_total: float | None = None  # 0.29+, every reason together
    # 0.29+, by reason: max_num_queued_reqs, max_num_queued_tokens (vllm/v1/metrics/loggers.py)
    admission_rejections: Mapping[str, float] = field(default_factory=dict)
    block_size: int | None = None
    # One engine's (on a data-parallel page the engines' sum, as vLLM labels it: ``ranks`` has each engine's);
    # from kv_cache_size_tokens when vLLM gives only that.
    num_gpu_blocks: int | None = None
    kv_cache_size_tokens: int | None = None  # as vLLM states it (0.26+)
    prefix_caching: bool | None = None
    engines: int = 0  # data-parallel engines that published their cache configuration
    ranks: Mapping[str, RankMetrics] = field(default_factory=dict)  # by ``engine`` label, where series carry one

    @property
    def capacity_tokens(self) -> int | None:
        """One engine's KV cache in tokens."""
        if self.kv_cache_size_tokens is not None:
            return self.kv_cache_size_tokens
        if self.num_gpu_blocks is not None and self.block_size is not None:
            return self.num_gpu_blocks * self.block_size
        return None

    @property
    def progress(self) -> tuple[float | None, float | None, float | None]:
        """(running requests, generated tokens, preemptions): what proves a busy engine is not hung."""
        running = None if self.running is None else float(self.running)
        return running, self.generation_tokens_total, self.preemptions_total


def parse_metrics(text: str) -> EngineMetrics:
    """Read vLLM's Prometheus text. Lines that do not parse are skipped, so a partial or garbled page yields
    what it can; NaN and infinite values count as absent."""
    whole = _Series()
    by_rank: dict[str, _Series] = {}
    by_reason: dict[str, float] = {}
    rejections: dict[str, dict[str, float]] = {}  # by name, then reason: the first name present wins, as in _SUMS
    seen = False
    for sample in _samples(line for line in text.splitlines() if line.startswith(_PREFIXES)):
        if sample.name not in _READ:
            continue  # a longer name sharing a prefix: vllm:num_preemptions_created
        seen = True
        if math.isnan(sample.value) or math.isinf(sample.value):
            continue
        if sample.name == _WAITING_BY_REASON:
            reason = sample.labels.get("reason", "")
            by_reason[reason] = by_reason.get(reason, 0.0) + sample.value
            continue
        if sample.name in _ADMISSION:
            by_name = rejections.setdefault(sample.name, {})
            reason = sample.labels.get("reason", "")
            by_name[reason] = by_name.get(reason, 0.0) + sample.value
        whole.add(sample)
        if (rank := sample.labels.get("engine")) is not None:
            by_rank.setdefault(rank, _Series()).add(sample)
    total = whole.totals()
    running, waiting = total["running"], total["waiting"]
    cache = _capacity(whole.caches)
    return EngineMetrics(
        has_metrics=seen,
        kv_usage=whole.kv_usage(),
        running=_count(running),
        waiting=_count(waiting),
        waiting_by_reason={reason: round(v) for reason, v in by_reason.items()},
        preemptions_total=total["preemptions_total"],
        prompt_tokens_total=total["prompt_tokens_total"],
        generation_tokens_total=total["generation_tokens_total"],
        request_success_total=total["request_success_total"],
        prefix_cache_queries_total=total["prefix_cache_queries_total"],
        prefix_cache_hits_total=total["prefix_cache_hits_total"],
        admission_rejections_total=total["admission_rejections_total"],
        admission_rejections=next((rejections[n] for n in _ADMISSION if n in rejections), {}),
        block_size=cache.block_size,
        num_gpu_blocks=cache.num_gpu_blocks,
        kv_cache_size_tokens=cache.kv_cache_size_tokens,
        prefix_caching=cache.prefix_caching,
        engines=len(whole.caches),
        ranks={rank: series.rank(len(by_rank)) for rank, series in sorted(by_rank.items())},
    )


@dataclass(slots=True)
class _Series:
    """The samples read from one page, or from one engine's series of it."""

    sums: dict[str, float] = field(default_factory=dict)
    usage: dict[str, float] = field(default_factory=dict)
    caches: list[Mapping[str, str]] = field(default_factory=list)

    def add(self, sample: Sample) -> None:
        name, value = sample.name, sample.value
        if name == _CACHE_INFO:
            self.caches.append(sample.labels)
        elif name in _KV_USAGE:
            self.usage[name] = max(self.usage.get(name, 0.0), value)
        else:
            self.sums[name] = self.sums.get(name, 0.0) + value

    def totals(self) -> dict[str, float | None]:
        return {key: next((self.sums[n] for n in names if n in self.sums), None) for key, names in _SUMS.items()}

    def kv_usage(self) -> float | None:
        return _fraction(next((self.usage[n] for n in _KV_USAGE if n in self.usage), None))

    def rank(self, ranks: int) -> RankMetrics:
        total = self.totals()
        return RankMetrics(
            kv_usage=self.kv_usage(), running=_count(total["running"]), waiting=_count(total["waiting"]),
            preemptions_total=total["preemptions_total"], generation_tokens_total=total["generation_tokens_total"],
            num_gpu_blocks=_rank_blocks(_capacity(self.caches), ranks),
        )


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def _samples(lines: Iterable[str]) -> Iterator[Sample]:
    """The samples of ``lines``: each line in vLLM's own plain shape read by ``plain_sample``, any other by
    prometheus_client's parser, a line it refuses skipped (a garbled line must not spoil the page)."""
    for line in lines:
        sample = plain_sample(line)
        if sample is not None:
            yield sample
            continue
        try:
            families = list(text_string_to_metric_families(line))
        except ValueError:
            continue
        for family in families:
            yield from family.samples


# A sample line as vLLM writes one: a name, labels whose values hold no quote, backslash or brace, one space, a
# number. prometheus_client's parser reads labels a character at a time: the 18 lines kept from vLLM 0.32's page
# took it 655 us (~36 us a line; the whole parse 0.90 ms), this reading 111 us, measured in a loop on one core.
# Any other line (escapes, a timestamp, a tab, spaces between labels, an exemplar, a repeated label,
# ``__name__``) goes to the library, whose reading this equals on every line it takes
# (tests/unit/engine/test_vllm_metrics.py: every line of the fixtures' pages, and generated lines).
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\{}]*"'
_PLAIN = re.compile(rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})? ([^\s_#]+)")
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\{}]*)"')


def plain_sample(line: str) -> Sample | None:
    """``line`` read as prometheus_client reads it, when it is in vLLM's plain shape; None for any other."""
    match = _PLAIN.fullmatch(line)
    if match is None:
        return None
    name, labels, raw = match.groups()
    pairs = _PAIR.findall(labels) if labels else []
    found = dict(pairs)
    if len(found) != len(pairs) or "__name__" in found:
        return None
    try:
        value: float = int(raw)
    except ValueError:
        try:
            value = float(raw)
        except ValueError:
            return None
    return Sample(name, found, value, None)


def _fraction(value: float | None) -> float | None:
    if value is None:
        return None
    # vLLM reports a fraction; a few exporters scale it to percent.
    value = value / 100.0 if value > 1.0 else value
    return min(1.0, max(0.0, value))


@dataclass(frozen=True)
class _Capacity:
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    kv_cache_size_tokens: int | None = None
    prefix_caching: bool | None = None


def _capacity(caches: list[Mapping[str, str]]) -> _Capacity:
    """Capacity from the first ``vllm:cache_config_info`` that names a block size (data-parallel engines are
    sized alike); nothing from one that does not, since blocks without their size say nothing in tokens."""
    for labels in caches:
        block_size = _positive_int(labels.get("block_size"))
        if block_size is None:
            continue
        tokens = _positive_int(labels.get("kv_cache_size_tokens"))
        blocks = _positive_int(labels.get("num_gpu_blocks"))
        if blocks is None and tokens is not None:
            blocks = tokens // block_size
        prefix = labels.get("enable_prefix_caching")
        return _Capacity(block_size, blocks, tokens, None if prefix is None else prefix.lower() == "true")
    return _Capacity()


def _positive_int(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(float(raw))
    except (ValueError, OverflowError):
        return None  # vLLM writes "None" before the cache is sized
    return value if value > 0 else None


def _rank_blocks(cap: _Capacity, ranks: int) -> int | None:
    """One data-parallel engine's blocks: vLLM's API server labels every engine's ``vllm:cache_config_info`` with
    the sum of their ``num_gpu_blocks`` (vllm/v1/engine/core_client.py: "Sum num_gpu_blocks from all engines in DP
    case"), and with one engine's ``kv_cache_size_tokens``."""
    if cap.kv_cache_size_tokens is not None and cap.block_size is not None:
        return cap.kv_cache_size_tokens // cap.block_size
    return None if cap.num_gpu_blocks is None else cap.num_gpu_blocks // max(1, ranks)
