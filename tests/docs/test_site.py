"""The documentation site builds from docs/ with `mkdocs build --strict`: a broken link, a missing page, an unknown
anchor or a page left out of the navigation fails the build; the pages it builds fetch nothing from elsewhere, the
generated reference pages list everything the code has, and the README's links land on files and anchors that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from gateway.cli import _field_flag
from gateway.config import ENV_PREFIX, Settings
from tests.docs.hooks import load_hook
from tests.support.paths import ROOT

BUILD_TIMEOUT_S = 180  # ~3 s on two idle cores; generous for a loaded machine
# Elements whose attribute makes a browser fetch something when the page is shown.
FETCHING = {
    "link": ("href",), "script": ("src",), "img": ("src", "srcset"), "iframe": ("src",), "source": ("src", "srcset"),
    "video": ("src", "poster"), "audio": ("src",), "embed": ("src",), "object": ("data",), "track": ("src",),
}
# A URL with a network scheme, or scheme-relative; data: URLs are inline and fetch nothing.
ELSEWHERE = re.compile(r"^\s*(?:(?:https?|ftp|wss?):|//)", re.IGNORECASE)
CSS_URL = re.compile(r"""(?:url\(\s*["']?|@import\s+["'])([^"')\s]+)""", re.IGNORECASE)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    return out


class _Fetches(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.mermaid = False
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for attr in FETCHING.get(tag, ()):
            for url in (values.get(attr) or "").split(","):
                if ELSEWHERE.match(url):
                    self.found.append(f"<{tag} {attr}={url.strip()!r}>")
        self.found += [f"<{tag} style> {u}" for u in CSS_URL.findall(values.get("style") or "") if ELSEWHERE.match(u)]
        # The theme loads Mermaid from a CDN as soon as a page holds a diagram it would draw.
        self.mermaid |= "mermaid" in (values.get("class") or "").split()
        self._in_style = tag == "style"

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.found += [f"<style> {u}" for u in CSS_URL.findall(data) if ELSEWHERE.match(u)]

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False


def pages(site: Path) -> list[Path]:
    return sorted(site.rglob("*.html"))


def test_the_site_builds_strictly_with_every_page_in_the_navigation(site: Path) -> None:
    nav_pages = _nav_files(yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_IgnoreTags))
    docs = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert docs == nav_pages, f"in docs/ but not in the nav: {sorted(docs - nav_pages)}; " \
        f"in the nav but not in docs/: {sorted(nav_pages - docs)}"
    assert (site / "index.html").is_file()
    assert not (site / "hooks").exists(), "the build hooks were published as pages' files"


def test_no_page_fetches_anything_from_elsewhere(site: Path) -> None:
    offending = []
    for page in pages(site):
        parser = _Fetches()
        parser.feed(page.read_text(encoding="utf-8"))
        offending += [f"{page.relative_to(site)}: {what}" for what in parser.found]
        if parser.mermaid:
            offending.append(f"{page.relative_to(site)}: a Mermaid diagram (the theme would fetch Mermaid from a CDN)")
    for css in site.rglob("*.css"):
        offending += [f"{css.relative_to(site)}: {u}" for u in CSS_URL.findall(css.read_text()) if ELSEWHERE.match(u)]
    assert not offending, "\n".join(offending)


def test_the_configuration_page_lists_every_flag_with_its_variable_and_key(site: Path) -> None:
    text = (site / "reference" / "configuration.html").read_text(encoding="utf-8")
    for name in Settings.model_fields:
        assert f"{ENV_PREFIX}{name.upper()}" in text, f"{ENV_PREFIX}{name.upper()} is missing"
        assert f"<code>{name}</code>" in text, f"config key {name} is missing"
        if name != "vllm_args":
            assert f"<code>{_field_flag(name)}</code>" in text, f"{_field_flag(name)} is missing"
    for command, _, parser in load_hook("config_reference").subcommands():
        assert f"vllm-guard {command}" in text
        for action in load_hook("config_reference").options(parser):
            assert f"<code>{action.option_strings[-1]}</code>" in text, f"{command} {action.option_strings[-1]}"


def test_the_metrics_page_lists_every_collector(site: Path) -> None:
    text = (site / "reference" / "metrics.html").read_text(encoding="utf-8")
    hook = load_hook("metrics_reference")
    names = [hook.exposed_name(c) for c in hook.collectors()]
    assert len(names) > 40
    assert [n for n in names if f"<code>{n}</code>" not in text] == []


def test_the_alerts_page_lists_every_rule(site: Path) -> None:
    text = (site / "operations" / "alerts.html").read_text(encoding="utf-8")
    rules = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text(encoding="utf-8"))
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert alerts and [a for a in alerts if f"<strong>{a}</strong>" not in text] == []


README_LINK = re.compile(r"\]\((?!https?:)([^)#\s]+)(?:#([^)\s]+))?\)")


def test_the_readme_links_only_to_files_that_exist_and_to_anchors_the_site_has(site: Path) -> None:
    links = README_LINK.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    assert links, "the README links to nothing"
    broken = [f"{path}: no such file" for path, _ in links if not (ROOT / path).exists()]
    for path, anchor in links:
        if anchor and path.startswith("docs/") and path.endswith(".md") and (ROOT / path).exists():
            page = site / path.removeprefix("docs/").replace(".md", ".html")
            if f'id="{anchor}"' not in page.read_text(encoding="utf-8"):
                broken.append(f"{path}#{anchor}: no such anchor")
    assert not broken, "\n".join(broken)


class _IgnoreTags(yaml.SafeLoader):
    """mkdocs.yml's !!python/... tags name code to run; reading the nav needs none of it."""


_IgnoreTags.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def _nav_files(config: dict[str, object]) -> set[str]:
    found: set[str] = set()

    def walk(item: object) -> None:
        if isinstance(item, str):
            found.add(item)
        elif isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)

    walk(config["nav"])
    return found
