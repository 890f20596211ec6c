"""The structured-output benchmark's section and goal row on the benchmark page."""

from __future__ import annotations

from collections.abc import Mapping

from benchpage.report_format import Result, number, paragraphs, table


def grammar_goals(r: Result) -> list[list[str]]:
    """No numeric goal: the issue asks to pick the engine on measured cost; the row says which."""
    summary = r.get("summary") or {}
    chosen = r.get("chosen", "?")
    parts = [f"{key}: {number(v.get('fill_us_mean'), 1)} µs/step, "
             f"{number(v.get('compile_ms'), 2)} ms compile"
             for key, v in summary.items() if isinstance(v, Mapping)]
    return [["structured-output engine (bitmask per constrained row per step; compile)",
             "; ".join(parts) or "—", f"chosen: {chosen}", "measured"]]


def grammar_section(r: Result, plots: Mapping[str, str]) -> str:
    rows = [
        [row.get("model"), number(row.get("vocab"), 0), row.get("case"), row.get("engine"),
         number(row.get("tokens"), 0), number(row.get("compile_ms"), 2),
         number(row.get("fill_us_p50"), 1), number(row.get("fill_us_p90"), 1),
         number(row.get("fill_us_mean"), 1), number(row.get("setup_s"), 2)]
        for row in r.get("rows") or []
    ]
    header = ("tokenizer", "vocab", "constraint", "engine", "tokens", "compile (ms)",
              "bitmask p50 (µs)", "bitmask p90 (µs)", "bitmask mean (µs)",
              "tokenizer setup (s)")
    return paragraphs([
        "What a constrained request adds to the worker: compiling its constraint once (on the "
        "request path, uncached here), then one next-token bitmask per decode step. Both "
        "engines walk the same valid output token by token, single-threaded, compact JSON.",
        table(header, rows),
        _verdict(r.get("summary") or {}),
    ])


def _verdict(summary: Mapping[str, object]) -> str:
    """The comparison in words, from the measured means (llguidance vs xgrammar per tokenizer)."""
    lines = []
    for key, ll in summary.items():
        engine, _, model = key.partition("@")
        xg = summary.get(f"xgrammar@{model}")
        if engine != "llguidance" or not isinstance(ll, Mapping) or not isinstance(xg, Mapping):
            continue
        fill, xfill = ll.get("fill_us_mean"), xg.get("fill_us_mean")
        comp, xcomp = ll.get("compile_ms"), xg.get("compile_ms")
        if not all(isinstance(v, int | float) and v > 0 for v in (fill, xfill, comp, xcomp)):
            continue
        lines.append(
            f"{model}: xgrammar fills a bitmask {fill / xfill:.1f}x faster "  # type: ignore[operator]  # numbers: checked just above
            f"(a batch of 32 constrained rows: {32 * fill / 1e3:.2f} ms per step with llguidance, "  # type: ignore[operator]  # numbers: checked just above
            f"{32 * xfill / 1e3:.2f} ms with xgrammar); llguidance compiles "  # type: ignore[operator]  # numbers: checked just above
            f"{xcomp / comp:.1f}x faster ({comp:.2f} vs {xcomp:.2f} ms per new constraint)."  # type: ignore[operator]  # numbers: checked just above
        )
    return " ".join(lines) + (
        " The worker uses llguidance: both bitmask costs are small beside a decode step of tens "
        "of milliseconds on this CPU, while the compile is paid before the first token of every "
        "request with a new schema (every tool call), and llguidance has no dependencies where "
        "xgrammar brings triton and apache-tvm-ffi into the runtime. xgrammar is installed only "
        "for this comparison (the bench extra)."
    )
