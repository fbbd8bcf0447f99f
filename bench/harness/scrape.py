"""Reading a server's state: its Prometheus page (summed over label sets, per engine, a histogram's sum and
count), the gateway's refusals by reason, a JSON route."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def get_json(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def metrics_page(url: str, timeout: float = 10.0) -> str:
    """The ``/metrics`` page of the server at base URL ``url``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        return str(resp.read().decode())


def metric_sum(page: str, name: str) -> float:
    """One sample name's values summed over its label sets (0 when absent)."""
    total = 0.0
    for line in page.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        rest = line[len(name) :]
        if rest.startswith("{"):
            rest = rest[rest.rindex("}") + 1 :]
        total += float(rest.split()[0])
    return total


def scrape(url: str, name: str) -> float:
    """A sample summed over its label sets, read now from the server at ``url``."""
    return metric_sum(metrics_page(url), name)


def by_label(page: str, name: str, label: str, default: str = "0") -> dict[str, float]:
    """A sample summed per value of one label (vLLM's ``engine`` rank, the gateway's ``reason``)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, default)
                out[key] = out.get(key, 0.0) + sample.value
    return out


def refusals(url: str) -> dict[str, float]:
    """The gateway's refusals so far by reason (``vllm_guard_rejections_total``)."""
    return by_label(metrics_page(url), "vllm_guard_rejections_total", "reason", "")
