"""The MoE serve benchmark's section of the benchmark page and its goal rows (``bench serve
--model <MoE checkpoint> --parts loads``, ``serve-moe.json``): running streams' ITL while
expert-LoRA adapters load cold, overlap on and off."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchpage.report_format import (
    GOALS_HEADER,
    Result,
    get,
    goal_row,
    ms,
    number,
    paragraphs,
    ratio,
    table,
    text,
)

MODES = ("overlap_on", "overlap_off")


def serve_moe_goals(r: Result) -> list[list[str]]:
    return [goal_row("serve (MoE base) ITL p99 of running streams, cold expert-LoRA loads / "
                     "none (overlap on)",
                     r.get("itl_p99_during_loads_vs_none_overlap_on"), r.get("goal_itl_p99_ratio"))]


def serve_moe_section(r: Result, plots: Mapping[str, str]) -> str:
    c, base = r.get("config") or {}, r.get("base") or {}

    def row(label: str, *keys: str, fmt: Any = ms) -> list[str]:
        return [label, *(fmt(get(r, mode, *keys)) for mode in MODES)]

    def whole(value: object) -> str:
        return number(value, 0)

    rows = [
        row("running streams' ITL p50, no loads (ms)", "interference", "itl_ms_no_loads", "p50"),
        row("running streams' ITL p50, during loads (ms)", "interference",
            "itl_ms_during_loads", "p50"),
        row("running streams' ITL p99, no loads (ms)", "interference", "itl_p99_ms_no_loads"),
        row("running streams' ITL p99, during loads (ms)", "interference",
            "itl_p99_ms_during_loads"),
        row("ITL p99, during loads / none", "interference", "itl_p99_ratio", fmt=ratio),
        row("cold adapter loads during the windows", "interference", "loads", fmt=whole),
        row("cold probe: LoadAdapter, store fetch + copy (ms)", "cold_probe", "load_ms"),
        row("cold probe: the adapter's link time (ms)", "cold_probe", "link_ms"),
        row("cold probe: TTFT, adapter not loaded (ms)", "cold_probe", "cold_ttft_ms"),
        row("cold probe: TTFT, adapter resident (ms)", "cold_probe", "warm_ttft_ms"),
        row("worker peak RSS (MB)", "worker_peak_rss_mb", fmt=whole),
        row("host adapter budget (MB)", "worker_budgets_mb", "host_adapters", fmt=whole),
        row("device slots, projections (MB)", "device_slot_mb_by_part", "projections",
            fmt=whole),
        row("device slots, experts (MB)", "device_slot_mb_by_part", "experts", fmt=whole),
    ]
    return paragraphs([
        f"Model {text(c.get('model'))}: {text(base.get('family'))}, "
        f"{text(base.get('layers'))} layers, hidden {text(base.get('hidden'))}, "
        f"{text(base.get('experts'))} experts of width {text(base.get('expert_intermediate'))}"
        f" (top {text(base.get('experts_per_token'))}). {text(c.get('adapters'))} adapters in "
        f"the store, each LoRA of rank {text(c.get('rank'))} on q/k/v/o and on every routed "
        f"expert (PEFT's fused `target_parameters`): {number(r.get('adapter_mb'), 0)} MB each; "
        f"{text(c.get('slots'))} device slots. The store's egress is capped at "
        f"{text(c.get('store_link_mbps'))} MB/s. {text(c.get('background'))} long base-model "
        "streams decode while the benchmark takes turns between a window without loads and a "
        "window of LoadAdapter calls one after another, cycling through more adapters than "
        "the host budget holds, so every load fetches from the store: "
        f"{text(c.get('interference_rounds'))} rounds of {text(c.get('window_s'))} s. The "
        "worker restarts between modes, overlapped loading on and off, on the same store. "
        "The machine's 1-minute load average was "
        f"{number(r.get('load_average_1m_at_start'), 2)} at the start and "
        f"{number(r.get('load_average_1m_at_end'), 2)} at the end (shared).",
        table(["", "overlap on", "overlap off"], rows),
        table(GOALS_HEADER, serve_moe_goals(r)),
        "An expert LoRA is sized in bytes like any adapter: the host budget holds its whole "
        "manifest, and every device slot reserves storage for every expert at the worker's "
        "`--max-lora-rank` (the experts row). With overlap on, the fetch and the slot copy run "
        "beside the decode steps (docs/loading.md).",
    ])
