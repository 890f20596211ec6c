"""The quantized-base benchmark's section and goal rows on the benchmark page
(``bench engine --quantization ...``, lorastream/bench/engine_quant.py)."""

from __future__ import annotations

from collections.abc import Mapping

from benchpage.report_format import (
    MISSING,
    Result,
    as_number,
    goal_row,
    number,
    paragraphs,
    pct,
    ratio,
    table,
    text,
)
from lorastream.bench.roofline import PEAK_KIND

_SHOWN = {"none": "fp32 (no quantization)", "int8": "int8 weight-only",
          "int8-dynamic": "7-bit weights + per-token int8 activations (rotated)",
          "fp8": "e4m3 weights + per-token e4m3 activations"}


def _modes(r: Result) -> dict[str, Mapping[str, object]]:
    modes = r.get("modes")
    if not isinstance(modes, Mapping):
        return {}
    return {str(k): v for k, v in modes.items() if isinstance(v, Mapping)}


def quant_goals(r: Result) -> list[list[str]]:
    rows = []
    for mode, m in _modes(r).items():
        if mode == "none":
            continue
        rows += [
            goal_row(f"{mode} base-only decode / fp32", m.get("base_only_vs_fp32"),
                     r.get("goal_base_only_vs_fp32")),
            goal_row(f"{mode} mixed {text(r.get('adapters'))}-adapter decode / fp32",
                     m.get("multi_vs_fp32"), r.get("goal_multi_vs_fp32")),
            *_one_stream_goals(r, mode, m),
            goal_row(f"{mode} greedy tokens equal to fp32's (teacher-forced)",
                     m.get("token_agreement_vs_fp32"),
                     r.get("goal_token_agreement"), percent=True),
        ]
        if "token_agreement_decisive_vs_fp32" in m:  # results from before it have none
            rows.append(goal_row(
                f"{mode} greedy tokens equal to fp32's at decisive positions (teacher-forced; "
                "reference top-2 margin above the stated logit tolerance)",
                m.get("token_agreement_decisive_vs_fp32"), r.get("goal_token_agreement"),
                percent=True))
        if "token_agreement_vs_dequantized_reference" in m:  # what the token goal is about
            rows.append(goal_row(
                f"{mode} greedy tokens equal to transformers + PEFT's over the mode's "
                "dequantized weights (teacher-forced)",
                m.get("token_agreement_vs_dequantized_reference"), r.get("goal_token_agreement"),
                percent=True))
    return rows


def _one_stream_goals(r: Result, mode: str, m: Mapping[str, object]) -> list[list[str]]:
    """The speed goals over one stream (results from before it have none)."""
    if "one_stream_base_vs_fp32" not in m:
        return []
    return [goal_row(f"{mode} base-only decode / fp32, one stream",
                     m.get("one_stream_base_vs_fp32"), r.get("goal_base_only_vs_fp32")),
            goal_row(f"{mode} one-adapter decode / fp32, one stream",
                     m.get("one_stream_adapter_vs_fp32"), r.get("goal_multi_vs_fp32"))]


def _one_stream(r: Result) -> str:
    """The one-stream table, where the results have it."""
    modes = {k: m for k, m in _modes(r).items() if "one_stream_base_decode_tok_s" in m}
    if not modes:
        return ""
    header = ("base weights", "one stream: base-only decode tok/s", "× fp32",
              "one stream: one adapter, decode tok/s", "× fp32")
    rows = [[_SHOWN.get(mode, mode), number(m.get("one_stream_base_decode_tok_s")),
             ratio(m.get("one_stream_base_vs_fp32")),
             number(m.get("one_stream_adapter_decode_tok_s")),
             ratio(m.get("one_stream_adapter_vs_fp32"))] for mode, m in modes.items()]
    return paragraphs([
        "One stream (one prompt at a time, base-only and under one adapter; the modes take "
        "turns as above): each decode step reads every base weight for a single row, so the "
        "weights' bytes bound it, where the batch above is bound by multiply-adds.",
        table(header, rows)])


def _paired(r: Result) -> str:
    """The ratios to fp32 repeat by repeat, where the results have them."""
    modes = {k: m for k, m in _modes(r).items()
             if k != "none" and isinstance(m.get("paired_vs_fp32"), Mapping)}
    if not modes:
        return ""

    def cell(m: Mapping[str, object], run: str) -> str:
        paired = m["paired_vs_fp32"]
        f = paired.get(run) if isinstance(paired, Mapping) else None
        if not isinstance(f, Mapping):
            return ratio(None)
        return f"{ratio(f.get('median'))} ({ratio(f.get('min'))}–{ratio(f.get('max'))})"

    runs = ("base_only", "multi_adapter", "one_stream_base", "one_stream_adapter")
    header = ("base weights", "base-only", "mixed", "one stream, base-only",
              "one stream, one adapter")
    rows = [[_SHOWN.get(mode, mode), *(cell(m, run) for run in runs)] for mode, m in modes.items()]
    return paragraphs([
        "× fp32 repeat by repeat: in each repeat a mode's run and fp32's run of the same kind "
        "are seconds apart, so their ratio does not pair two different minutes of the machine, "
        "as the ratio of the best repeats above can. Median (lowest–highest) over "
        f"{text(r.get('repeats'))} repeats:",
        table(header, rows)])


def _decisive(m: Mapping[str, object]) -> str:
    """The decisive positions' agreement, with how many there were."""
    if "token_agreement_decisive_vs_fp32" not in m:
        return pct(None)
    shown = pct(m.get("token_agreement_decisive_vs_fp32"))
    return f"{shown} of {number(m.get('decisive_positions'), 0)}"


def _reference(r: Result) -> str:
    same = r.get("reference_argmax_vs_fp32")
    if same is None:
        return ""
    return (f" The reference's argmax equals the fp32 engine's token at {pct(same)} of the "
            "teacher-forced positions.")


def quant_section(r: Result, plots: Mapping[str, str]) -> str:
    dequantized = any("token_agreement_vs_dequantized_reference" in m
                      for m in _modes(r).values())
    torch_path = any("base_only_decode_tok_s_torch_attention" in m for m in _modes(r).values())
    header = ("base weights", "base-only decode tok/s",
              *(("(torch's attention path)",) if torch_path else ()),
              "× fp32", "mixed-adapter decode tok/s",
              "× fp32", "tokens equal to fp32's (teacher-forced)", "(decisive positions)",
              "(free-running)",
              *(("tokens equal to HF + PEFT over the dequantized weights",) if dequantized
                else ()),
              "model resident (MB)", "process RSS (MB)")
    rows = [
        [_SHOWN.get(mode, mode), number(m.get("base_only_decode_tok_s")),
         *((number(m.get("base_only_decode_tok_s_torch_attention")),) if torch_path else ()),
         ratio(m.get("base_only_vs_fp32")), number(m.get("multi_adapter_decode_tok_s")),
         ratio(m.get("multi_vs_fp32")), pct(m.get("token_agreement_vs_fp32")),
         _decisive(m), pct(m.get("free_running_agreement_vs_fp32")),
         *((pct(m.get("token_agreement_vs_dequantized_reference")),) if dequantized else ()),
         number(m.get("model_rss_mb"), 0), number(m.get("rss_mb"), 0)]
        for mode, m in _modes(r).items()
    ]
    peft = r.get("peft_mixed_batch_decode_tok_s")
    peft_line = (f"HF transformers + PEFT (fp32, mixed-adapter batches) decoded "
                 f"{number(peft)} tok/s in the same run." if peft is not None else "")
    return paragraphs([
        f"The engine on {text(r.get('model'))} with {text(r.get('prompts'))} prompts "
        f"({text(r.get('adapters'))} rank-{text(r.get('rank'))} all-linear adapters in the mixed "
        f"batch) over an fp32 base and over each `--quantization` mode, in one engine: its model "
        "is swapped between runs, so KV cache, slots and adapters are the same and the runs "
        "take turns within every repeat. Model resident: RSS after building the model minus "
        "before, in a fresh process per mode. Tokens equal: the mixed batch's greedy tokens "
        "against the fp32 engine's (which are PEFT's), teacher-forced at "
        f"{text(r.get('forced_positions'))} positions (every 4th of each fp32 sequence: the "
        "mode is given the prompt and the fp32 tokens before it and generates one, so a "
        "near-tie costs that position only); free-running: each mode's own greedy sequences "
        "compared position by position, where one early near-tie changes the rest. Decisive "
        "positions: those of the teacher-forced ones where the reference, transformers + PEFT "
        "in fp32 over the fp32 sequence, has a top-2 margin above the mode's stated logit "
        "tolerance (a share of the row's largest |logit|, `LOGIT_TOLERANCE` in "
        "lorastream/worker/model/quant_linear.py, what `make test`'s tolerance test bounds "
        "the mode's error by): an error within the tolerance cannot flip those, and at the "
        "others either token is as good an answer as the tolerance promises. Over the "
        "dequantized weights: the same teacher-forced tokens against the argmax of "
        "transformers + PEFT (fp32) whose base projections and lm_head hold the mode's "
        "weights dequantized (`bench/quant_reference.py`, `dequantized_base`; int8-dynamic's "
        "un-rotated), the comparison the token goal is stated against: what is left is the "
        "mode's arithmetic (for int8 on the C++ op, fp32 sums in another order; for "
        "int8-dynamic, per-token int8 activations of the rotated input), not its weight "
        "rounding."
        + _reference(r),
        table(header, rows),
        " ".join(filter(None, [peft_line, _attention(r, torch_path)])),
        _one_stream(r),
        _paired(r),
        _where_the_time_goes(r),
        _roofline(r),
    ])


def _roofline(r: Result) -> str:
    """The multiply-add roofline (bench/roofline.py), where the results have it."""
    roof = r.get("roofline")
    if not isinstance(roof, Mapping):
        return ""
    peaks = roof.get("multiply_add_peak_gmac_s")
    if not isinstance(peaks, Mapping) or "error" in peaks:
        reason = peaks.get("error") if isinstance(peaks, Mapping) else None
        return f"Roofline: the multiply-add peak was not measured ({text(reason)})."
    modes = roof.get("modes")
    modes = modes if isinstance(modes, Mapping) else {}
    header = ("base weights", "multiplies", "projections, ms (median pass)", "at the peak, ms",
              "of the peak (median pass)", "(best pass)",
              "base-only: rest, ms", "best possible × fp32", "mixed: rest, ms",
              "best possible × fp32", "products alone × fp32",
              "of the peak the goals need: base-only", "mixed",
              "weights read at the memory's bandwidth, ms")
    kinds = {"fp32": "fp32 FMA", "int8": "int8 × int8"}  # roofline.PEAK_KIND's kinds
    rows = [[_SHOWN.get(str(mode), str(mode)), kinds.get(PEAK_KIND.get(str(mode), ""), str(mode)),
             number(_modes(r).get(mode, {}).get("projections_ms_per_step_median")),
             number(f.get("at_peak_ms")), pct(f.get("of_peak")), pct(f.get("of_peak_best")),
             number(f.get("base_only_rest_ms")), ratio(f.get("base_only_ceiling_vs_fp32")),
             number(f.get("multi_adapter_rest_ms")), ratio(f.get("multi_adapter_ceiling_vs_fp32")),
             ratio(f.get("products_only_vs_fp32")),
             _needs(f, "base_only"), _needs(f, "multi_adapter"), number(f.get("weights_ms"))]
            for mode, f in modes.items() if isinstance(f, Mapping)]
    return paragraphs([
        "Roofline (bench/roofline.py, docs/quantization.md \"The roofline at 32 rows\"): this "
        f"machine's cores multiply-add at {number(peaks.get('fp32'))} G/s in fp32 FMAs, "
        f"{number(peaks.get('int8'))} G/s in int8 × int8 with exact int32 sums (`vpmaddubsw` "
        f"+ `vpmaddwd`, no VNNI) and {number(peaks.get('int16'))} G/s in int16 (`vpmaddwd`), "
        "every thread, measured in registers (lorastream/kernels/cpu/peak.py). A step of "
        f"{text(r.get('prompts'))} rows multiplies "
        f"{number((as_number(roof.get('multiply_adds_per_step')) or 0) / 1e9, 2)} G "
        "multiply-adds in "
        "its projections. At the peak, with the rest of each step as measured in this run (the "
        "median repeat's step less the projections' median pass), a mode's decode could reach "
        "at best the figures below; \"products alone\" is the bound were the rest of every "
        "step zero. The goals: base-only "
        f"{text(r.get('goal_base_only_vs_fp32'))}, mixed {text(r.get('goal_multi_vs_fp32'))}; "
        "the share of the peak a mode's product would need to meet them, with the rest of its "
        "step as measured, is beside them (\"out of reach\": not even a product that took no "
        "time). Reading a mode's weights once at the memory bandwidth measured in this run "
        "takes the last column's time: where that is below the time at the peak, the step's "
        "multiply-adds bound it, not its weight bytes, and fewer bytes gain only what the "
        "product's efficiency gains.",
        table(header, rows)])


def _needs(figures: Mapping[str, object], run: str) -> str:
    """The share of the peak a goal needs (roofline.py), "out of reach", or – (fp32; results
    from before it)."""
    key = f"{run}_goal_needs_of_peak"
    if key not in figures:
        return MISSING
    return "out of reach" if figures[key] is None else pct(figures[key])


def _attention(r: Result, torch_path: bool) -> str:
    """Which decode-attention path the figures ran on, and what the other gave."""
    if not torch_path:
        return ""
    return ("Decode attention ran on the native CPU kernel (`--cpu-kernels`, "
            "lorastream/kernels/cpu/attention.py: the paged cache read in place); the base-only "
            "decode of each mode on torch's path (gathered blocks, then SDPA) is beside it, "
            "measured in the same turns.")


def _where_the_time_goes(r: Result) -> str:
    modes = _modes(r)
    general = (
        "Where the time goes (docs/worker.md, Quantized base weights): a decode step at one row "
        "reads every weight once, so int8 weight-only (the C++ op `int8_weight_mm` where the "
        "CPU ops load, fp32 activations; torch's `aten._weight_int8pack_mm` with bf16 "
        "activations elsewhere) reads a quarter of fp32's bytes there; at 32 rows the fp32 "
        "product is bound by multiply-adds, and weight-only int8 runs the same ones, gaining "
        "only what the smaller weights save. `int8-dynamic` multiplies int8 by int8 (fbgemm on "
        "x86, "
        "`torch._int_mm` elsewhere), at the price of rounding each token's activations to int8 "
        "(after an orthogonal rotation of the input that spreads outlier channels: one C++ op "
        "per projection on the CPU, `lorastream/kernels/cpu/rotation.py`) and of 7-bit weights.")
    step = r.get("fp32_step_ms")
    if not isinstance(step, Mapping):
        return general  # results from before these figures
    spent = ", ".join(f"{_SHOWN.get(mode, mode)} {number(m.get('projections_ms_per_step'))} ms"
                      for mode, m in modes.items())
    return general + (
        f" In this run the fp32 decode step took {number(step.get('base_only'))} ms base-only "
        f"and {number(step.get('multi_adapter'))} ms with the mixed adapters; the base "
        f"projections alone (every layer's and the lm_head over {text(r.get('prompts'))} rows) "
        f"took {spent}." + _rest(r, modes))


def _rest(r: Result, modes: Mapping[str, Mapping[str, object]]) -> str:
    """The base-only step less its projections, per mode: what the projections leave."""
    prompts = as_number(r.get("prompts"))
    parts, noisy = [], []
    for mode, m in modes.items():
        rate = as_number(m.get("base_only_decode_tok_s"))
        projections = as_number(m.get("projections_ms_per_step"))
        if not (prompts and rate and projections is not None):
            continue
        step, shown = 1000 * prompts / rate, _SHOWN.get(mode, mode)
        if step >= projections:
            parts.append(f"{shown} {number(step - projections)} ms")
        else:  # timed apart: the machine's speed moved between the two
            noisy.append(f" {shown[0].upper()}{shown[1:]}'s projections took longer in their "
                         f"separate timing than its whole base-only step ({number(projections)} "
                         f"against {number(step)} ms: the machine's speed moved between the "
                         "two), so its rest is not given.")
    text = (" The rest of a base-only step (its time from the decode rate less the "
            "projections: attention, norms, sampling, the activations' rounding where a mode "
            f"has it) came to {', '.join(parts)}: the projections are what the mode changes, "
            "and the rest is what bounds its speed-up.") if parts else ""
    return text + "".join(noisy)
