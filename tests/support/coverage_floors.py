"""Branch coverage per package, and the floors ``make test`` holds each package to.

A pytest plugin (``tests/conftest.py`` loads it). With ``--coverage-floors``, after pytest-cov
has saved the run's data (``--cov``, the ``[tool.coverage.*]`` settings of pyproject.toml), it
prints one row per package -- statements, branches, and the share of both covered, as
``coverage report`` counts them -- and fails the session when a package sits under its floor in
``[tool.lorastream.coverage-floors]``. The table comes before pytest's closing line.

Packages are ``lorastream``'s subpackages, and the worker's one level deeper
(``lorastream.worker.loading``): the rooms a change is made in. Code that runs only in child
processes (a worker started by ``lorastream up``, the fetch process) is not measured here, so a
package's figure is a floor on what the suite covers, not the whole of it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SESSION = pytest.StashKey[pytest.Session]()
DEEPER = ("lorastream", "worker")  # packages named one level below this one


@dataclass
class Counts:
    statements: int = 0
    missed: int = 0
    branches: int = 0
    missed_branches: int = 0  # branch destinations never taken

    @property
    def percent(self) -> float:
        """Covered statements and branches over all of them (coverage.py's own formula)."""
        total = self.statements + self.branches
        if total == 0:
            return 100.0
        return 100.0 * (total - self.missed - self.missed_branches) / total


def package_of(module: str) -> str:
    """The package of a file named as a dotted path (``__init__`` kept):
    ``lorastream.worker.loading.fetch`` -> ``lorastream.worker.loading``,
    ``lorastream.core.__init__`` -> ``lorastream.core``,
    ``lorastream.__init__`` -> ``lorastream``."""
    parts = module.split(".")
    depth = len(DEEPER) + 1 if tuple(parts[: len(DEEPER)]) == DEEPER else 2
    return ".".join(parts[:depth]) if len(parts) > depth else ".".join(parts[:-1]) or module


def by_package(files: Iterable[tuple[str, Counts]]) -> dict[str, Counts]:
    """Sum each file's counts (``module name``, counts) into its package's."""
    totals: dict[str, Counts] = {}
    for module, c in files:
        t = totals.setdefault(package_of(module), Counts())
        t.statements += c.statements
        t.missed += c.missed
        t.branches += c.branches
        t.missed_branches += c.missed_branches
    return {name: c for name, c in sorted(totals.items()) if c.statements}  # generated: none


def below(totals: Mapping[str, Counts], floors: Mapping[str, float]) -> list[str]:
    """The packages under their floor, and floors that name no measured package."""
    found = [f"{name}: {totals[name].percent:.1f}% < floor {floor}%"
             for name, floor in floors.items()
             if name in totals and totals[name].percent < floor]
    found += [f"{name}: a floor for a package that was not measured"
              for name in floors if name not in totals]
    return found


def table(totals: Mapping[str, Counts], floors: Mapping[str, float]) -> list[str]:
    width = max(len(name) for name in totals)
    lines = [f"{'package':<{width}}  {'stmts':>6} {'miss':>6} {'branch':>6} {'bmiss':>6} "
             f"{'cover':>6}  floor"]
    for name, c in totals.items():
        floor = floors.get(name)
        lines.append(f"{name:<{width}}  {c.statements:>6} {c.missed:>6} {c.branches:>6} "
                     f"{c.missed_branches:>6} {c.percent:>5.1f}%  {'' if floor is None else floor}")
    return lines


def floors_from(pyproject: Path) -> dict[str, float]:
    config = tomllib.loads(pyproject.read_text())
    return dict(config.get("tool", {}).get("lorastream", {}).get("coverage-floors", {}))


def measured(data_file: Path) -> list[tuple[str, Counts]]:
    """Each measured file of ``lorastream`` as (module name, counts), from the saved data."""
    import coverage

    cov = coverage.Coverage(data_file=str(data_file), config_file=str(REPO / "pyproject.toml"))
    cov.load()
    files = []
    for path in cov.get_data().measured_files():
        relative = Path(path).resolve().relative_to(REPO)
        analysis = cov._analyze(path)  # the Analysis ``coverage report`` sums (no public API)
        n = analysis.numbers
        module = ".".join(relative.with_suffix("").parts)
        counts = Counts(n.n_statements, n.n_missing, n.n_branches, n.n_missing_branches)
        files.append((module, counts))
    return files


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--coverage-floors", action="store_true",
                     help="print branch coverage per package and fail under its floor "
                          "(pyproject.toml [tool.lorastream.coverage-floors]; needs --cov)")


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[SESSION] = session


def _fail(config: pytest.Config) -> None:
    """Fail the run: pytest returns the session's status once its summary is written."""
    config.stash[SESSION].exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    if not config.getoption("--coverage-floors"):
        return
    data_file = REPO / ".coverage"
    if not data_file.is_file():
        terminalreporter.write_line("coverage floors: no .coverage data (run with --cov)", red=True)
        _fail(config)
        return
    floors = floors_from(REPO / "pyproject.toml")
    totals = by_package(measured(data_file))
    terminalreporter.section("branch coverage per package (statements and branches)")
    for line in table(totals, floors):
        terminalreporter.write_line(line)
    problems = below(totals, floors)
    for problem in problems:
        terminalreporter.write_line(f"coverage floor: {problem}", red=True)
    if problems:
        _fail(config)
