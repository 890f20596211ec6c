"""The registry benchmark's section and goal row on the benchmark page."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from benchpage.report_format import Result, goal_row, ms, number, paragraphs, ratio, table


def registry_goals(r: Result) -> list[list[str]]:
    rows = [goal_row(f"store registrations/s, fastest / slowest{_span(r)}",  # SQLite registry
                     r.get("registrations_per_s_spread"), r.get("goal"), digits=3)]
    rpc = _rpc(r)
    if rpc:
        rows.append(goal_row(f"PreloadAdapter registrations/s, fastest / slowest{_span(rpc)}",
                             rpc.get("registrations_per_s_spread"), rpc.get("goal"), digits=3))
        seq = _mapping(rpc.get("sequence"))
        if seq:
            rows.append(goal_row(
                f"PreloadAdapter p50, last / first {number(seq.get('fifth'), 0)} of "
                f"{number(seq.get('adapters'), 0)} in a row",
                seq.get("last_over_first"), seq.get("goal"), digits=3))
    return rows


def _span(r: Mapping[str, object]) -> str:
    counts = [_mapping(p).get("names") for p in _sequence(r.get("points"))]
    return f", {number(counts[0], 0)} → {number(counts[-1], 0)} names" if counts else ""


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _sequence(value: object) -> Sequence[object]:
    return value if isinstance(value, Sequence) and not isinstance(value, str) else ()


def _rpc(r: Result) -> Mapping[str, object]:
    return _mapping(r.get("rpc"))


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
        *rpc_paragraphs(_rpc(r)),
    ])


def rpc_paragraphs(rpc: Mapping[str, object]) -> list[str]:
    """The same counts through the store's PreloadAdapter RPC (``registry_rpc.py``)."""
    if not rpc:
        return []
    rows = [[number(p.get("names"), 0), number(p.get("registrations_per_s"), 1),
             ms_3(p, "rpc", "p50_ms"), ms_3(p, "rpc", "p99_ms"), number(p.get("fill_s"), 1)]
            for p in map(_mapping, _sequence(rpc.get("points")))]
    seq = _mapping(rpc.get("sequence"))
    sequence = (
        f" One after another into an empty store, {number(seq.get('adapters'), 0)} preloads: "
        f"the first {number(seq.get('fifth'), 0)} took {number(seq.get('first_p50_ms'), 1)} ms "
        f"each (median), the last {number(seq.get('fifth'), 0)} "
        f"{number(seq.get('last_p50_ms'), 1)} ms ({ratio(seq.get('last_over_first'), 2)}; "
        "goal: within 1.2×)." if seq else ""
    )
    return [
        "The same counts end to end, through the store's `PreloadAdapter` RPC: a store server "
        "on loopback (local source, no worker) holding N distinct adapters (filled through the "
        f"store core: {rpc.get('fill')}), and a distinct tiny adapter (one float of `lora_B` "
        "changed) preloaded each time, timed from the request to the stream's last event: "
        "resolve, copy, validate, hash, fsync, commit and register.",
        table(("names staged", "PreloadAdapter registrations/s", "p50 (ms)", "p99 (ms)",
               "fill (s)"), rows),
        f"Across the counts the fastest is {ratio(rpc.get('registrations_per_s_spread'), 3)} "
        f"the slowest (goal: flat within 20%).{sequence} Before, every staging "
        "grouped every name and version in SQLite to order the disk budget's eviction, even "
        "when the adapter fitted, so registrations slowed as names accumulated; the registry "
        "now keeps that order as it changes (`lorastream/store/content_use.py`).",
    ]


def ms_3(point: Mapping[str, object], scheme: str, key: str) -> str:
    return number(_get(point, scheme, key), 3)


def _get(point: Mapping[str, object], scheme: str, key: str) -> object:
    values = point.get(scheme)
    return values.get(key) if isinstance(values, Mapping) else None
