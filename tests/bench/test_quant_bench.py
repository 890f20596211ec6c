"""``bench engine --quantization``: every mode runs in the same engine and is reported with its
decode rates, resident memory and token agreement; the page gains its rows and goals."""

from __future__ import annotations

from pathlib import Path

from lorastream.bench.engine import run_engine_bench
from lorastream.bench.engine_quant import agreement, forced_cases
from lorastream.bench.report import render_page
from tests.support.models import make_tiny_family


def test_agreement_counts_equal_positions_of_the_reference() -> None:
    assert agreement({0: [1, 2, 3], 1: [4, 5]}, {0: [1, 2, 9], 1: [4, 5]}) == 4 / 5
    assert agreement({0: [1]}, {0: [1, 2]}) == 1 / 2  # a missing token is not equal


def test_forced_cases_take_every_fourth_position_of_each_sequence() -> None:
    assert forced_cases({0: list(range(9)), 1: [7, 7]}) == [(0, 0), (0, 4), (0, 8), (1, 0)]


def test_quant_bench_reports_every_mode_against_fp32(tmp_path: Path) -> None:
    checkpoint = make_tiny_family("llama", tmp_path / "m")
    result = run_engine_bench(
        model=str(checkpoint), adapters=2, rank=4, prompts=2, new_tokens=3, repeats=1,
        include_peft=False, quantization="int8,int8-dynamic",
    )
    modes = result["modes"]
    assert isinstance(modes, dict) and list(modes) == ["none", "int8", "int8-dynamic"]
    assert modes["none"]["base_only_vs_fp32"] == 1.0
    assert modes["none"]["token_agreement_vs_fp32"] == 1.0  # fp32 forced on its own tokens
    assert modes["none"]["free_running_agreement_vs_fp32"] == 1.0
    assert result["forced_positions"] == 2  # positions 0 of 3 tokens, in 2 sequences
    for m in modes.values():
        assert m["base_only_decode_tok_s"] > 0 and m["multi_adapter_decode_tok_s"] > 0
        assert m["model_rss_mb"] > 0 and m["rss_mb"] >= m["model_rss_mb"]
        assert 0.0 <= m["token_agreement_vs_fp32"] <= 1.0
        assert 0.0 <= m["free_running_agreement_vs_fp32"] <= 1.0
    page = render_page({"engine-int8": result}, {})
    assert "| int8 weight-only |" in page and "int8 base-only decode / fp32" in page
