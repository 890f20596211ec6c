"""The coverage table's arithmetic, and pyproject's floors naming the packages it measures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.coverage_floors import Counts, below, by_package, floors_from, package_of

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("module", "package"),
    [
        ("lorastream.worker.loading.fetch", "lorastream.worker.loading"),
        ("lorastream.worker.device.cpu.step_gate", "lorastream.worker.device"),
        ("lorastream.worker.metrics", "lorastream.worker"),
        ("lorastream.core.codec", "lorastream.core"),
        ("lorastream.store.sources.s3", "lorastream.store"),
        ("lorastream.gateway.__init__", "lorastream.gateway"),
        ("lorastream.worker.__init__", "lorastream.worker"),
        ("lorastream.__init__", "lorastream"),
    ],
)
def test_a_module_counts_in_its_room(module: str, package: str) -> None:
    assert package_of(module) == package


def test_packages_sum_their_files_and_skip_empty_ones() -> None:
    totals = by_package([
        ("lorastream.core.a", Counts(10, 2, 4, 1)),
        ("lorastream.core.b", Counts(10, 0, 0, 0)),
        ("lorastream.common.v1", Counts(0, 0, 0, 0)),  # generated code only: omitted
    ])
    assert list(totals) == ["lorastream.core"]
    core = totals["lorastream.core"]
    assert (core.statements, core.missed, core.branches, core.missed_branches) == (20, 2, 4, 1)
    assert core.percent == pytest.approx(100 * (24 - 3) / 24)


def test_a_package_under_its_floor_or_a_floor_for_nothing_is_reported() -> None:
    totals = {"lorastream.core": Counts(10, 5, 0, 0), "lorastream.store": Counts(10, 1, 0, 0)}
    found = below(totals, {"lorastream.core": 60, "lorastream.store": 85, "lorastream.nope": 1})
    assert found == ["lorastream.core: 50.0% < floor 60%",
                     "lorastream.nope: a floor for a package that was not measured"]


def test_every_floor_names_a_package_of_the_tree() -> None:
    floors = floors_from(REPO / "pyproject.toml")
    packages = {package_of(".".join(p.relative_to(REPO).with_suffix("").parts))
                for p in (REPO / "lorastream").rglob("*.py") if "_pb2" not in p.name}
    assert set(floors) <= packages
