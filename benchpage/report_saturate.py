"""The saturating benchmark's section and goal rows on the benchmark page (``bench saturate``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchpage.report_format import (
    Result,
    get,
    goal_row,
    ms,
    number,
    paragraphs,
    pct,
    ratio,
    table,
)


def _label(w: Mapping[str, Any]) -> str:
    count = w.get("adapters")
    return "base only" if not count else f"{count} adapters round-robin"


def saturate_goals(r: Result) -> list[list[str]]:
    goals = r.get("goals") or {}
    rows = []
    for w in r.get("workloads") or []:
        rows.append(goal_row(f"CPU busy at saturation, {_label(w)} (store + worker + gateway)",
                             get(w, "served", "utilisation"), goals.get("utilisation"),
                             percent=True))
        rows.append(goal_row(f"served / engine output tok/s, {_label(w)}",
                             w.get("served_over_engine"), goals.get("served_over_engine")))
    return rows


def saturate_section(r: Result, plots: Mapping[str, str]) -> str:
    c = r.get("config") or {}
    rows = []
    for w in r.get("workloads") or []:
        served, engine = w.get("served") or {}, w.get("engine") or {}
        cpu = served.get("cpu_s") or {}
        rows.append([
            _label(w), number(served.get("output_tok_s")), number(engine.get("output_tok_s")),
            ratio(w.get("served_over_engine")), ms(get(served, "ttft_ms", "p50")),
            ms(get(served, "ttft_ms", "p99")),
            f"{number(cpu.get('store'))} / {number(cpu.get('worker'))} / "
            f"{number(cpu.get('gateway'))}",
            f"{number(served.get('cpu_used_s'))} / {number(served.get('cpu_available_s'))}",
            pct(served.get("utilisation")), pct(served.get("machine_idle_share")),
            number(served.get("other_cpu_s")),
        ])
    header = ("workload", "served tok/s", "engine tok/s", "served / engine", "TTFT p50 (ms)",
              "TTFT p99 (ms)", "CPU-s store / worker / gateway", "CPU-s used / available",
              "CPU busy", "machine idle", "CPU-s of other processes")
    low, high = (c.get("prompt_tokens") or [None, None])[:2]
    return paragraphs([
        f"The stack started as `lorastream up` starts it (store, worker, gateway) and driven "
        f"through the gateway: {number(c.get('requests'), 0)} streaming `POST /v1/completions`, "
        f"{number(c.get('concurrency'), 0)} in flight at a time, prompts of {number(low, 0)}-"
        f"{number(high, 0)} token ids, {number(c.get('new_tokens'), 0)} new tokens each "
        f"(`ignore_eos`, greedy); the engine alone runs the same requests at the same concurrency "
        f"in the same run (built as the worker builds it, no gRPC or HTTP). CPU seconds are "
        f"those of each service over the load window; available is that window times the CPUs "
        f"the benchmark may use. 'machine idle' is the whole machine's idle share over the "
        f"window: other processes lower it, never raise it, so an idle share above a third "
        f"means the stack left cores unused (the slow test `tests/bench/test_saturate_guard.py` "
        f"fails then).",
        table(header, rows),
        "What this caught: the worker's gRPC request threads called "
        "`torch.set_num_threads(1)`, which also sets torch's process-wide count; the C++ CPU ops' "
        "first parallel loop on the engine's thread adopted that count, and every later step ran "
        "on one of the two cores. `bench engine` has no request threads and never saw it. Request "
        "and loader threads now set only their own OpenMP thread count "
        "(`lorastream/worker/device/device.py`).",
    ])
