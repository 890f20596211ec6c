"""The registry benchmark: a tiny real run through the CLI (the SQLite registry and a real store
server's PreloadAdapter RPC), and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchpage.report import render_page
from lorastream.cli.main import app

runner = CliRunner()


def test_a_tiny_run_reports_both_schemes_and_the_rpc_path_at_every_count(
    tmp_path: Path
) -> None:
    out = tmp_path / "registry.json"
    result = runner.invoke(app, ["bench", "registry", "--counts", "10,300",
                                 "--registrations", "5", "--json-registrations", "2",
                                 "--rpc-sequence", "20", "--output", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "registry" and doc["counts"] == [10, 300]
    assert [p["names"] for p in doc["points"]] == [10, 300]
    for point in doc["points"]:
        assert (point["sqlite_samples"], point["json_samples"]) == (5, 2)
        for scheme in ("sqlite", "json_rewrite"):
            summary = point[scheme]
            assert 0 < summary["p50_ms"] <= summary["p99_ms"]
        assert point["list_page_ms"]["p50_ms"] > 0 and point["registrations_per_s"] > 0
    assert doc["goal_met"] == (doc["registrations_per_s_spread"] <= 1.2)
    rpc = doc["rpc"]
    assert [p["names"] for p in rpc["points"]] == [10, 300]
    for point in rpc["points"]:
        # each store held its fill, the warm-up and the timed registrations, all distinct
        assert point["samples"] == 5 and point["names_after"] == point["names"] + 10 + 5
        assert 0 < point["rpc"]["p50_ms"] <= point["rpc"]["p99_ms"]
        assert point["registrations_per_s"] > 0 and point["fill_s"] >= 0
    assert rpc["goal"] == "registrations_per_s_spread <= 1.2"
    assert rpc["goal_met"] == (rpc["registrations_per_s_spread"] <= 1.2)
    sequence = rpc["sequence"]
    assert (sequence["adapters"], sequence["fifth"]) == (20, 4)
    assert sequence["last_over_first"] == pytest.approx(
        sequence["last_p50_ms"] / sequence["first_p50_ms"], abs=1e-3)
    assert sequence["goal_met"] == (sequence["last_over_first"] <= 1.2)


def test_without_rpc_the_result_says_so(tmp_path: Path) -> None:
    out = tmp_path / "registry.json"
    result = runner.invoke(app, ["bench", "registry", "--counts", "10", "--registrations", "2",
                                 "--json-registrations", "1", "--no-rpc", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["rpc"] is None


@pytest.mark.parametrize("counts", ["ten", "0,5", ""])
def test_bad_counts_are_one_line_errors(counts: str) -> None:
    result = runner.invoke(app, ["bench", "registry", "--counts", counts])
    assert result.exit_code == 2
    assert "--counts" in result.output


def test_the_page_shows_the_rpc_path_beside_the_sqlite_layer_with_both_goals() -> None:
    sqlite_point = {"names": 1000, "sqlite": {"p50_ms": 0.25, "p99_ms": 0.4},
                    "json_rewrite": {"p50_ms": 7.3}, "registrations_per_s": 4000.0}
    rpc_points = [
        {"names": 1000, "rpc": {"p50_ms": 7.0, "p99_ms": 9.0}, "registrations_per_s": 142.9,
         "fill_s": 6.0},
        {"names": 100000, "rpc": {"p50_ms": 8.75, "p99_ms": 12.0}, "registrations_per_s": 114.3,
         "fill_s": 600.0},
    ]
    registry = {
        "points": [sqlite_point, {**sqlite_point, "names": 100000}],
        "registrations_per_s_spread": 1.0, "goal": "registrations_per_s_spread <= 1.2",
        "rpc": {"points": rpc_points, "registrations_per_s_spread": 1.25,
                "goal": "registrations_per_s_spread <= 1.2", "fill": "push",
                "sequence": {"adapters": 2000, "fifth": 400, "first_p50_ms": 7.0,
                             "last_p50_ms": 7.7, "last_over_first": 1.1,
                             "goal": "last_over_first <= 1.2"}},
    }
    page = render_page({"registry": registry}, {})
    assert "| 100,000 | 114.3 | 8.750 | 12.000 | 600.0 |" in page
    assert ("| PreloadAdapter registrations/s, fastest / slowest, 1,000 → 100,000 names | "
            "1.250× | ≤ 1.2 | **not met** |") in page
    assert ("| PreloadAdapter p50, last / first 400 of 2,000 in a row | 1.100× | ≤ 1.2 | met |"
            in page)
    assert "the first 400 took 7.0 ms each (median), the last 400 7.7 ms (1.10×" in page
    without = render_page({"registry": {**registry, "rpc": None}}, {})
    assert "PreloadAdapter" not in without
