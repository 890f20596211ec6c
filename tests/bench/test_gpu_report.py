"""The benchmark page's GPU section: every GPU figure "not measured" until a GPU result is in
the results, a CPU result refused, a GPU result's figures and verdicts shown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchpage.gpu_report import gpu_rows, gpu_section
from benchpage.report import load_results, render_page


def _serving(device: str) -> dict[str, Any]:
    return {"benchmark": "gpu_serving", "device": device, "date": "2026-11-28",
            "decode": {"multi_vs_base": 0.91},
            "itl": {"itl_p99_on_vs_none": 1.32, "itl_p99_off_vs_none": 2.5},
            "ttft": {"cold_vs_h2d_plus_resident": 1.1}}


def test_without_gpu_results_every_figure_is_not_measured(tmp_path: Path) -> None:
    page = render_page(load_results(tmp_path), {})
    section = page[page.index("## GPU figures"):]
    assert "**Not measured**" in section and "scripts/gpu_check.sh" in section
    rows = gpu_rows(load_results(tmp_path))
    assert len(rows) == 7
    assert all(row[1] == "not measured" and row[3] == "not measured" for row in rows)


def test_a_result_taken_on_the_cpu_never_stands_in_for_a_gpu_figure(tmp_path: Path) -> None:
    (tmp_path / "gpu-serving-8b.json").write_text(json.dumps(_serving("cpu")))
    (tmp_path / "h2d-gpu.json").write_text(json.dumps({"load_vs_pinned": 0.9}))  # no device
    assert all(row[1] == "not measured" for row in gpu_rows(load_results(tmp_path)))


def test_gpu_results_fill_the_figures_with_their_verdicts(tmp_path: Path) -> None:
    (tmp_path / "gpu-serving-8b.json").write_text(json.dumps(_serving("NVIDIA H200")))
    (tmp_path / "h2d-gpu.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "date": "2026-11-28", "load_vs_pinned": 0.93}))
    (tmp_path / "kernels-gpu.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "date": "2026-11-28", "per_layer": [
            {"rank": 16, "popularity": "distinct", "batch_size": 1, "overhead": 0.5},
            {"rank": 16, "popularity": "distinct", "batch_size": 32, "overhead": 0.12}]}))
    results = load_results(tmp_path)
    rows = gpu_rows(results)
    by_result = {row[1]: row for row in rows}
    assert by_result["0.93×"][3] == "met" and by_result["0.93×"][4] == "NVIDIA H200, 2026-11-28"
    assert by_result["1.32×"][3] == "**not met**"  # ITL p99 overlap on / none, goal <= 1.1
    assert by_result["2.50×"][3] == "–"  # overlap off: contrast, no goal
    assert by_result["1.10×"][3] == "met"  # cold TTFT, goal <= 1.25
    assert by_result["0.12×"][3] == "met"  # SGMV at 32 rows of 32 adapters, goal <= 0.15
    assert by_result["0.91×"][3] == "met"  # decode, goal >= 0.85
    assert rows[-1][1] == "not measured"  # the default model's shapes: no result
    assert "Measured: `kernels-gpu.json`, `h2d-gpu.json`, `gpu-serving-8b.json`" in \
        gpu_section(results)
