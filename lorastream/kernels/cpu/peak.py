"""The cores' multiply-add peak per kind of product (``csrc/multiply_peak.cpp``): the roofline of
a decode step whose projections are bound by multiply-adds, as a batch of 32 rows is on a CPU
(docs/quantization.md, "The roofline at 32 rows").

Semantics::

    multiply_add_peak(kind, seconds, threads) -> multiply-adds per second, summed over threads
        kind "fp32":  vfmadd on 8 fp32 lanes                  (the fp32 and int8 weight-only
                                                              products: fp32 activations)
        kind "int8":  vpmaddubsw + vpmaddwd(1) + vpaddd,      (u8 x s8 with exact int32 sums,
                      32 products per group                   int8-dynamic's fbgemm kernel)
        kind "int16": vpmaddwd + vpaddd, 16 products           (16-bit activations)

Each thread runs ten independent chains in registers for about ``seconds``: no memory traffic,
so the rate is the execution units' (a real product also loads, converts and stores, and runs
below it). AVX2 and FMA are needed (an error names the reason otherwise); the C++ ops must load
(``cpu_ops.load()`` returns why not).
"""

from __future__ import annotations

import time

import torch

KINDS = ("fp32", "int8", "int16")
_CALIBRATION = 200_000  # iterations of the first, short run that sizes the measured one


def multiply_add_peak(kind: str, seconds: float = 0.3, threads: int | None = None,
                      repeats: int = 3) -> float:
    """Best of ``repeats`` runs of about ``seconds`` each: multiply-adds per second of ``kind``
    (see the module docstring) over ``threads`` threads (default: torch's thread count)."""
    if kind not in KINDS:
        raise ValueError(f"kind is one of {', '.join(KINDS)}, not {kind!r}")
    if seconds <= 0 or repeats < 1:
        raise ValueError("seconds must be positive and repeats at least 1")
    threads = torch.get_num_threads() if threads is None else threads
    op = torch.ops.lorastream.multiply_add_peak
    start = time.perf_counter()
    op(kind, _CALIBRATION, threads)  # also wakes the threads and the clocks
    per_iteration = (time.perf_counter() - start) / _CALIBRATION
    iterations = max(1, int(seconds / max(per_iteration, 1e-12)))
    return max(op(kind, iterations, threads) for _ in range(repeats))
