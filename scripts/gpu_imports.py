"""Import every module that tests/gpu and the GPU benchmarks can reach, and say which failed.

The modules are found statically, from the sources: the import statements of the roots below, at
any depth (imports inside functions too, which a plain import of the roots would not run), and
of every lorastream or tests module they name, transitively. A module the GPU path reaches only
on CUDA is imported here all the same, so a package missing from the GPU machine's image and
from the carried wheelhouse shows on a CPU machine, before any GPU time is spent.

    python scripts/gpu_imports.py            # import them all; exit 1 if any fails
    python scripts/gpu_imports.py --list     # print the modules and the third-party packages
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERNAL = ("lorastream", "tests")
# The GPU benchmarks' entry points (gpu_check.sh runs them) besides every module under tests/gpu.
BENCH_ROOTS = ("lorastream.kernels.bench", "lorastream.bench.h2d", "lorastream.bench.gpu_serving")


def roots() -> list[str]:
    tests = sorted(p.with_suffix("").relative_to(ROOT).as_posix().replace("/", ".")
                   for p in (ROOT / "tests" / "gpu").glob("*.py"))
    return [*tests, *BENCH_ROOTS]


def _path_of(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported_names(path: Path, module: str) -> list[str]:
    """Every module name an import statement in ``path`` may mean (``from a import b`` gives
    ``a`` and ``a.b``: b may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def closure(start: list[str]) -> tuple[list[str], dict[str, set[str]]]:
    """(the lorastream/tests modules reachable from ``start``, third-party top-level package ->
    the modules that import it); the standard library is left out."""
    internal: dict[str, Path] = {}
    external: dict[str, set[str]] = {}
    pending = list(start)
    while pending:
        name = pending.pop()
        if name in internal:
            continue
        path = _path_of(name)
        if path is None:
            continue  # a name imported from a module (``from a import function``)
        internal[name] = path
        parts = name.split(".")
        pending += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages
        for imported in _imported_names(path, name):
            top = imported.split(".")[0]
            if top in INTERNAL:
                pending.append(imported)
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                external.setdefault(top, set()).add(name)
    return sorted(internal), external


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list, import nothing")
    args = parser.parse_args(argv)
    modules, external = closure(roots())
    if args.list:
        print("\n".join(modules))
        for top, users in sorted(external.items()):
            print(f"third-party {top}: {', '.join(sorted(users))}")
        return 0
    sys.path.insert(0, str(ROOT))
    failed: dict[str, str] = {}
    for name in [*sorted(external), *modules]:
        try:
            importlib.import_module(name)
        except Exception:
            failed[name] = traceback.format_exc(limit=-1).strip().splitlines()[-1]
    for name, error in failed.items():
        print(f"FAILED import {name}: {error}")
    print(f"gpu imports: {len(external)} third-party packages and {len(modules)} modules, "
          f"{len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
