"""aserve's shape, read from the source. Imports (ast): no cycles, between modules or between subpackages; packages
import in one direction (kernels, spec <- layers <- models <- core, distributed <- worker <- engine <- entrypoints <-
the offline quantiser); the basic modules (config, fixed_engine_args, envs, sampling_params, outputs) and everything
below the front ends import nothing above them, aserve.LLM included; the per-call functions of layers and models
import nothing (imports at module top). Files stay under 500 lines, and the only top-level packages installed are
aserve and loadgen."""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

import pytest
from setuptools import find_packages

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "aserve")
RANKS = {"aserve.kernels": 0, "aserve.spec": 0, "aserve.layers": 1, "aserve.models": 2, "aserve.core": 3,
         "aserve.distributed": 3, "aserve.worker": 4, "aserve.engine": 5, "aserve.entrypoints": 6,
         "aserve.quantize": 7, "aserve.cli": 8}  # fmt: skip
MAX_LINES = 500
BASE = {"aserve.config", "aserve.fixed_engine_args", "aserve.envs", "aserve.sampling_params", "aserve.outputs"}
PER_CALL = ("forward", "__call__", "apply", "attend", "rotate_and_write", "fuses_")


def module_files() -> dict[str, str]:
    files = {}
    for dirpath, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                module = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
                files[module.removesuffix(".__init__")] = path
    return files


MODULES = module_files()


def _resolve(name: str) -> str:
    """An imported name -> the aserve module that defines it (the longest module prefix)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(module: str, path: str) -> list[tuple[str, ast.AST]]:
    """(imported aserve module, the import statement) for every import in the file, at any depth."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    tree = ast.parse(open(path).read())
    # `if TYPE_CHECKING:` imports are for annotations only: no run-time dependency
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block) for n in ast.walk(block)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(_resolve(a.name), node) for a in node.names if a.name.split(".")[0] == "aserve"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + [base] if base else parts)
            if base.split(".")[0] != "aserve":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in MODULES else _resolve(base), node))
    return found


GRAPH = {m: {target for target, _ in _imports(m, p) if target != m} for m, p in MODULES.items()}


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_between_modules():
    assert _cycles(GRAPH) == []


def test_no_import_cycles_between_subpackages():
    packages = defaultdict(set)
    for module, targets in GRAPH.items():
        packages[_package(module)] |= {_package(t) for t in targets if _package(t) != _package(module)}
    assert _cycles(packages) == []


def test_packages_import_downwards_only():
    wrong = []
    for module, targets in GRAPH.items():
        rank = RANKS.get(_package(module))
        for target in targets:
            if module in BASE and target not in BASE:
                wrong.append(f"{module} -> {target} (basic modules import only each other)")
            elif rank is not None and RANKS.get(_package(target), -1) > rank:
                wrong.append(f"{module} -> {target} (upwards)")
            elif rank is not None and rank < RANKS["aserve.quantize"] and target == "aserve":
                wrong.append(f"{module} -> aserve (the package's front: LLM, AsyncEngine)")
    assert wrong == []


def test_layers_and_models_import_nothing_per_call():
    wrong = []
    for module, path in MODULES.items():
        if _package(module) not in ("aserve.layers", "aserve.models"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(PER_CALL):
                inner = [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)]
                wrong += [f"{module}.{node.name} line {n.lineno}" for n in inner]
    assert wrong == []


def test_the_checks_see_the_tree():
    assert {"aserve.layers.linear", "aserve.models.llama", "aserve.engine.llm_engine"} <= set(MODULES)
    assert "aserve.layers.linear" in GRAPH["aserve.models.llama"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_files_stay_under_the_line_limit():
    long = {}
    for path in MODULES.values():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[os.path.relpath(path, os.path.dirname(ROOT))] = n
    assert long == {}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_only_aserve_and_loadgen_are_installed_packages():
    import tomllib

    repo = os.path.dirname(ROOT)
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {name.split(".")[0] for name in find_packages(repo, include=include)} == {"aserve", "loadgen"}
    assert not os.path.exists(os.path.join(repo, "kernels"))
