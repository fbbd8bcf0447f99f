"""MkDocs hook: the alert rules of ``deploy/alerts.yml`` (name, expression, duration, severity, what they say),
rendered at build time into ``docs/operations/alerts.md`` so that the page lists the rules Prometheus loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "alerts.yml"
PAGE = "operations/alerts.md"
MARKER = "<!-- generated: alert rules -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker line {MARKER!r}: nothing would list the alert rules")
    return markdown.replace(MARKER, render())


def rules() -> list[tuple[str, list[dict[str, Any]]]]:
    """(group name, its alerting rules) as deploy/alerts.yml declares them."""
    data = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [(g["name"], [r for r in g.get("rules", []) if "alert" in r]) for g in data.get("groups", [])]


def render() -> str:
    parts = []
    for group, members in rules():
        parts.append(f"### `{group}`\n")
        for rule in members:
            notes = rule.get("annotations", {})
            severity = rule.get("labels", {}).get("severity", "—")
            parts.append(
                f'<span id="{rule["alert"].lower()}"></span>**{rule["alert"]}** '
                f'({severity}, for {rule.get("for", "0s")}): {_text(notes.get("summary", ""))}\n\n'
                f"{_text(notes.get('description', ''))}\n\n"
                f"```promql\n{str(rule['expr']).strip()}\n```\n"
            )
    return "\n".join(parts)


def _text(text: str) -> str:
    """Annotations are plain text with Prometheus templates: shown as written."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*").strip()
