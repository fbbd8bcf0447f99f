"""The benchmark package's imports run one way: servers, then the harness, targets, workloads, benchmarks, and the
command line last; no module imports one that (directly or not) imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

BENCH = ROOT / "bench"
# Each layer may import itself and the layers before it.
LAYERS = ["servers", "harness", "targets", "workloads", "benchmarks", "top"]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def bench_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(BENCH.rglob("*.py")) if "results" not in p.parts}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The bench modules a module imports at run time (``if TYPE_CHECKING:`` blocks are not run)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for child in node.body for n in ast.walk(child)}  # fmt: skip
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        found |= {n for n in names if n in known}
    return found


def graph() -> dict[str, set[str]]:
    modules = bench_modules()
    known = set(modules)
    return {name: imports_of(path, known) - {name} for name, path in modules.items()}


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "top"


def cycle_in(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as the modules along it, or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_circle_of_three_and_none_in_a_line() -> None:
    circle = {"engines": {"engine_faults"}, "engine_faults": {"engine_servers"}, "engine_servers": {"engines"}}
    assert cycle_in(circle) == ["engine_faults", "engine_servers", "engines", "engine_faults"]
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_bench_module_imports_itself_back_through_others() -> None:
    assert cycle_in(graph()) == []


def test_each_layer_imports_only_itself_and_the_layers_before_it() -> None:
    wrong = [f"{name} ({layer(name)}) imports {dep} ({layer(dep)})"
             for name, deps in graph().items() for dep in deps
             if LAYERS.index(layer(dep)) > LAYERS.index(layer(name))]  # fmt: skip
    assert wrong == []


def test_the_servers_import_nothing_of_the_harness() -> None:
    wrong = {name: deps for name, deps in graph().items() if layer(name) == "servers" and deps}
    assert wrong == {}


def test_no_bench_module_or_function_is_longer_than_the_gateways_may_be() -> None:
    long = []
    for name, path in bench_modules().items():
        source = path.read_text()
        if len(source.splitlines()) > 400:
            long.append(f"{name}: {len(source.splitlines())} lines")
        long += [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
                 for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None
                 and node.end_lineno - node.lineno + 1 > 60]  # fmt: skip
    assert long == []
