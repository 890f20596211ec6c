"""``tests/`` mirrors ``lorastream/`` (README, "Layout"): a module's test is found from its path.

Every folder of tests is a package of ``lorastream`` of the same path, or one of the few folders
that are not about one package; only the checks of the whole repository sit at the top; and a
test module under ``tests/worker/<sub>/`` or ``tests/core/`` names the package it mirrors (an
import, or the code it runs in a child process), so a test filed under the wrong subpackage shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# Folders about no one package: shared helpers, the deployment files, and the runs that need
# CUDA (gpu), a fresh venv (fresh) or a Docker engine (compose_live).
NOT_MIRRORED = {"support", "deploy", "gpu", "fresh", "compose_live"}
# The checks of the whole repository.
TOP_LEVEL = {"test_layers.py", "test_packaging.py", "test_protos.py", "test_runtime_imports.py",
             "test_layout_mirror.py", "test_lint_markers.py", "test_docstring_figures.py",
             "test_test_asserts.py"}
# Where a test module must name the package it mirrors.
NAMED = {("worker",), ("core",)}


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _folder(module: Path) -> tuple[str, ...]:
    return module.parent.relative_to(TESTS).parts


def test_the_top_of_tests_holds_only_the_whole_repository_checks() -> None:
    top = {p.name for p in _test_modules() if not _folder(p)}
    assert top <= TOP_LEVEL, f"move into the folder of the package each tests: {top - TOP_LEVEL}"


def test_every_test_folder_is_a_package_of_the_same_path() -> None:
    wrong = sorted(
        "/".join(folder) for folder in {_folder(p) for p in _test_modules()}
        if folder and folder[0] not in NOT_MIRRORED
        and not (REPO / "lorastream" / Path(*folder) / "__init__.py").is_file()
    )
    assert not wrong, f"tests/<path> with no lorastream/<path> package: {wrong}"


def test_no_test_module_sits_in_tests_worker_itself() -> None:
    loose = [p.name for p in _test_modules() if _folder(p) == ("worker",)]
    assert not loose, f"move into tests/worker/<subpackage>/: {loose}"


@pytest.mark.parametrize("module", [p for p in _test_modules() if _folder(p)[:1] in NAMED],
                         ids=lambda p: str(p.relative_to(TESTS)))
def test_a_mirrored_test_names_its_package(module: Path) -> None:
    package = "lorastream." + ".".join(_folder(module))
    assert package in module.read_text(), f"{module.name} never names {package}: misfiled?"
