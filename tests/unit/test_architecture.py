"""The package layout is the architecture: each package imports only the layers below it, only the HTTP layer
knows the web framework, and no module or function grows past what a reader takes in at once."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import ROOT

PACKAGE = ROOT / "gateway"

# Which packages each package may import. "base" is the package's top-level modules (config, errors, metrics,
# redact, jsonio, gpu); "cli" is the command line, which assembles everything.
ALLOWED: dict[str, set[str]] = {
    "base": {"base"},
    "engine": {"base", "engine"},
    "tools": {"base", "engine", "tools"},
    "admission": {"base", "engine", "admission"},
    "managed": {"base", "engine", "managed"},
    "tenants": {"base", "tenants"},
    "observe": {"base", "engine", "admission", "managed", "observe"},
    "guard": {"base", "engine", "admission", "managed", "observe", "tenants", "guard"},
    # The processes of --workers: the authority's side and the workers' (below the HTTP layer, which runs them).
    "workers": {"base", "engine", "admission", "managed", "observe", "tenants", "guard", "workers"},
    "http": {"base", "engine", "admission", "managed", "observe", "tenants", "guard", "workers", "http"},
    "cli": {
        "base", "engine", "admission", "managed", "observe", "tenants", "guard", "workers", "http", "tools", "cli",
    },
}
# Between the top-level packages: the gateway stands alone; what the tests and the benchmarks share lives in
# testing/ (which may import the gateway); the benchmarks never reach into the tests.
NEVER_IMPORTS: dict[str, set[str]] = {
    "gateway": {"testing", "bench", "tests"},
    "testing": {"bench", "tests"},
    "bench": {"tests"},
}
WEB_FRAMEWORKS = ("starlette", "fastapi", "uvicorn")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# Functions that are declarative tables, long by nature: (module, function).
TABLES = {
    ("gateway/metrics.py", "__init__"),  # one declaration per Prometheus collector
}


def modules() -> Iterator[Path]:
    yield from sorted(PACKAGE.rglob("*.py"))


def layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return "cli" if rel.stem == "cli" else "base"
    return rel.parts[0]


def imported(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            yield node.lineno, node.module
            if node.module == "gateway":
                for alias in node.names:
                    yield node.lineno, f"gateway.{alias.name}"


def layer_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "gateway" or len(parts) == 1:
        return None
    target = PACKAGE.joinpath(*parts[1:2])
    if target.is_dir():
        return parts[1]
    return "cli" if parts[1] == "cli" else "base"


def test_every_package_imports_only_the_layers_below_it() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} ({layer_of(path)}) imports {name} ({layer})"
        for path in modules()
        for line, name in imported(path)
        if (layer := layer_of_module(name)) is not None and layer not in ALLOWED[layer_of(path)]
    ]
    assert wrong == []


def test_only_the_http_layer_and_the_command_line_know_the_web_framework() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in modules()
        if layer_of(path) not in ("http", "cli")
        for line, name in imported(path)
        if name.split(".")[0] in WEB_FRAMEWORKS
    ]
    assert wrong == []


@pytest.mark.parametrize("path", list(modules()), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_longer_than_a_reader_takes_in(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


def test_no_function_is_longer_than_sixty_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} has {node.end_lineno - node.lineno + 1} lines"
        for path in modules()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (str(path.relative_to(ROOT)), node.name) not in TABLES
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_layer_table_names_every_package() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(ALLOWED), f"packages without a layer: {sorted(packages - set(ALLOWED))}"


@pytest.mark.parametrize("package", sorted(NEVER_IMPORTS))
def test_each_top_level_package_imports_only_what_it_may(package: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in imported(path)
        if name.split(".")[0] in NEVER_IMPORTS[package]
    ]
    assert wrong == []
