"""``bench engine --quantization``: every mode runs in the same engine and is reported with its
decode rates, resident memory and token agreement; the page gains its rows and goals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from benchpage.report import render_page
from lorastream.bench.engine import run_engine_bench
from lorastream.bench.engine_quant import (
    agreement,
    forced_cases,
    paired_ratios,
    projection_ms,
)
from lorastream.bench.quant_reference import ReferenceRows, dequantized_base
from lorastream.bench.roofline import measure_peaks, multiply_adds_per_row, roofline
from tests.support.models import make_tiny_family


def test_agreement_counts_equal_positions_of_the_reference() -> None:
    assert agreement({0: [1, 2, 3], 1: [4, 5]}, {0: [1, 2, 9], 1: [4, 5]}) == 4 / 5
    assert agreement({0: [1]}, {0: [1, 2]}) == 1 / 2  # a missing token is not equal


def test_forced_cases_take_every_fourth_position_of_each_sequence() -> None:
    assert forced_cases({0: list(range(9)), 1: [7, 7]}) == [(0, 0), (0, 4), (0, 8), (1, 0)]


def test_the_projection_time_runs_every_projection_and_the_lm_head_once_per_pass() -> None:
    calls: list[tuple[str, tuple[int, ...]]] = []

    class Projection:
        def __init__(self, name: str, k: int) -> None:
            self.name, self.in_features = name, k

        def __call__(self, x: torch.Tensor) -> None:
            calls.append((self.name, tuple(x.shape)))

    model = SimpleNamespace(
        proj=[[Projection(f"{i}.{j}", 8 + j) for j in range(4)] for i in range(2)],
        lm_head=Projection("lm_head", 8), dtype=torch.float32, device=torch.device("cpu"))
    times = projection_ms({"m": model}, rows=5, passes=3)  # type: ignore[dict-item]  # a SimpleNamespace stands in for a model
    assert list(times) == ["m"] and len(times["m"]) == 3 and min(times["m"]) >= 0
    one_pass = [("0.0", (5, 8)), ("0.1", (5, 9)), ("0.2", (5, 10)), ("0.3", (5, 11)),
                ("1.0", (5, 8)), ("1.1", (5, 9)), ("1.2", (5, 10)), ("1.3", (5, 11)),
                ("lm_head", (5, 8))]
    assert calls == one_pass * 3


def test_a_position_is_decisive_when_its_margin_exceeds_the_tolerance() -> None:
    rows = ReferenceRows(margin=torch.tensor([0.5, 0.2, 0.0, 3.0]),
                         scale=torch.tensor([10.0, 10.0, 10.0, 100.0]),
                         argmax=torch.tensor([1, 2, 3, 4]))
    # tolerance 3%: a margin must exceed 0.3 of a row whose max |logit| is 10, 3.0 of one of 100
    assert rows.decisive(0.03).tolist() == [True, False, False, False]
    assert rows.decisive(0.0).tolist() == [True, True, False, True]  # fp32: only exact ties


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
    assert result["reference_argmax_vs_fp32"] == 1.0  # transformers + PEFT: the fp32 tokens
    assert modes["none"]["token_agreement_decisive_vs_fp32"] == 1.0
    for m in modes.values():
        assert m["base_only_decode_tok_s"] > 0 and m["multi_adapter_decode_tok_s"] > 0
        assert m["model_rss_mb"] > 0 and m["rss_mb"] >= m["model_rss_mb"]
        assert 0.0 <= m["token_agreement_vs_fp32"] <= 1.0
        assert 0.0 <= m["free_running_agreement_vs_fp32"] <= 1.0
        assert 0 <= m["decisive_positions"] <= result["forced_positions"]
        assert 0 < m["projections_ms_per_step"] <= m["projections_ms_per_step_median"]
        assert m["base_only_decode_tok_s_torch_attention"] > 0  # the same run on torch's path
        assert m["one_stream_base_decode_tok_s"] > 0 and m["one_stream_adapter_decode_tok_s"] > 0
    assert result["attention"] == "native"  # the kernel builds here
    for mode in ("int8", "int8-dynamic"):  # against HF + PEFT over the mode's own weights
        assert 0.0 <= modes[mode]["token_agreement_vs_dequantized_reference"] <= 1.0
    assert "token_agreement_vs_dequantized_reference" not in modes["none"]
    step = result["fp32_step_ms"]
    assert step["base_only"] > 0 and step["multi_adapter"] > 0
    page = render_page({"engine-int8": result}, {})
    assert "| int8 weight-only |" in page and "int8 base-only decode / fp32" in page
    assert modes["none"]["one_stream_base_vs_fp32"] == 1.0
    assert "| int8 base-only decode / fp32, one stream |" in page
    assert "| base weights | one stream: base-only decode tok/s | × fp32 |" in page
    assert "| int8 greedy tokens equal to fp32's at decisive positions" in page
    assert ("| int8-dynamic greedy tokens equal to transformers + PEFT's over the mode's "
            "dequantized weights (teacher-forced) |") in page
    decisive = modes["int8"]["decisive_positions"]
    row = next(line for line in page.splitlines() if line.startswith("| int8 weight-only |"))
    assert f" of {decisive} |" in row
    assert "the base projections alone" in page
    assert "| base weights | base-only decode tok/s | (torch's attention path) |" in page
    assert "Decode attention ran on the native CPU kernel" in page
    assert "The rest of a base-only step (its time from the decode rate less the projections" in (
        page)
    for m in modes.values():  # every repeat's rate, the best of them above
        repeats = m["repeats_decode_tok_s"]
        assert len(repeats["base_only"]) == len(repeats["multi_adapter"]) == 1
        assert max(repeats["base_only"]) == m["base_only_decode_tok_s"]
        assert max(repeats["multi_adapter"]) == m["multi_adapter_decode_tok_s"]
    for mode, m in modes.items():  # repeat by repeat against fp32's run of the same repeat
        paired = m["paired_vs_fp32"]
        assert set(paired) == {"base_only", "multi_adapter", "one_stream_base",
                               "one_stream_adapter"}
        for f in paired.values():
            assert 0 < f["min"] <= f["median"] <= f["max"]
            if mode == "none":
                assert f == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert "× fp32 repeat by repeat" in page and result["repeats"] == 1
    roof = result["roofline"]  # the C++ ops build here: the peak is measured
    peaks = roof["multiply_add_peak_gmac_s"]
    assert set(peaks) == {"fp32", "int8", "int16"} and all(v > 0 for v in peaks.values())
    c = json.loads((checkpoint / "config.json").read_text())
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"]
    qkv = h + 2 * kv * (h // c["num_attention_heads"])  # the fused q, k, v rows
    per_row = c["num_hidden_layers"] * (h * qkv + h * h + h * 2 * i + i * h) + h * c["vocab_size"]
    assert roof["multiply_adds_per_step"] == 2 * per_row  # 2 prompts
    assert set(roof["modes"]) == {"none", "int8", "int8-dynamic"}
    assert all(f["base_only_ceiling_vs_fp32"] > 0 for f in roof["modes"].values())
    # the goals' needs (None only where the rest alone is too long) and the weights' read time
    for mode in ("int8", "int8-dynamic"):
        assert "base_only_goal_needs_of_peak" in roof["modes"][mode]
    weights = {mode: f["weights_ms"] for mode, f in roof["modes"].items()}
    assert weights["none"] > weights["int8"] == weights["int8-dynamic"] > 0  # 4 bytes, 1 byte
    assert "Roofline (bench/roofline.py" in page and "| int8 weight-only | fp32 FMA |" in page


def test_paired_ratios_divide_each_repeat_by_fp32_s_run_of_that_repeat() -> None:
    # repeat 2 is a slow spell for both: its ratio is as good as the others'; the best repeats
    # (300 and 150) would pair repeat 1's fp32 with repeat 3's mode
    assert paired_ratios([200.0, 100.0, 300.0], [150.0, 50.0, 120.0]) == {
        "median": 2.0, "min": round(200 / 150, 3), "max": 2.5}
    assert paired_ratios([1.0], [1.0]) == {"median": 1.0, "min": 1.0, "max": 1.0}


def test_paired_ratios_are_shown_on_the_page_as_median_and_range() -> None:
    from benchpage.report_quant import _paired

    r = {"repeats": 3, "modes": {
        "none": {"paired_vs_fp32": {}},
        "int8": {"paired_vs_fp32": {"base_only": {"median": 1.5, "min": 1.25, "max": 1.75},
                                    "multi_adapter": {"median": 1.3, "min": 1.1, "max": 1.4}}}}}
    text = _paired(r)
    assert "| int8 weight-only | 1.50× (1.25×–1.75×) | 1.30× (1.10×–1.40×) | – | – |" in text
    assert "over 3 repeats" in text and "fp32 (no quantization)" not in text
    assert _paired({"modes": {"int8": {}}}) == ""  # results from before them


def test_multiply_adds_per_row_sum_every_projection_s_in_times_out() -> None:
    projections = [SimpleNamespace(in_features=k, out_features=n)
                   for k, n in [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]]
    assert multiply_adds_per_row(projections) == 576 * (960 + 576 + 3072 + 49152) + 1536 * 576


def test_the_roofline_puts_each_mode_s_projections_at_its_kind_s_peak() -> None:
    """32 rows of 1e9 / 32 multiply-adds: 1 G a step, 10 ms at fp32's 100 G/s, 5 at int8's 200.
    fp32: a 100 ms step of which 70 in projections (median pass); int8 (fp32 FMAs): 80 ms, 50
    in projections; int8-dynamic (int8 x int8): 75 ms, 40 in projections."""
    steps = {"none": {"base_only": 100.0, "multi_adapter": 150.0},
             "int8": {"base_only": 80.0, "multi_adapter": 120.0},
             "int8-dynamic": {"base_only": 75.0, "multi_adapter": 130.0},
             "fp8": {"base_only": 900.0, "multi_adapter": 990.0}}  # no CPU kernel: left out
    got = roofline(32, 10**9 // 32, {"fp32": 100.0, "int8": 200.0, "int16": 50.0}, steps,
                   {"none": 70.0, "int8": 50.0, "int8-dynamic": 40.0, "fp8": 800.0},
                   {"none": 62.5, "int8": 40.0})
    assert set(got) == {"none", "int8", "int8-dynamic"}
    assert got["none"] == {"at_peak_ms": 10.0, "of_peak": round(10 / 70, 3),
                           "products_only_vs_fp32": 7.0,
                           "base_only_rest_ms": 30.0, "base_only_ceiling_vs_fp32": 2.5,
                           "multi_adapter_rest_ms": 80.0,
                           "multi_adapter_ceiling_vs_fp32": round(150 / 90, 3),
                           "of_peak_best": 0.16}
    assert got["int8"]["at_peak_ms"] == 10.0 and got["int8"]["of_peak"] == 0.2
    assert got["int8"]["base_only_ceiling_vs_fp32"] == round(100 / (30 + 10), 3)
    assert got["int8"]["multi_adapter_ceiling_vs_fp32"] == round(150 / (70 + 10), 3)
    assert got["int8-dynamic"]["at_peak_ms"] == 5.0  # int8 x int8: its own peak
    assert got["int8-dynamic"]["base_only_ceiling_vs_fp32"] == round(100 / (35 + 5), 3)
    assert got["int8-dynamic"]["products_only_vs_fp32"] == 14.0
    assert got["int8"]["of_peak_best"] == 0.25 and "of_peak_best" not in got["int8-dynamic"]
    assert not any(k.endswith("goal_needs_of_peak") or k == "weights_ms"
                   for f in got.values() for k in f)  # neither goals nor a bandwidth given


def test_the_roofline_says_what_share_of_the_peak_each_goal_needs() -> None:
    """fp32's steps: 100 ms base-only, 150 mixed. A goal of 2x base-only leaves int8 50 ms, of
    which its rest (80 - 50 = 30 ms) takes 30: its product, 10 ms at the peak, must run in 20,
    at 50% of the peak. A goal of 1.2x mixed leaves 125 ms, its rest is 70: 10 / 55. At 4x
    base-only (25 ms) int8-dynamic's rest alone (35 ms) is longer: out of reach."""
    steps = {"none": {"base_only": 100.0, "multi_adapter": 150.0},
             "int8": {"base_only": 80.0, "multi_adapter": 120.0},
             "int8-dynamic": {"base_only": 75.0, "multi_adapter": 130.0}}
    projections = {"none": 70.0, "int8": 50.0, "int8-dynamic": 40.0}
    peaks = {"fp32": 100.0, "int8": 200.0}
    got = roofline(32, 10**9 // 32, peaks, steps, projections,
                   goals={"base_only": 2.0, "multi_adapter": 1.2}, bandwidth_gbs=25.0)
    assert got["int8"]["base_only_goal_needs_of_peak"] == 0.5
    assert got["int8"]["multi_adapter_goal_needs_of_peak"] == round(10 / 55, 3)
    assert got["int8-dynamic"]["base_only_goal_needs_of_peak"] == round(5 / 15, 3)
    assert "base_only_goal_needs_of_peak" not in got["none"]  # fp32 is what the goals divide
    # 1e9 / 32 weights, read once: 4 bytes each in fp32 (5 ms at 25 GB/s), 1 in int8
    assert got["none"]["weights_ms"] == 5.0 and got["int8"]["weights_ms"] == 1.25
    far = roofline(32, 10**9 // 32, peaks, steps, projections, goals={"base_only": 4.0})
    assert far["int8-dynamic"]["base_only_goal_needs_of_peak"] is None
    assert far["int8"]["base_only_goal_needs_of_peak"] is None  # 25 ms left, rest 30


def test_the_page_shows_the_share_of_the_peak_a_goal_needs_or_that_it_is_out_of_reach() -> None:
    from benchpage.report_quant import _roofline

    roof = {"multiply_add_peak_gmac_s": {"fp32": 100.0, "int8": 90.0, "int16": 50.0},
            "multiply_adds_per_step": 10**9, "modes": {
                "none": {"at_peak_ms": 10.0, "weights_ms": 5.0},
                "int8": {"at_peak_ms": 10.0, "base_only_goal_needs_of_peak": 0.755,
                         "multi_adapter_goal_needs_of_peak": None, "weights_ms": 1.2}}}
    page = _roofline({"roofline": roof, "prompts": 32, "modes": {}})
    assert "| 75.5% | out of reach | 1.2 |" in page
    assert page.count("| – | – | 5.0 |") == 1  # fp32: no goal of its own


def test_no_cpu_peak_is_measured_for_a_model_on_a_gpu() -> None:
    assert measure_peaks("cuda") == {
        "error": "the model ran on cuda; the measured peak is the CPU's"}


def test_a_roofline_without_a_peak_is_said_so_on_the_page() -> None:
    from benchpage.report_quant import _roofline

    text = _roofline({"roofline": {"multiply_add_peak_gmac_s": {"error": "no compiler"}}})
    assert text == "Roofline: the multiply-add peak was not measured (no compiler)."
    assert _roofline({}) == ""  # results from before it


def test_a_mode_timed_slower_in_parts_than_in_whole_gets_no_rest_figure() -> None:
    """The rest of a step is its time less its projections' separate timing; where the machine's
    speed moved between the two and the difference is negative, the page says so instead."""
    from benchpage.report_quant import _rest

    modes = {"none": {"base_only_decode_tok_s": 200.0, "projections_ms_per_step": 100.0},
             "int8": {"base_only_decode_tok_s": 200.0, "projections_ms_per_step": 187.0}}
    text = _rest({"prompts": 32}, modes)
    assert "came to fp32 (no quantization) 60.0 ms:" in text  # 32 / 200 tok/s = 160 ms
    assert "Int8 weight-only's projections took longer in their separate timing than its " \
           "whole base-only step (187.0 against 160.0 ms" in text
    assert "-27" not in text


def test_the_dequantized_reference_holds_the_mode_s_weights_and_gives_them_back(
    tmp_path: Path,
) -> None:
    """Inside ``dequantized_base`` every base projection and the lm_head hold the mode's
    dequantized weights (the tied embedding with it); the adapters' A and B are untouched; on
    exit every weight is back, bit for bit."""
    from lorastream.bench.peft_peer import load_mixed_peft
    from lorastream.bench.synthetic import checkpoint_shape, make_synthetic_adapter
    from lorastream.worker.model.quant_linear import MODES, dequantized_weight

    checkpoint = make_tiny_family("llama", tmp_path / "m")
    adapter = make_synthetic_adapter(tmp_path / "a0", checkpoint_shape(str(checkpoint)), rank=4)
    peft = load_mixed_peft(checkpoint, [adapter])
    before = {name: p.detach().clone() for name, p in peft.model.named_parameters()}
    base = {name: m for name, m in peft.model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".lora_" not in name}
    assert any(name.endswith("q_proj.base_layer") for name in base) and any(
        name.endswith("lm_head") for name in base)
    for mode in MODES:
        with dequantized_base(peft, mode):
            for name, module in base.items():
                original = before[f"{name}.weight"]
                expected = dequantized_weight(original, mode)
                assert torch.equal(module.weight, expected), name
                assert not torch.equal(module.weight, original), name
            for name, p in peft.model.named_parameters():
                if ".lora_" in name:
                    assert torch.equal(p, before[name]), name
        for name, p in peft.model.named_parameters():
            assert torch.equal(p, before[name]), name
