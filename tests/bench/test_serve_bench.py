"""``bench serve`` on the tiny model: the result carries the raw samples CDF plots need."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorastream.bench.serve import CPU_VARIANTS, ServeConfig, run_serve_bench


@pytest.mark.slow
def test_serve_bench_reports_raw_ttft_and_itl_samples_per_mode(tiny_model: Path) -> None:
    config = ServeConfig(
        model=str(tiny_model), adapters=3, slots=2, rank=4, rate=20.0, requests=5, max_tokens=4,
        background=1, background_tokens=3000, interference_rounds=2, window_s=0.2,
        parts=("trace",),
    )
    result = run_serve_bench(config)
    assert "cold_burst" not in result and "cold_link" not in result
    assert isinstance(result["command"], str) and result["command"]
    assert "cpu" in result["machine"]
    for mode in ("overlap_on", "overlap_off"):
        trace = result[mode]["trace"]
        assert trace["errors"] == 0
        assert len(trace["samples"]["ttft_ms"]) == 5
        assert len(trace["samples"]["itl_ms"]) == 5 * (4 - 1)
        assert trace["samples"]["itl_ms"] == sorted(trace["samples"]["itl_ms"])
        interference = result[mode]["interference"]["samples"]
        assert interference["itl_ms_no_loads"]
        assert set(interference) == {"itl_ms_no_loads", "itl_ms_during_loads"}
        assert result[mode]["interference"]["rounds"] == 2
        probe = result[mode]["cold_probe"]
        assert len(probe["samples"]["cold_ttft_ms"]) == probe["probes"] == 3
        assert probe["warm_ttft_ms"] > 0 and probe["load_ms"] > 0
        # a tiny adapter's load costs less CPU than the kernel's 10 ms accounting tick
        assert probe["link_ms"] > 0 and probe["loader_cpu_ms_per_load"] >= 0
        # the figures are rounded to 0.1 ms, the ratio computed before
        assert probe["cold_vs_link_plus_warm"] == pytest.approx(
            probe["cold_ttft_ms"] / (probe["link_ms"] + probe["warm_ttft_ms"]), rel=0.02)
        budgets = result[mode]["worker_budgets_mb"]
        assert set(budgets) == {"host_adapters", "device_slots", "kv_cache"}
        assert result[mode]["worker_peak_rss_mb"] > 0 and budgets["kv_cache"] > 0
    cold = result["overlap_on"]["cold_probe"]["cold_vs_link_plus_warm"]
    assert result["cold_ttft_vs_link_plus_resident_overlap_on"] == cold
    assert result["cold_and_itl_goals_met_together"] == (
        cold <= 1.25 and result["itl_p99_during_loads_vs_none_overlap_on"] <= 1.2)
    for name, flags in CPU_VARIANTS.items():
        assert result[name]["worker_flags"] == " ".join(flags)
        interference = result[name]["interference"]
        assert interference["background_errors"] == [], name
        # an operator's load gets only the CPU that decoding leaves (no request waits for it),
        # which a tiny model decoding back to back hardly does: one load may outlast the rounds
        assert interference["loads"] >= 1, (name, interference)
        assert result[name]["cold_probe"]["cold_ttft_ms"] > 0


def test_ttft_is_split_by_the_first_request_for_each_adapter() -> None:
    from lorastream.bench.harness import RequestResult
    from lorastream.bench.serve import ttft_by_first_use

    # adapters 0, 1, 0, 2, 1: requests 0, 1 and 3 name their adapter first
    trace = [(0.0, 0, 0), (0.1, 1, 0), (0.2, 0, 0), (0.3, 2, 0), (0.4, 1, 0)]
    ttfts = [0.9, 0.8, 0.2, 0.7, 0.3]
    results = [RequestResult(arrival=10.0, first_token=10.0 + t) for t in ttfts]
    results[4].error = "UNAVAILABLE"  # a failed request counts in neither group
    split = ttft_by_first_use(trace, results)
    assert split["first_use_requests"] == 3
    assert split["ttft_ms_first_use"]["p50"] == 800.0  # of 700, 800, 900
    assert split["ttft_ms_repeat"]["p50"] == 200.0  # only request 2 is left


def test_the_cold_workloads_report_every_mode_their_phases_and_goals(tiny_model: Path) -> None:
    config = ServeConfig(
        model=str(tiny_model), slots=4, rank=4, background=1, background_tokens=3000,
        parts=("burst", "link"), burst_cold=2, burst_resident=1, burst_quiet_s=0.3,
        link_rounds=2, link_quiet_s=0.3, cold_shares=(0.0,),
    )
    result = run_serve_bench(config)
    assert "overlap_on" not in result  # the trace part did not run
    burst, link = result["cold_burst"], result["cold_link"]
    for part in (burst, link):
        assert [k for k in part if k.startswith("overlap")] == [
            "overlap_on", "overlap_on_share_0", "overlap_off"]
        assert part["overlap_on_share_0"]["worker_flags"] == "--load-share 0"
    for mode in ("overlap_on", "overlap_on_share_0", "overlap_off"):
        b, lk = burst[mode], link[mode]
        assert b["errors"] == 0 and len(b["samples"]["cold_ttft_ms"]) == 2
        assert len(b["samples"]["resident_ttft_ms"]) == 1
        control = b["resident_ttft_ms_resident_burst"]["p50"]  # the same request, no load
        assert control > 0 and b["resident_ttft_p50_vs_resident_burst"] == pytest.approx(
            b["resident_ttft_ms"]["p50"] / control, rel=0.01)
        assert b["load_phases"]["loads"] == 2  # each cold adapter's load, timed once
        assert lk["rounds"] == 2 and len(lk["cold_vs_link_plus_resident"]) == 2
        assert lk["load_phases"]["loads"] == 2
        for phases in (b["load_phases"], lk["load_phases"]):
            assert {"queue", "stream", "checksum", "landing", "slot_copy", "total"} <= set(phases)
            assert phases["stream"]["cpu_ms"] >= 0 and phases["total"]["wall_ms"] > 0
    assert burst["cold_ttft_p50_on_vs_off"] == pytest.approx(
        burst["overlap_on"]["cold_ttft_ms"]["p50"] / burst["overlap_off"]["cold_ttft_ms"]["p50"],
        rel=0.01)
    assert burst["resident_ttft_p50_vs_resident_burst_on"] == burst["overlap_on"][
        "resident_ttft_p50_vs_resident_burst"]
    assert link["cold_vs_link_plus_resident_p50_on"] == link["overlap_on"][
        "cold_vs_link_plus_resident_p50"]
    for mode in ("overlap_on", "overlap_off"):  # the floors: the controls against no arrival
        b, lk = burst[mode], link[mode]
        assert _ratio_of_rounded(b["worst_gap_resident_burst_vs_before"],
                                 b["worst_gap_ms_during_resident_burst"], b["worst_gap_ms_before"])
        spread = lk["itl_ms"]
        assert lk["itl_p99_ms_resident_requests"] == spread["resident_requests"]["p99"]
        assert _ratio_of_rounded(lk["itl_p99_resident_requests_vs_none"],
                                 spread["resident_requests"]["p99"], spread["no_loads"]["p99"])
        assert spread["during_loads"]["p50"] <= spread["during_loads"]["p99"]
    assert burst["worst_gap_resident_burst_vs_before_on"] == burst["overlap_on"][
        "worst_gap_resident_burst_vs_before"]
    assert link["itl_p99_resident_requests_vs_none_on"] == link["overlap_on"][
        "itl_p99_resident_requests_vs_none"]


def _ratio_of_rounded(ratio: float, a_ms: float, b_ms: float) -> bool:
    """Whether ``ratio`` (of the unrounded values, to 3 places) is a / b for some a and b that
    round to ``a_ms`` and ``b_ms`` (0.1 ms): a tiny model's gaps are a few ms, where rounding
    alone moves a ratio by percents."""
    low, high = (a_ms - 0.05) / (b_ms + 0.05), (a_ms + 0.05) / (b_ms - 0.05)
    return low - 0.0005 <= ratio <= high + 0.0005


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_the_serving_adapter_weighs_what_the_benchmark_counts_experts_included(
        family: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from lorastream.bench.serve_adapters import make_serving_adapter, serving_adapter_nbytes
    from lorastream.core.adapter_format import WEIGHTS_FILE
    from lorastream.worker.model.config import ModelConfig
    from tests.support.models import make_tiny_family

    config = ModelConfig.from_dir(make_tiny_family(family, tmp_path / "model"))
    path = make_serving_adapter(tmp_path / "adapter", config, rank=4, seed=0)
    tensors = load_file(str(path / WEIGHTS_FILE))
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == serving_adapter_nbytes(
        config, 4)
    expert_keys = [k for k in tensors if ".experts" in k]
    assert bool(expert_keys) == config.is_moe  # a MoE base's adapter adapts its experts


@pytest.mark.slow
def test_the_loads_part_on_a_moe_base_reports_itl_during_expert_lora_loads_per_mode(
        tmp_path: Path) -> None:
    from tests.support.models import make_tiny_family

    model = make_tiny_family("qwen3_moe", tmp_path / "model", max_position_embeddings=4096)
    config = ServeConfig(
        model=str(model), adapters=4, slots=2, rank=4, background=1, background_tokens=3000,
        interference_rounds=2, window_s=1.0, host_cache_bytes=100_000, parts=("loads",),
    )
    result = run_serve_bench(config)
    assert result["benchmark"] == "serve-moe"
    assert result["base"]["experts"] == 4
    for mode in ("overlap_on", "overlap_off"):
        assert "trace" not in result[mode]
        assert result[mode]["interference"]["loads"] >= 1  # a shared box may allow only one
        assert result[mode]["cold_probe"]["cold_ttft_ms"] > 0
        assert result[mode]["device_slot_mb_by_part"].keys() == {"experts", "projections"}
        ratio = result[mode]["interference"]["itl_p99_ratio"]
        assert result[f"itl_p99_during_loads_vs_none_{mode}"] == ratio
    assert not any(name in result for name in CPU_VARIANTS)
