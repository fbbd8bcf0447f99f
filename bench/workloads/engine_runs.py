"""One run of vLLM's own benchmark client against engines that report per engine: the ranks of one
data-parallel server (its ``engine`` label) or several servers. What the client measured, and each engine's
preemptions, finished requests and prefix-cache hits over the run (its counters' deltas)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.harness.scrape import by_label, metric_sum, metrics_page, refusals
from bench.workloads.prefix import vllm_bench

COUNTERS = {"preempted": "vllm:num_preemptions_total", "finished": "vllm:request_success_total",
            "hits": "vllm:prefix_cache_hits_total", "queries": "vllm:prefix_cache_queries_total"}  # fmt: skip


def per_engine(urls: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each counter per engine: per rank of one server, per server (``0``, ``1``...) of several."""
    pages = [metrics_page(u) for u in urls]
    if len(pages) == 1:
        return {key: by_label(pages[0], name, "engine") for key, name in COUNTERS.items()}
    return {key: {str(i): metric_sum(p, name) for i, p in enumerate(pages)} for key, name in COUNTERS.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}


@dataclass
class EngineRun:
    tokens_per_s: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    failed: int
    counts: dict[str, dict[str, float]] = field(default_factory=dict)  # counter -> engine -> delta
    errors: list[str] = field(default_factory=list)  # what the client saw of each failed request
    refused: dict[str, float] = field(default_factory=dict)  # the gateway's refusals by reason

    def hit_rate(self, engine: str | None = None) -> float:
        hits, queries = self.counts.get("hits", {}), self.counts.get("queries", {})
        h = sum(hits.values()) if engine is None else hits.get(engine, 0.0)
        q = sum(queries.values()) if engine is None else queries.get(engine, 0.0)
        return h / q if q else math.nan

    def as_dict(self) -> dict[str, float]:
        out = {"tokens_per_s": self.tokens_per_s, "mean_ttft_ms": self.mean_ttft_ms, "p99_ttft_ms": self.p99_ttft_ms,
               "failed": float(self.failed), "preemptions": sum(self.counts.get("preempted", {}).values()),
               "hit_rate": self.hit_rate()}  # fmt: skip
        for engine in self.counts.get("finished", {}):
            out[f"finished_{engine}"] = self.counts["finished"][engine]
            out[f"preempted_{engine}"] = self.counts.get("preempted", {}).get(engine, 0.0)
            out[f"hit_rate_{engine}"] = self.hit_rate(engine)
        return out


def measure(engine_urls: Sequence[str], base: str, argv: list[str], gated: bool) -> EngineRun:
    """vLLM's benchmark client with ``argv`` against ``base``; the engines' counters around it (the caller waits
    for the engines to be idle before and after)."""
    before = per_engine(engine_urls)
    refused_before = refusals(base) if gated else {}
    result = vllm_bench(argv)
    after = per_engine(engine_urls)
    refused = delta(refusals(base), refused_before) if gated else {}
    return EngineRun(float(result["output_throughput"]), float(result["mean_ttft_ms"]),
                     float(result.get("p99_ttft_ms", math.nan)), int(result.get("failed", 0)),
                     {k: delta(after[k], before[k]) for k in COUNTERS},
                     [e[-300:] for e in result.get("errors", []) if e], {k: v for k, v in refused.items() if v})


def failures(runs: dict[str, list[EngineRun]]) -> str:
    """Each failed request as the client saw it, and the gateway's refusals, by target and run."""
    lines = []
    for target, rs in runs.items():
        for i, r in enumerate(rs, 1):
            lines += [f"- {target}, run {i}: refused by the gateway {r.refused}"] if r.refused else []
            lines += [f"- {target}, run {i}: `{' '.join(error.split())}`" for error in r.errors]
    return "Failed requests:\n\n" + "\n".join(lines) if lines else ""
