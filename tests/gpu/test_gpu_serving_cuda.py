"""The GPU serving benchmark's code path on CUDA, on tiny random models, dense and MoE
(scripts/gpu_check.sh runs it for its figures on the Llama-3.1-8B, Qwen3-30B-A3B and default
shapes): the Triton LoRA backend (expert deltas too), cold adapters copied into slots by the load
stream while streams decode, on both engines."""

from __future__ import annotations

import math

import pytest

from lorastream.bench.gpu_serving import run_gpu_serving_bench


@pytest.mark.parametrize(("shape", "backend"), [
    ("tiny", "triton"), ("tiny", "torch"), ("tiny-moe", "triton"),
])
def test_the_serving_benchmark_loads_cold_adapters_while_streams_decode_on_cuda(
    shape: str, backend: str,
) -> None:
    result = run_gpu_serving_bench(shape=shape, streams=4, rank=8, new_tokens=8,
                                   prompt_tokens=16, cold_adapters=6, repeats=1,
                                   lora_backend=backend, device="cuda")
    assert result["dtype"] == "bfloat16" and result["resident_on_device"] == 4
    itl = result["itl"]
    assert itl["overlap_on"]["slot_loads"] >= 1 and itl["overlap_off"]["slot_loads"] >= 1
    assert itl["none"]["slot_loads"] == 0
    ratios = (itl["itl_p99_on_vs_none"], result["decode"]["multi_vs_base"],
              result["ttft"]["cold_vs_h2d_plus_resident"])
    assert all(math.isfinite(r) and r > 0 for r in ratios)
