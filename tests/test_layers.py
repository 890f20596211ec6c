"""Imports point down: every module of the one import root imports only from its own layer or
below (docs/design.md, "Layers"), function-local imports included."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The one import root: a module's path under the repository is its import name.
ROOT = REPO / "lorastream"
# Lowest first. A module may import its own layer and the layers below.
LAYERS = (
    ("lorastream.core", "lorastream.common", "lorastream.adapter_store", "lorastream.gpu_worker"),
    ("lorastream.kernels",),
    ("lorastream.store", "lorastream.worker"),
    ("lorastream.gateway",),
    ("lorastream.stack",),
    ("lorastream.bench",),
    ("lorastream.cli",),
)
# Inside the worker: the service edge on top, the device layer at the bottom.
WORKER_LAYERS = (
    ("device", "metrics"),
    ("model",),
    ("lora",),
    ("loading",),
    ("engine",),
    ("service",),
)


def _rank(name: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    for rank, members in enumerate(layers):
        if any(name == m or name.startswith(f"{m}.") for m in members):
            return rank
    return None


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = [p for p in path.relative_to(REPO).with_suffix("").parts if p != "__init__"]
        yield ".".join(parts), path


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)


MODULES = dict(_modules())


def _upward(name: str, path: Path) -> list[str]:
    found = []
    mine = _rank(name, LAYERS)
    worker = name.split(".")[2] if name.startswith("lorastream.worker.") else None
    for target, line in _imports(path):
        if not target.startswith("lorastream"):
            continue
        theirs = _rank(target, LAYERS)
        if mine is not None and theirs is not None and theirs > mine:
            found.append(f"{name}:{line} imports {target} (a layer above)")
        if mine == theirs == _rank("lorastream.store", LAYERS) and (
            name.split(".")[1] != target.split(".")[1]
        ):
            found.append(f"{name}:{line} imports {target} (the other service)")
        if worker and target.startswith("lorastream.worker."):
            a = _rank(worker, WORKER_LAYERS)
            b = _rank(target.split(".")[2], WORKER_LAYERS)
            if a is not None and b is not None and b > a:
                found.append(f"{name}:{line} imports {target} (a worker layer above)")
    return found


def test_every_module_is_in_a_layer() -> None:
    assert len(MODULES) > 100
    unplaced = [n for n in MODULES if n != "lorastream" and _rank(n, LAYERS) is None]
    assert unplaced == []


@pytest.mark.parametrize("layer", [members[0] for members in LAYERS])
def test_imports_point_down(layer: str) -> None:
    members = next(m for m in LAYERS if m[0] == layer)
    found = [
        problem
        for name, path in MODULES.items()
        if _rank(name, (members,)) is not None
        for problem in _upward(name, path)
    ]
    assert found == []


@pytest.mark.parametrize(
    ("name", "source", "problem"),
    [
        ("lorastream.core.codec", "from lorastream.worker.engine import engine", "a layer above"),
        ("lorastream.worker.model.x", "def f():\n    import lorastream.gateway.app\n",
         "a layer above"),
        ("lorastream.worker.device.x", "from lorastream.worker.engine.engine import Engine",
         "a worker layer above"),
        ("lorastream.store.x", "from lorastream.worker.model import config", "the other service"),
    ],
)
def test_the_check_finds_an_import_that_points_up(
    tmp_path: Path, name: str, source: str, problem: str
) -> None:
    path = tmp_path / "module.py"
    path.write_text(source)
    (found,) = _upward(name, path)
    assert problem in found


def _runtime_imports(name: str, path: Path) -> set[str]:
    """The modules of the tree ``name`` imports when it runs, function-local imports included;
    ``if TYPE_CHECKING:`` blocks left out (they never run). ``from a.b import c`` counts as
    ``a.b.c`` when that is a module, else as ``a.b``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(inner) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body for inner in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES
                else node.module
                for alias in node.names
            )
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {target for target in found if target in MODULES and target != name}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> the modules it imports): each strongly
    connected group of two or more modules, sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    """No import cycle anywhere in lorastream/, bench and function-local imports included: a
    module can be read, and imported, after the modules it imports."""
    graph = {name: _runtime_imports(name, path) for name, path in MODULES.items()}
    assert sum(len(targets) for targets in graph.values()) > 300
    assert import_cycles(graph) == []


@pytest.mark.parametrize(
    ("graph", "cycles"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_the_check_finds_every_cycle(graph: dict[str, set[str]], cycles: list[list[str]]) -> None:
    assert import_cycles(graph) == cycles


def test_a_function_local_import_counts_and_a_typing_only_one_does_not(tmp_path: Path) -> None:
    path = tmp_path / "module.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lorastream.bench.soak import SoakConfig\n"
        "def f():\n    from lorastream.bench.engine_quant import run_quant_bench\n"
    )
    assert _runtime_imports("lorastream.bench.x", path) == {"lorastream.bench.engine_quant"}
