"""The structured-output benchmark: a small real run through the CLI, and its page section."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from benchpage.report import render_page
from lorastream.bench.grammar import CASES, ENGINES
from lorastream.cli.main import app

runner = CliRunner()


def test_both_engines_walk_every_case_and_the_page_compares_them(tmp_path: Path) -> None:
    out = tmp_path / "grammar.json"
    result = runner.invoke(app, ["bench", "grammar", "--models", "default", "--repeats", "2",
                                 "--output", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "grammar" and doc["chosen"] == "llguidance"
    seen = {(row["case"], row["engine"]) for row in doc["rows"]}
    assert seen == {(case.name, engine) for case in CASES for engine in ENGINES}
    for row in doc["rows"]:
        assert row["tokens"] > 5 and row["compile_ms"] > 0
        assert 0 < row["fill_us_p50"] <= row["fill_us_p90"]
    assert set(doc["summary"]) == {f"{engine}@default" for engine in ENGINES}
    page = render_page({"grammar": doc}, {})
    assert "default: xgrammar fills a bitmask" in page and "The worker uses llguidance" in page
    assert "chosen: llguidance" in page
