"""Every test can fail: a test function asserts something, and never only what it set itself.

Read from the AST of every test module:

- a ``test_*`` function must hold an ``assert``, a ``pytest.raises``/``pytest.warns`` block,
  a ``pytest.fail`` call or a call of a helper named ``assert_*``/``check_*``/``expect_*``
  (or of a local function that does one of these), else it is listed in ALLOWED with why;
- ``assert x == <literal>`` where the test itself bound ``x = <the same literal>`` and nothing
  rebound it proves nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# "path::function": why it holds no assert of its own
ALLOWED: dict[str, str] = {
    "kernels/test_metadata.py::test_buffer_capacity_covers_the_largest_step":
        "from_slots raises when the staging buffer is too small: not raising is the check",
    "stack/test_security.py::test_a_token_or_insecure_no_auth_lets_a_non_loopback_part_start":
        "each starter raises when it refuses to start: starting is the check",
    "worker/engine/test_sampling.py::test_valid_parameters_pass_validation":
        "validate() raises on a bad parameter: not raising is the check",
}
CHECKING_CALLS = ("assert", "check", "expect", "verify")
PYTEST_CHECKS = {"raises", "warns", "fail", "deprecated_call"}


def _modules() -> Iterator[Path]:
    for path in sorted(TESTS.rglob("test_*.py")):
        if "__pycache__" not in path.parts:
            yield path


def _called_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _checks(node: ast.AST, helpers: set[str]) -> bool:
    """Whether ``node``'s body asserts, expects an exception, or calls a checking helper."""
    for child in ast.walk(node):
        if isinstance(child, ast.Assert):
            return True
        if isinstance(child, ast.Call):
            name = _called_name(child)
            if (name in PYTEST_CHECKS and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "pytest"):
                return True
            if name.startswith(CHECKING_CALLS) or name.lstrip("_").startswith(CHECKING_CALLS):
                return True
            if name in helpers:
                return True
    return False


def _checking_helpers(tree: ast.Module) -> set[str]:
    """Module-level functions (not tests) that check, followed through each other."""
    functions = {n.name: n for n in tree.body
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                 and not n.name.startswith("test_")}
    helpers: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, node in functions.items():
            if name not in helpers and _checks(node, helpers):
                helpers.add(name)
                grew = True
    return helpers


def _tests(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
                "test_"):
            yield node


def missing_checks(source: str) -> list[str]:
    tree = ast.parse(source)
    helpers = _checking_helpers(tree)
    return [t.name for t in _tests(tree) if not _checks(t, helpers)]


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _NOT_LITERAL


_NOT_LITERAL = object()


def own_literal_asserts(source: str) -> list[str]:
    """``name: line`` of each ``assert x == L`` (or ``L == x``) where the test bound ``x = L``
    once, to that same literal, and never rebound or changed it otherwise."""
    found = []
    for test in _tests(ast.parse(source)):
        bound: dict[str, list[object]] = {}
        for node in ast.walk(test):
            targets: list[ast.expr] = []
            value: ast.expr | None = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.For | ast.withitem):
                targets = [getattr(node, "target", None) or getattr(node, "optional_vars", None)]
            elif isinstance(node, ast.NamedExpr):
                targets = [node.target]
            for target in targets:
                for name in ast.walk(target) if target is not None else []:
                    if isinstance(name, ast.Name):
                        bound.setdefault(name.id, []).append(
                            _literal(value) if value is not None and isinstance(target, ast.Name)
                            else _NOT_LITERAL)
        mutated = {n.func.value.id for n in ast.walk(test)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                   and isinstance(n.func.value, ast.Name)}  # x.append(...), x.update(...)
        for node in ast.walk(test):
            if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)
                    and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq | ast.Is)):
                continue
            sides = [node.test.left, node.test.comparators[0]]
            for name, other in (sides, sides[::-1]):
                if not isinstance(name, ast.Name) or name.id in mutated:
                    continue
                values = bound.get(name.id, [])
                literal = _literal(other)
                if (len(values) == 1 and values[0] is not _NOT_LITERAL
                        and literal is not _NOT_LITERAL and values[0] == literal):
                    found.append(f"{test.name}: {node.lineno}")
    return found


@pytest.mark.parametrize("module", list(_modules()), ids=lambda p: str(p.relative_to(TESTS)))
def test_every_test_function_checks_something(module: Path) -> None:
    rel = str(module.relative_to(TESTS))
    missing = [name for name in missing_checks(module.read_text())
               if f"{rel}::{name}" not in ALLOWED]
    assert not missing, f"{rel}: tests with no assert (add one, or list them in ALLOWED): {missing}"


@pytest.mark.parametrize("module", list(_modules()), ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_asserts_a_literal_it_set_itself(module: Path) -> None:
    found = own_literal_asserts(module.read_text())
    assert not found, f"{module.relative_to(TESTS)}: asserts of the test's own literal: {found}"


@pytest.mark.parametrize(("source", "missing"), [
    ("def test_a():\n    x = f()\n", ["test_a"]),
    ("def test_a():\n    assert f()\n", []),
    ("import pytest\ndef test_a():\n    with pytest.raises(E):\n        f()\n", []),
    ("def test_a():\n    assert_same(f(), 1)\n", []),
    ("def _run(x):\n    assert x\ndef test_a():\n    _run(f())\n", []),
    ("def _run(x):\n    return x\ndef test_a():\n    _run(f())\n", ["test_a"]),
    ("class TestX:\n    def test_a(self):\n        f()\n", ["test_a"]),
])
def test_a_test_without_a_check_is_found(source: str, missing: list[str]) -> None:
    assert missing_checks(source) == missing


@pytest.mark.parametrize(("source", "found"), [
    ("def test_a():\n    x = 3\n    assert x == 3\n", ["test_a: 3"]),
    ("def test_a():\n    x = 3\n    assert 3 == x\n", ["test_a: 3"]),
    ("def test_a():\n    x = f()\n    assert x == 3\n", []),
    ("def test_a():\n    x = 3\n    x = f(x)\n    assert x == 3\n", []),
    ("def test_a():\n    x = []\n    g(x.append)\n    x.append(1)\n    assert x == []\n", []),
    ("def test_a():\n    x = 3\n    assert y == 3\n", []),
    ("def test_a():\n    x = 3\n    for x in f():\n        pass\n    assert x == 3\n", []),
    ("def test_a():\n    x, y = f()\n    assert x is None\n", []),
])
def test_an_assert_of_the_tests_own_literal_is_found(source: str, found: list[str]) -> None:
    assert own_literal_asserts(source) == found
