"""Every repository path the docs name exists: README.md and docs/**/*.md cite files and folders of the checkout in
backticks (`gateway/admission/queue.py`, in running text or in a code block) and in relative links, and a file
renamed or deleted leaves such a citation behind unless this fails. A name with a placeholder
(`tests/unit/<package>/`) or a glob (`gateway/config_*.py`) names no one path and is skipped, as are a test's node id
and a line number after the file (`tests/x.py::test_y`, `gateway/x.py:12`), which are cut off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]

# What a repository path starts with: the top-level folders, and the top-level files a page may cite.
TOP = (
    "gateway/", "bench/", "tests/", "testing/", "scripts/", "docs/", "deploy/", ".ci/",
    "pyproject.toml", "mkdocs.yml", "Dockerfile", "docker-compose.yml", ".env.example",
)
CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)  # a fence's body is one span: its ``` pair delimits it
LINK = re.compile(r"\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# A name standing for many paths, or for one the reader fills in: not a path of the checkout.
PLACEHOLDER = re.compile(r"[<>*?{}\[\]$]|\.\.\.|COMMIT")
# Where the path ends: a test's node id, an anchor, a line number.
SUFFIX = re.compile(r"::.*|#.*|:\d.*")


def named_paths(text: str) -> list[str]:
    """The repository paths a page's backticks name, in order, without their node ids, anchors or line numbers."""
    found = []
    for match in CODE.finditer(text):
        for word in match.group(2).split():
            word = word.strip("'\"(),;").removeprefix("./")
            if not word.startswith(TOP) or PLACEHOLDER.search(word):
                continue
            path = SUFFIX.sub("", word).rstrip(".,;:)")
            if path:
                found.append(path)
    return found


def linked_paths(text: str) -> list[str]:
    """The targets of a page's relative links (another page, an image, a file), without their anchors."""
    targets = (m.group(1).split("#", 1)[0] for m in LINK.finditer(text))
    return [t for t in targets if t and not SCHEME.match(t) and not t.startswith("/")]


@pytest.mark.parametrize(
    ("text", "paths"),
    [
        ("the queue (`gateway/admission/queue.py`) orders", ["gateway/admission/queue.py"]),
        ("`python -m bench run realistic` then `bench/results/realistic/`", ["bench/results/realistic/"]),
        ("```\n./scripts/test.sh -m 'not e2e'\n.venv/bin/mkdocs build\n```", ["scripts/test.sh"]),
        ("`tests/integration/test_x.py::test_a_client_that_waits`", ["tests/integration/test_x.py"]),
        ("`gateway/cli.py:24`, `docs/index.md#where-to-go`", ["gateway/cli.py", "docs/index.md"]),
        ("`tests/unit/<package>/` and `bench/results/<benchmark>/`", []),
        ("`gateway/config_*.py`, `testing/vllm_sim/{app,wire}.py`", []),
        ("`git worktree add --detach /tmp/gw-main COMMIT`", []),
        ("`policy.py` beside `queue.py`", []),
    ],
    ids=["a file in running text", "a folder among words", "a command in a code block", "a test's node id",
         "a line number and an anchor", "placeholders", "globs", "no repository path", "a name inside a package"],
)
def test_a_repository_path_is_told_from_other_words_in_backticks(text: str, paths: list[str]) -> None:
    assert named_paths(text) == paths


@pytest.mark.parametrize(
    ("text", "paths"),
    [
        ("[admission](concepts/admission.md#the-queue)", ["concepts/admission.md"]),
        ("![TTFT](../img/realistic-double.png)", ["../img/realistic-double.png"]),
        ("[vLLM](https://github.com/vllm-project/vllm), [above](#the-queue), [mail](mailto:a@b)", []),
    ],
    ids=["a page with an anchor", "an image one folder up", "addresses and anchors of the same page"],
)
def test_a_relative_link_is_told_from_addresses_and_anchors(text: str, paths: list[str]) -> None:
    assert linked_paths(text) == paths


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", DOCS, ids=_name)
def test_every_repository_path_a_page_names_in_backticks_exists(page: Path) -> None:
    missing = sorted({p for p in named_paths(page.read_text(encoding="utf-8")) if not (ROOT / p).exists()})
    assert missing == [], f"{_name(page)} names paths the checkout does not have: {', '.join(missing)}"


@pytest.mark.parametrize("page", DOCS, ids=_name)
def test_every_relative_link_of_a_page_lands_on_a_file_that_exists(page: Path) -> None:
    links = linked_paths(page.read_text(encoding="utf-8"))
    missing = sorted({t for t in links if not (page.parent / t).exists()})
    assert missing == [], f"{_name(page)} links to files the checkout does not have: {', '.join(missing)}"


def test_the_pages_are_found() -> None:
    assert ROOT / "README.md" in DOCS and ROOT / "docs" / "index.md" in DOCS and len(DOCS) > 40
