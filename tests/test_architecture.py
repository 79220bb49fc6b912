"""The layout is the architecture: checks that ``lint-imports`` (the layers in pyproject.toml)
does not make.

- no import cycle crosses a folder: modules of one cycle all live in one package;
- package code imports another package's private module (``_name``) never: it goes through that
  package's public ``__init__``; the serving application counts as its own package, apart from
  the runtime it is built on;
- the runtime contract names every module of the actor runtime.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "supervisors", "protocols", "scenarios")
APPLICATION = "actors.serving"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    built = grimp.build_graph(*PACKAGES, cache_dir=None)
    assert APPLICATION in built.modules  # the packages, not the test folders of the same names
    return built


def test_the_cycle_finder_finds_cycles() -> None:
    class Graph:
        modules = {"a", "b", "c", "d"}

        def find_modules_directly_imported_by(self, module: str) -> set[str]:
            return {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}[module]

    assert _cycles(Graph()) == [{"a", "b", "c"}]  # type: ignore[arg-type]


def _package(module: str, graph: grimp.ImportGraph) -> str:
    """The folder a module lives in: a package is its own folder."""
    return module if graph.find_children(module) else module.rpartition(".")[0]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles(graph: grimp.ImportGraph) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def test_no_import_cycle_crosses_a_folder(graph: grimp.ImportGraph) -> None:
    crossing = [
        sorted(cycle) for cycle in _cycles(graph) if len({_package(m, graph) for m in cycle}) > 1
    ]
    assert crossing == []


def _owner_of_private(module: str) -> str | None:
    """The package whose private module ``module`` is, or None for a public module."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def test_no_package_imports_another_packages_private_module(graph: grimp.ImportGraph) -> None:
    offending = []
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            owner = _owner_of_private(imported)
            if owner is None:
                continue
            inside = _within(importer, owner)
            # The serving application reaches the runtime through its public modules only.
            if _within(importer, APPLICATION) and not _within(imported, APPLICATION):
                inside = False
            if not inside:
                offending.append(f"{importer} -> {imported}")
    assert offending == []


def test_the_runtime_contract_names_every_runtime_module(graph: grimp.ImportGraph) -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}
    listed = set(contracts["runtime"]["source_modules"])
    runtime = {m for m in graph.find_children("actors") if m != APPLICATION}
    assert listed == runtime
