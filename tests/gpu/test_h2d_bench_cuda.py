"""The host -> device benchmark on a GPU: the load path moves the adapter's bytes into its slot,
at a rate bounded by the pinned-copy limit."""

from __future__ import annotations

from lorastream.bench.h2d import run_h2d_bench


def test_the_load_path_rate_is_measured_against_the_pinned_limit() -> None:
    result = run_h2d_bench(rank=8, repeats=3)
    assert result["adapter_bytes"] > 40_000_000  # Llama-3-8B all-linear at rank 8, bf16
    assert result["pinned_limit_GBps"] > 1.0  # any PCIe or NVLink host link
    # the load path copies the same bytes in pieces from pinned memory: not faster than one
    # pinned copy (10 % of timer noise), and not pathologically slower
    assert 0.05 < result["load_vs_pinned"] <= 1.1
