"""``bench push`` end to end on the tiny model: moto's S3 server, a store and a worker, through
the CLI, and its section on the benchmark page."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from benchpage.__main__ import main as benchpage_main
from lorastream.cli.main import app

runner = CliRunner()


def test_a_tiny_run_times_both_paths_and_the_page_reports_their_p50s(
    tiny_model: Path, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    result = runner.invoke(app, ["bench", "push", "--model", str(tiny_model), "--rank", "4",
                                 "--repeats", "2", "--output", str(results / "push.json")])
    assert result.exit_code == 0, result.output
    doc = json.loads((results / "push.json").read_text())
    assert doc["benchmark"] == "push" and doc["rounds"] == 2
    assert doc["config"]["rank"] == 4 and doc["adapter_mb"] > 0
    parts = {"push": ("staged_ms", "request_ms", "total_ms"),
             "s3": ("put_ms", "preload_ms", "staged_ms", "request_ms", "total_ms")}
    for path, keys in parts.items():
        assert set(doc[path]) == set(keys)
        for key in keys:
            samples = doc[path][key]["samples"]
            assert len(samples) == 2 and all(v > 0 for v in samples)
            assert min(samples) <= doc[path][key]["p50"] <= max(samples)
        total, staged = doc[path]["total_ms"]["samples"], doc[path]["staged_ms"]["samples"]
        # the request comes after staging
        assert all(t > s for t, s in zip(total, staged, strict=True))
    assert doc["s3_over_push"] == round(doc["s3"]["total_ms"]["p50"]
                                        / doc["push"]["total_ms"]["p50"], 2)

    page = tmp_path / "BENCHMARKS.md"
    assert benchpage_main(["--results", str(results), "--out", str(page)]) == 0
    text = page.read_text()
    section = text[text.index("(push)\n"):]
    assert f"A {doc['adapter_mb']:,.2f} MB adapter (rank 4" in section
    p50 = f"{doc['s3']['total_ms']['p50']:,.1f}"
    assert "| S3 `put_object`, then PreloadAdapter | " in section and p50 in section
    assert f"S3 then preload takes {doc['s3_over_push']:,.2f}×" in section
    assert "adapter from memory to first token, S3 then preload / push (p50)" in text
