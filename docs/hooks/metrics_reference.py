"""MkDocs hook: the list of the gateway's Prometheus metrics, rendered at build time from the collectors that
``gateway.metrics.Metrics`` declares (name as scraped, type, labels, help text), so that
``docs/reference/metrics.md`` cannot drift from what ``GET /metrics`` serves.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The site describes the tree it is built from, not whichever copy of the package is installed.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prometheus_client.metrics import MetricWrapperBase  # noqa: E402

from gateway.metrics import Metrics  # noqa: E402

PAGE = "reference/metrics.md"
MARKER = "<!-- generated: metrics reference -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker line {MARKER!r}: nothing would list the metrics")
    return markdown.replace(MARKER, render())


def collectors() -> list[MetricWrapperBase]:
    """Every collector one ``Metrics`` object declares, by the name it is scraped under."""
    found = [v for v in vars(Metrics()).values() if isinstance(v, MetricWrapperBase)]
    return sorted(found, key=exposed_name)


def exposed_name(c: MetricWrapperBase) -> str:
    """The name as scraped: counters carry ``_total``, which prometheus_client keeps out of ``_name``."""
    return c._name + "_total" if c._type == "counter" else c._name


def render() -> str:
    rows = ["| metric | type | labels | what it measures |", "| --- | --- | --- | --- |"]
    for c in collectors():
        name = exposed_name(c)
        labels = ", ".join(f"`{label}`" for label in c._labelnames) or "—"
        rows.append(f'| <span id="{name}"></span>`{name}` | {c._type} | {labels} | {_cell(c._documentation)} |')
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    """Help texts are plain text: what Markdown or HTML would read as markup is shown as written."""
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
            .replace("|", "\\|").replace("\n", " "))
