"""The registry benchmark: a tiny real run through the CLI, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorastream.cli.main import app

runner = CliRunner()


def test_a_tiny_run_reports_both_schemes_at_every_count(tmp_path: Path) -> None:
    out = tmp_path / "registry.json"
    result = runner.invoke(app, ["bench", "registry", "--counts", "10,300",
                                 "--registrations", "5", "--json-registrations", "2",
                                 "--output", str(out)])
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


@pytest.mark.parametrize("counts", ["ten", "0,5", ""])
def test_bad_counts_are_one_line_errors(counts: str) -> None:
    result = runner.invoke(app, ["bench", "registry", "--counts", counts])
    assert result.exit_code == 2
    assert "--counts" in result.output
