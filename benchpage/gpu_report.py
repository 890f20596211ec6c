"""The benchmark page's GPU section: the GPU figures with their goals, "not measured" until a
GPU run's result is in the results directory.

``scripts/gpu_check.sh`` writes the results on a CUDA machine (``kernels-gpu.json``,
``h2d-gpu.json``, ``gpu-serving-8b.json``, ``gpu-serving-moe.json``, ``gpu-serving-smollm2.json``);
copied into the results
directory, they fill this section. A result that does not name a CUDA device (a code-path run on
a CPU) is refused: no CPU number ever stands in for a GPU figure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from benchpage.report_format import (
    MISSING,
    as_number,
    code_block,
    get,
    paragraphs,
    ratio,
    table,
    text,
    verdict,
)

Result = Mapping[str, Any]
RESULTS = ("kernels-gpu", "h2d-gpu", "gpu-serving-8b", "gpu-serving-moe", "gpu-serving-smollm2")
HEADER = ("figure", "result", "target", "verdict", "measured on")
COMMAND = "make gpu-wheelhouse  # here, then on the GPU machine, with .gpu-wheelhouse carried:\n" \
          "scripts/gpu_check.sh OUT"
KERNELS_COMMAND = ("lorastream bench kernels  # the full sweep; gpu_check.sh runs "
                   "python -m lorastream.kernels.bench --batch-sizes 1,32,256 --ranks 16 "
                   "--popularities distinct")


def measured(result: Result | None) -> Result | None:
    """``result`` if it was taken on a CUDA device, else None."""
    device = text(get(result, "device") or get(result, "gpu"))
    return result if result is not None and device not in (MISSING, "cpu") else None


def _sgmv_overhead(r: Result) -> float | None:
    """SGMV shrink + expand over the base matmuls of one Llama-8B layer: rank 16, 32 rows of 32
    distinct adapters."""
    for row in get(r, "per_layer") or []:
        if (get(row, "rank"), get(row, "popularity"), get(row, "batch_size")) == (16, "distinct",
                                                                                  32):
            return as_number(get(row, "overhead"))
    return None


# (name, result, value of the result, target, met(value) or None: no goal, only contrast)
FIGURES: tuple[tuple[str, str, Callable[[Result], Any], str, Callable[[float], bool] | None],
               ...] = (
    ("host → device: load path / one pinned copy of the same bytes (8B-shaped adapter, rank 16)",
     "h2d-gpu", lambda r: get(r, "load_vs_pinned"), "≥ 0.8", lambda v: v >= 0.8),
    ("8B-shaped, 32 streams: ITL p99 while adapters load, overlap on / no loads",
     "gpu-serving-8b", lambda r: get(r, "itl", "itl_p99_on_vs_none"), "≤ 1.1",
     lambda v: v <= 1.1),
    ("8B-shaped, 32 streams: ITL p99 while adapters load, overlap off / no loads (contrast)",
     "gpu-serving-8b", lambda r: get(r, "itl", "itl_p99_off_vs_none"), MISSING, None),
    ("8B-shaped: cold-adapter TTFT / (its H2D time + resident TTFT)",
     "gpu-serving-8b", lambda r: get(r, "ttft", "cold_vs_h2d_plus_resident"), "≤ 1.25",
     lambda v: v <= 1.25),
    ("SGMV shrink + expand / base matmul, rank 16, 32 rows of 32 adapters, Llama-8B layer",
     "kernels-gpu", _sgmv_overhead, "≤ 0.15", lambda v: v <= 0.15),
    ("8B-shaped decode tok/s: 32 distinct adapters / base model alone",
     "gpu-serving-8b", lambda r: get(r, "decode", "multi_vs_base"), "≥ 0.85",
     lambda v: v >= 0.85),
    ("Qwen3-30B-A3B-shaped (MoE), 8 streams: ITL p99 while expert LoRAs load, overlap on / "
     "no loads", "gpu-serving-moe", lambda r: get(r, "itl", "itl_p99_on_vs_none"), "≤ 1.2",
     lambda v: v <= 1.2),
    ("Qwen3-30B-A3B-shaped (MoE), 8 streams: ITL p99 while expert LoRAs load, overlap off / "
     "no loads (contrast)", "gpu-serving-moe", lambda r: get(r, "itl", "itl_p99_off_vs_none"),
     MISSING, None),
    ("Qwen3-30B-A3B-shaped (MoE) decode tok/s: 8 distinct expert LoRAs / base model alone",
     "gpu-serving-moe", lambda r: get(r, "decode", "multi_vs_base"), "≥ 0.7",
     lambda v: v >= 0.7),
    ("default model's shapes, decode tok/s: 32 distinct adapters / base model alone",
     "gpu-serving-smollm2", lambda r: get(r, "decode", "multi_vs_base"), MISSING, None),
)


def gpu_rows(results: Mapping[str, Result | None]) -> list[list[str]]:
    rows = []
    for name, source, value_of, target, met in FIGURES:
        result = measured(results.get(source))
        value = as_number(value_of(result)) if result is not None else None
        if value is None:
            rows.append([name, "not measured", target, "not measured", MISSING])
            continue
        where = f"{text(get(result, 'device') or get(result, 'gpu'))}, {text(get(result, 'date'))}"
        rows.append([name, ratio(value), target, verdict(met(value)) if met else MISSING, where])
    return rows


def gpu_section(results: Mapping[str, Result | None]) -> str:
    taken = [name for name in RESULTS if measured(results.get(name)) is not None]
    status = (f"Measured: {', '.join(f'`{n}.json`' for n in taken)}." if taken else
              "**Not measured**: no GPU has run these yet (the development machines have none). "
              "Each figure below stays \"not measured\" until a GPU run's result is copied into "
              "the results; a result taken on a CPU is refused.")
    return paragraphs([
        "The GPU figures: the load path's host → device rate, the running streams' inter-token "
        "latency while adapters load and the cold-adapter TTFT on a Llama-3.1-8B-shaped model "
        "(random bf16 weights of its shapes, built on the device; rank-16 all-linear adapters "
        "made there), the Triton SGMV kernels against the base matmul, and decode throughput "
        "with 32 distinct adapters against the base model; the same streams' ITL p99 and decode "
        "on a Qwen3-30B-A3B-shaped mixture of experts (random bf16 weights, 128 experts in each "
        "of 48 layers) with 8 streams and rank-16 expert LoRAs (q/k/v/o and every expert's "
        "gate_up and down, 1.29 GB each) loading cold. One call on a CUDA machine with no "
        "network runs them, after tests/gpu (README, \"GPU tests\"):",
        code_block(COMMAND),
        status,
        table(HEADER, gpu_rows(results)),
        "The kernels' full sweep (every batch size, rank and popularity):",
        code_block(KERNELS_COMMAND),
    ])
