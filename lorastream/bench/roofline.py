"""The multiply-add roofline of ``bench engine --quantization``: how fast a step of ``prompts``
rows could run per mode if its projections ran at the cores' multiply-add peak.

A decode step of 32 rows on a CPU is bound by multiply-adds in its projections, not by reading
their weights (docs/quantization.md, "The roofline at 32 rows").
The peak is measured on this machine
(``lorastream/kernels/cpu/peak.py``: register-only loops of each kind of product, every thread), the
multiply-adds are counted from the model's projection shapes, and the rest of each step (what a
step spends outside its projections: attention, norms, sampling, the scheduler) is the mode's own,
as measured in the same run: its median repeat's step less its projections' median pass. Per
mode::

    at_peak_ms      = prompts * multiply_adds_per_row / peak[kind]        # kind: fp32 or int8
    of_peak         = at_peak_ms / projections_ms                         # the product's share
    rest_ms         = step_ms - projections_ms                            # base-only, mixed;
                                                                          # 0 where the separate
                                                                          # timing took longer
    ceiling_step_ms = rest_ms + at_peak_ms
    ceiling_vs_fp32 = fp32 step_ms / ceiling_step_ms                       # the best the mode
                                                                          # could reach
    products_only_vs_fp32 = fp32 projections_ms / at_peak_ms              # the bound were the
                                                                          # rest 0 in both
    goal_needs_of_peak = at_peak_ms / (fp32 step_ms / goal - rest_ms)     # the share of the
                                                                          # peak a goal needs
                                                                          # (None: out of reach
                                                                          # at any speed)
    weights_ms          = multiply_adds_per_row * bytes_per_weight / bandwidth  # the weights
                                                                          # read once a step

The last two say what bounds a step: ``weights_ms`` below ``at_peak_ms`` is a step whose
multiply-adds, not its weight bytes, set its floor (the case quantizing the weights gains least).

``int8`` multiplies fp32 activations by its dequantized weights (FMA), ``int8-dynamic`` int8 by
int8 with exact int32 sums (``vpmaddubsw`` without VNNI).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

PEAK_KIND = {"none": "fp32", "int8": "fp32", "int8-dynamic": "int8"}  # fp8: no CPU kernel
BYTES_PER_WEIGHT = {"none": 4, "int8": 1, "int8-dynamic": 1}  # the CPU's: fp32, int8


class _Projection(Protocol):
    in_features: int
    out_features: int


def multiply_adds_per_row(projections: Iterable[_Projection]) -> int:
    """Multiply-adds one row of a step spends in ``projections`` (each ``in x out``)."""
    return sum(p.in_features * p.out_features for p in projections)


def measure_peaks(device: str = "cpu") -> dict[str, object]:
    """G multiply-adds/s per kind over torch's threads, or ``{"error": why}`` (a model on
    another ``device`` than the CPU, whose peak this is not; no C++ ops; no AVX2)."""
    if device != "cpu":
        return {"error": f"the model ran on {device}; the measured peak is the CPU's"}
    from lorastream.kernels.cpu import ops as cpu_ops

    reason = cpu_ops.load()
    if reason is not None:
        return {"error": reason}
    from lorastream.kernels.cpu.peak import KINDS, multiply_add_peak

    try:
        return {kind: round(multiply_add_peak(kind) / 1e9, 1) for kind in KINDS}
    except RuntimeError as err:  # built without AVX2: the op says so
        return {"error": str(err).splitlines()[0]}


def roofline(prompts: int, macs_per_row: int, peaks: Mapping[str, float],
             step_ms: Mapping[str, Mapping[str, float]], projections_ms: Mapping[str, float],
             best_projections_ms: Mapping[str, float] | None = None,
             goals: Mapping[str, float] | None = None, bandwidth_gbs: float | None = None,
             ) -> dict[str, dict[str, float | None]]:
    """Per mode of ``step_ms`` (``{mode: {"base_only": ms, "multi_adapter": ms}}``, fp32 as
    ``"none"``; the median repeat's step) whose kind of product has a peak: the figures of the
    module docstring, from the median pass of the projections (``projections_ms``), both
    medians so that the rest of a step is not one lucky repeat less another's lucky pass; with
    ``best_projections_ms``, the best pass's share of the peak too (``of_peak_best``); with
    ``goals`` (``{"base_only": 1.6, ...}``: a mode's decode over fp32's), the share of the peak
    each quantized mode's product would need to meet them (``{run}_goal_needs_of_peak``); with
    the memory's read ``bandwidth_gbs``, the time its weights take to read (``weights_ms``)."""
    fp32_step = step_ms["none"]
    out: dict[str, dict[str, float | None]] = {}
    for mode, steps in step_ms.items():
        kind = PEAK_KIND.get(mode)
        if kind is None or not peaks.get(kind) or mode not in projections_ms:
            continue
        at_peak = prompts * macs_per_row / (peaks[kind] * 1e9) * 1e3
        figures: dict[str, float | None] = {
            "at_peak_ms": round(at_peak, 1),
            "of_peak": round(at_peak / projections_ms[mode], 3),  # the product's share of peak
            "products_only_vs_fp32": round(projections_ms["none"] / at_peak, 3),
        }
        if best_projections_ms and mode in best_projections_ms:
            figures["of_peak_best"] = round(at_peak / best_projections_ms[mode], 3)
        for run, ms in steps.items():
            rest = max(ms - projections_ms[mode], 0.0)
            figures[f"{run}_rest_ms"] = round(rest, 1)
            figures[f"{run}_ceiling_vs_fp32"] = round(fp32_step[run] / (rest + at_peak), 3)
            if goals and run in goals and mode != "none":
                left = fp32_step[run] / goals[run] - rest  # ms the projections may take
                figures[f"{run}_goal_needs_of_peak"] = (
                    round(at_peak / left, 3) if left > 0 else None)
        if bandwidth_gbs and mode in BYTES_PER_WEIGHT:
            figures["weights_ms"] = round(
                macs_per_row * BYTES_PER_WEIGHT[mode] / (bandwidth_gbs * 1e9) * 1e3, 3)
        out[mode] = figures
    return out
