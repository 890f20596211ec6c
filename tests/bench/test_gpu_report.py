"""The benchmark page's GPU section: every GPU figure "not measured" until a GPU result is in
the results, a CPU result refused, a GPU result's figures and verdicts shown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchpage.gpu_report import gpu_rows, gpu_section
from benchpage.report import load_results, render_page


def _serving(device: str, decode: float = 0.91, itl_on: float = 1.32,
             itl_off: float = 2.5) -> dict[str, Any]:
    return {"benchmark": "gpu_serving", "device": device, "date": "2026-11-28",
            "decode": {"multi_vs_base": decode},
            "itl": {"itl_p99_on_vs_none": itl_on, "itl_p99_off_vs_none": itl_off},
            "ttft": {"cold_vs_h2d_plus_resident": 1.1}}


MOE = "Qwen3-30B-A3B-shaped (MoE)"


def test_without_gpu_results_every_figure_is_not_measured(tmp_path: Path) -> None:
    page = render_page(load_results(tmp_path), {})
    section = page[page.index("## GPU figures"):]
    assert "**Not measured**" in section and "scripts/gpu_check.sh" in section
    rows = gpu_rows(load_results(tmp_path))
    assert len(rows) == 10
    assert all(row[1] == "not measured" and row[3] == "not measured" for row in rows)


@pytest.mark.parametrize("serving", ["gpu-serving-8b", "gpu-serving-moe"])
def test_a_result_taken_on_the_cpu_never_stands_in_for_a_gpu_figure(
    serving: str, tmp_path: Path
) -> None:
    (tmp_path / f"{serving}.json").write_text(json.dumps(_serving("cpu")))
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
    assert all(row[1] == "not measured" for row in rows if row[0].startswith(MOE))
    assert "Measured: `kernels-gpu.json`, `h2d-gpu.json`, `gpu-serving-8b.json`" in \
        gpu_section(results)


@pytest.mark.parametrize(("decode", "itl_on", "verdicts"), [
    (0.75, 1.15, ("met", "met")),  # within the MoE goals (<= 1.2, >= 0.7), not the 8B's
    (0.65, 1.25, ("**not met**", "**not met**")),
])
def test_a_moe_gpu_result_fills_its_own_figures_against_the_moe_goals(
    decode: float, itl_on: float, verdicts: tuple[str, str], tmp_path: Path
) -> None:
    (tmp_path / "gpu-serving-moe.json").write_text(json.dumps(
        _serving("NVIDIA H200", decode=decode, itl_on=itl_on, itl_off=1.9)))
    results = load_results(tmp_path)
    moe = {row[0]: row for row in gpu_rows(results) if row[0].startswith(MOE)}
    on, off, multi = (next(row for name, row in moe.items() if key in name)
                      for key in ("overlap on", "overlap off", "decode"))
    assert (on[1], on[2], on[3]) == (f"{itl_on:.2f}×", "≤ 1.2", verdicts[0])
    assert (off[1], off[3]) == ("1.90×", "–")  # overlap off: contrast, no goal
    assert (multi[1], multi[2], multi[3]) == (f"{decode:.2f}×", "≥ 0.7", verdicts[1])
    assert all(row[4] == "NVIDIA H200, 2026-11-28" for row in moe.values())
    others = [row for row in gpu_rows(results) if not row[0].startswith(MOE)]
    assert all(row[1] == "not measured" for row in others)  # the 8B's rows take nothing of it
    assert "Measured: `gpu-serving-moe.json`." in gpu_section(results)
