"""The registry benchmark's section and goal row on the benchmark page."""

from __future__ import annotations

from collections.abc import Mapping

from lorastream.bench.report_format import Result, goal_row, ms, number, paragraphs, ratio, table


def registry_goals(r: Result) -> list[list[str]]:
    counts = [p.get("names") for p in r.get("points") or []]
    span = f", {number(counts[0], 0)} → {number(counts[-1], 0)} names" if counts else ""
    return [goal_row(f"store registrations/s, fastest / slowest{span}",
                     r.get("registrations_per_s_spread"), r.get("goal"), digits=3)]


def registry_section(r: Result, plots: Mapping[str, str]) -> str:
    rows = [
        [number(p.get("names"), 0), number(p.get("registrations_per_s"), 0),
         ms_3(p, "sqlite", "p50_ms"), ms_3(p, "sqlite", "p99_ms"),
         number(p.get("json_registrations_per_s"), 1),
         ms(_get(p, "json_rewrite", "p50_ms")), ms_3(p, "list_page_ms", "p50_ms")]
        for p in r.get("points") or []
    ]
    header = ("names registered", "SQLite registrations/s", "SQLite p50 (ms)", "SQLite p99 (ms)",
              "JSON rewrite registrations/s", "JSON rewrite p50 (ms)",
              "ListAdapters page of 1000, p50 (ms)")
    return paragraphs([
        "Registering one more adapter when the store already holds N names: the store's "
        "registry (SQLite, WAL, `synchronous=FULL`, one transaction per registration) beside "
        "the `registry.json` it replaced, which was rewritten, fsynced and renamed whole on "
        "every registration; both in the same run, at the same N, on the same disk.",
        table(header, rows),
        f"Across the counts the fastest SQLite registrations/s is "
        f"{ratio(r.get('registrations_per_s_spread'), 3)} the slowest (goal: flat within 20%); "
        f"from the smallest to the largest N its median changes "
        f"{ratio(r.get('sqlite_p50_growth'))}, the JSON rewrite's grows "
        f"{ratio(r.get('json_rewrite_p50_growth'), 0)}. A registration costs one small append "
        "to the write-ahead log and its fsync, whatever N is; the JSON file grew with N and so "
        "did each rewrite. The absolute figures follow the disk's fsync latency.",
    ])


def ms_3(point: Mapping[str, object], scheme: str, key: str) -> str:
    return number(_get(point, scheme, key), 3)


def _get(point: Mapping[str, object], scheme: str, key: str) -> object:
    values = point.get(scheme)
    return values.get(key) if isinstance(values, Mapping) else None
