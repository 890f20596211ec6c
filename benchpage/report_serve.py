"""The serve benchmark's section of the benchmark page and its goal rows (``bench serve``).

Every figure here is read from (or computed from) the result JSON; the prose around them is fixed
text that explains what is measured and why the numbers come out as they do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchpage.report_format import (
    GOALS_HEADER,
    MISSING,
    Goal,
    Result,
    as_number,
    get,
    goal_row,
    ms,
    number,
    paragraphs,
    plot_image,
    ratio,
    table,
    text,
)


def serve_goals(r: Result) -> list[list[str]]:
    rows = [
        goal_row("serve TTFT p50, overlap on / off", r.get("ttft_p50_on_vs_off"),
                 r.get("goal_ttft_p50_on_vs_off")),
        goal_row("serve ITL p99 of running streams, during loads / none (overlap on)",
                 r.get("itl_p99_during_loads_vs_none_overlap_on"), r.get("goal_itl_p99_ratio")),
    ]
    if "goal_cold_ttft_ratio" in r:  # results from before the cold probe had a goal have none
        rows.append(goal_row(
            "serve cold TTFT / (link time + resident TTFT), same run as the ITL (overlap on)",
            r.get("cold_ttft_vs_link_plus_resident_overlap_on"), r.get("goal_cold_ttft_ratio")))
    burst, link = r.get("cold_burst") or {}, r.get("cold_link") or {}
    for label, part, key, goal in (
        ("burst: resident TTFT p50, overlap on / off", burst, "resident_ttft_p50_on_vs_off",
         "goal_resident_ttft_p50_on_vs_off"),
        ("burst: cold TTFT p50, overlap on / off", burst, "cold_ttft_p50_on_vs_off",
         "goal_cold_ttft_p50_on_vs_off"),
        ("burst: running stream's worst gap, during / before (on)", burst,
         "worst_gap_during_vs_before_on", "goal_worst_gap_ratio"),
        ("burst: running stream's worst gap, during / same burst all resident (on)", burst,
         "worst_gap_during_vs_resident_burst_on", "goal_worst_gap_vs_resident_burst"),
        ("link: cold TTFT / (link + resident TTFT), p50 (on)", link,
         "cold_vs_link_plus_resident_p50_on", "goal_cold_vs_link_plus_resident"),
        ("link: streams' ITL p99, during loads / none (on)", link, "itl_p99_ratio_on",
         "goal_itl_p99_ratio"),
        ("link: streams' ITL p99, during loads / same request resident (on)", link,
         "itl_p99_during_loads_vs_resident_requests_on", "goal_itl_p99_vs_resident_requests"),
    ):
        if part and goal in part:  # results from before a goal existed have none
            rows.append(goal_row(label, part.get(key), part.get(goal)))
    return rows


def _cold_modes(part: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, column label) of the modes a cold workload ran, in the order it ran them."""
    shares = [key for key in part if key.startswith("overlap_on_share_")]
    return [("overlap_on", "overlap on"),
            *((key, f"on, --load-share {key.removeprefix('overlap_on_share_')}")
              for key in shares),
            ("overlap_off", "overlap off")]
_PHASES = ("resolve", "queue", "stream", "checksum", "landing", "handoff", "slot_copy",
           "admission", "total")


def cold_section(r: Result, plots: Mapping[str, str]) -> str:
    """The burst and link-limited workloads (``serve_cold.py``): three modes side by side, and
    where each mode's cold loads spent their time."""
    burst, link = r.get("cold_burst"), r.get("cold_link")
    if not burst and not link:
        return ""
    cold_modes = _cold_modes(burst or link or {})
    header = ["", *(label for _, label in cold_modes)]

    def row(part: Any, label: str, *keys: str, fmt: Any = ms) -> list[str]:
        return [label, *(fmt(get(part, mode, *keys)) for mode, _ in cold_modes)]

    def phase_rows(part: Any) -> list[list[str]]:
        def cell(mode: str, phase: str) -> str:
            wall, cpu = get(part, mode, "load_phases", phase, "wall_ms"), get(
                part, mode, "load_phases", phase, "cpu_ms")
            return ms(wall) if cpu is None else f"{ms(wall)} (CPU {ms(cpu)})"
        return [[f"cold load: {phase} (ms)", *(cell(m, phase) for m, _ in cold_modes)]
                for phase in _PHASES]

    parts = [
        "**Cold adapters on a busy CPU worker** (issue 57; `lorastream/bench/serve_cold.py`). "
        "Each workload runs its worker once per mode: overlap on with the defaults, overlap on "
        "with other `--load-share` values (at 0 a cold request's fetch gets only what decoding "
        "leaves), and overlap off. The phase rows are the per-load means of the worker's "
        "`lorastream_worker_cold_load_phase_seconds` (docs/loading.md): wall time, and in "
        "brackets the CPU time of what computes in that phase. The controls (the same burst "
        "with every adapter resident; the same request with its adapter resident) prefill what "
        "the cold requests prefilled (the prefix cache is reset before them), so against them "
        "only the loads' cost remains; each control against the windows with no request "
        "arriving is the floor that no load schedule goes under: the requests' own prefill "
        "steps, not the loads, set the running streams' worst gaps.",
    ]
    if burst:
        parts += [
            "Burst: one stream decodes on a resident adapter; then "
            f"{text(get(burst, 'overlap_on', 'cold_requests'))} cold adapters and "
            f"{text(get(burst, 'overlap_on', 'resident_requests'))} requests for the resident "
            "one arrive at once (store at loopback speed).",
            table(header, [
                row(burst, "resident TTFT p50 (ms)", "resident_ttft_ms", "p50"),
                row(burst, "resident TTFT p50, same burst all resident (ms)",
                    "resident_ttft_ms_resident_burst", "p50"),
                row(burst, "resident TTFT, burst / same burst all resident",
                    "resident_ttft_p50_vs_resident_burst", fmt=ratio),
                row(burst, "cold TTFT p50 (ms)", "cold_ttft_ms", "p50"),
                row(burst, "cold TTFT p90 (ms)", "cold_ttft_ms", "p90"),
                row(burst, "running stream's worst gap before (ms)", "worst_gap_ms_before"),
                row(burst, "running stream's worst gap during (ms)", "worst_gap_ms_during"),
                row(burst, "worst gap, during / before", "worst_gap_ratio", fmt=ratio),
                row(burst, "worst gap, same burst all resident (ms)",
                    "worst_gap_ms_during_resident_burst"),
                row(burst, "worst gap, during / same burst all resident",
                    "worst_gap_during_vs_resident_burst", fmt=ratio),
                row(burst, "worst gap, same burst all resident / before (no load: the floor)",
                    "worst_gap_resident_burst_vs_before", fmt=ratio),
                *phase_rows(burst),
            ]),
        ]
    if link:
        parts += [
            f"Link-limited: {text(get(link, 'overlap_on', 'rounds'))} cold adapters, one at a "
            f"time, from the store behind its capped link ({ms(link.get('link_ms'))} ms per "
            "adapter), while base-model streams decode.",
            table(header, [
                row(link, "cold TTFT p50 (ms)", "cold_ttft_ms", "p50"),
                row(link, "resident TTFT p50 (ms)", "resident_ttft_ms", "p50"),
                row(link, "cold / (link + resident TTFT), p50", "cold_vs_link_plus_resident_p50",
                    fmt=ratio),
                row(link, "streams' ITL p99, no loads (ms)", "itl_p99_ms_no_loads"),
                row(link, "streams' ITL p99, during loads (ms)", "itl_p99_ms_during_loads"),
                row(link, "ITL p99, during / none", "itl_p99_ratio", fmt=ratio),
                row(link, "streams' ITL p99, request for a resident adapter (ms)",
                    "itl_p99_ms_resident_requests"),
                row(link, "ITL p99, during loads / resident request",
                    "itl_p99_during_loads_vs_resident_requests", fmt=ratio),
                row(link, "ITL p99, resident request / none (no load: the floor)",
                    "itl_p99_resident_requests_vs_none", fmt=ratio),
                row(link, "streams' ITL p50, no loads (ms)", "itl_ms", "no_loads", "p50"),
                row(link, "streams' ITL p50, during loads (ms)", "itl_ms", "during_loads",
                    "p50"),
                *phase_rows(link),
            ]),
        ]
    parts.append(plot_image(plots, "serve_cold", "cold requests' TTFT CDFs per mode"))
    return paragraphs(parts)


def serve_section(r: Result, plots: Mapping[str, str]) -> str:
    c = r.get("config") or {}
    modes = ("overlap_on", "overlap_off")

    def row(label: str, *keys: str, fmt: Any = ms) -> list[str]:
        return [label, *(fmt(get(r, mode, *keys)) for mode in modes)]

    def errors(mode: str) -> str:
        trace = get(r, mode, "trace") or {}
        return f"{text(trace.get('errors'))} / {text(trace.get('requests'))}"

    rows = [
        *(row(f"TTFT {p} (ms)", "trace", "ttft_ms", p) for p in ("p50", "p90", "p99")),
        row("TTFT p50, first request for its adapter (ms)", "trace", "ttft_ms_first_use", "p50"),
        row("TTFT p50, adapter asked for before (ms)", "trace", "ttft_ms_repeat", "p50"),
        *(row(f"ITL {p} (ms)", "trace", "itl_ms", p) for p in ("p50", "p99")),
        *(row(f"end-to-end {p} (ms)", "trace", "e2e_ms", p) for p in ("p50", "p99")),
        row("throughput (tok/s)", "trace", "throughput_tok_s", fmt=number),
        row("throughput (req/s)", "trace", "throughput_req_s", fmt=lambda v: number(v, 2)),
        ["errors / requests", *(errors(m) for m in modes)],
        row("running streams' ITL p50, no loads (ms)", "interference", "itl_ms_no_loads", "p50"),
        row("running streams' ITL p50, during loads (ms)", "interference",
            "itl_ms_during_loads", "p50"),
        row("running streams' ITL p99, no loads (ms)", "interference", "itl_p99_ms_no_loads"),
        row("running streams' ITL p99, during loads (ms)", "interference",
            "itl_p99_ms_during_loads"),
        row("adapter loads during the interference part", "interference", "loads",
            fmt=lambda v: number(v, 0)),
        row("cold probe: TTFT, adapter not loaded (ms)", "cold_probe", "cold_ttft_ms"),
        row("cold probe: LoadAdapter, store fetch + copy (ms)", "cold_probe", "load_ms"),
        row("cold probe: TTFT, adapter resident (ms)", "cold_probe", "warm_ttft_ms"),
        row("cold probe: the adapter's link time (ms)", "cold_probe", "link_ms"),
        row("cold probe: TTFT / (link time + resident TTFT)", "cold_probe",
            "cold_vs_link_plus_warm", fmt=ratio),
        row("cold probe: loaders' CPU per load, store + fetch process (ms)", "cold_probe",
            "loader_cpu_ms_per_load"),
        row("worker peak RSS (MB)", "worker_peak_rss_mb", fmt=lambda v: number(v, 0)),
        *(row(f"worker budget: {label} (MB)", "worker_budgets_mb", key,
              fmt=lambda v: number(v, 0))
          for key, label in (("host_adapters", "host adapter memory (--host-cache-bytes)"),
                             ("device_slots", "device slots (--max-loras)"),
                             ("kv_cache", "KV cache (--kv-cache-bytes)"))),
    ]
    parts = [
        f"Model {text(c.get('model'))}; {text(c.get('adapters'))} adapters of rank "
        f"{text(c.get('rank'))} in the store, {text(c.get('slots'))} device slots; "
        f"{text(c.get('requests'))} requests arriving as a Poisson process at "
        f"{text(c.get('rate'))} req/s, adapters drawn by {text(c.get('popularity'))}; "
        f"{text(c.get('max_tokens'))} tokens each. {_link(c)} The store process runs at idle "
        "CPU priority (SCHED_IDLE): in a deployment it is another machine. The worker restarts "
        "between modes, so every adapter starts cold. The interference part runs "
        f"{text(c.get('background'))} long base-model streams and measures their inter-token "
        "latency in windows without loads and windows while adapters are loaded one after "
        f"another, taking turns: {text(c.get('interference_rounds', 2))} rounds of "
        f"{text(c.get('window_s', MISSING))} s each.",
        table(["", "overlap on", "overlap off"], rows),
        table(GOALS_HEADER, serve_goals(r)),
        plot_image(plots, "serve_cdf", "TTFT and ITL CDFs, overlap on vs off"),
        plot_image(plots, "serve_interference", "ITL of running streams with and without loads"),
        "With overlapped loading on, a request for a cold adapter does not stall the batch: the "
        "adapter is fetched from the store (by the worker's fetch process) and copied into a slot "
        "(by its load stream), both at idle CPU priority, while the running streams keep "
        "decoding, and "
        "the request is admitted when its adapter is resident. With it off, the load happens "
        "inside the step.",
        _cpu_measures_explained(r),
        _first_use_explained(r),
        _cold_probe_explained(r, c),
        _loader_budget_explained(r),
        cold_section(r, plots),
    ]
    return paragraphs(parts)


_MEASURE_ROWS = (  # (result key, row label): the worker as run, then one CPU measure changed
    ("", "defaults"),
    ("copies_beside_steps", "copies beside the steps (--copy-turn-ms 0)"),
    ("compute_threads_unbound", "threads placed by the kernel (--no-bind-compute-threads)"),
    ("fetch_turns_2ms", "fetch turns of 2 ms (--fetch-turn-ms 2)"),
    ("layered_admission", "layered admission (--layered-admission)"),
)


def _cpu_measures_explained(r: Result) -> str:
    rows = []
    for key, label in _MEASURE_ROWS:
        run = get(r, key or "overlap_on") or {}
        x, probe = run.get("interference") or {}, run.get("cold_probe") or {}
        if x:
            rows.append([label, number(x.get("loads"), 0), number(x.get("load_seconds")),
                         ms(get(x, "itl_ms_no_loads", "p50")),
                         ms(get(x, "itl_ms_during_loads", "p50")),
                         ms(x.get("itl_p99_ms_no_loads")), ms(x.get("itl_p99_ms_during_loads")),
                         ratio(x.get("itl_p99_ratio")), ms(probe.get("cold_ttft_ms")),
                         ratio(probe.get("cold_vs_link_plus_warm")),
                         ms(probe.get("load_ms"))])
    if len(rows) < 2:
        return ""
    return paragraphs([
        "**What the worker does so that loads leave the decode its cores.** On a GPU the load "
        "stream's copies are DMA and the decode runs on the device; on the CPU both are work "
        "for the same two cores, and a decode step runs its ops on two OpenMP threads that wait "
        "for each other after every op, so whatever either loses stalls both. Two measures, on "
        "by default: copies into the slots take turns with the steps, at most `--copy-turn-ms` "
        "per gap (lorastream/worker/device/cpu/step_gate.py); and the two compute threads are "
        "bound "
        "one per core, so that a thread pushed aside by other work waits for its own core instead "
        "of sharing its partner's while the adapter fetch, at idle priority, holds the core it "
        "left (lorastream/worker/device/cpu/binding.py). A third is off by default: fetch turns, "
        "where the engine leaves the cores to a store fetch in flight for `--fetch-turn-ms` "
        "before each step, since an engine stepping back to back leaves an idle-priority fetch "
        "almost no CPU (step_gate.py); loads land sooner, the running streams pay for it. The "
        "same run, overlap on, once more with each changed (cold probe: a request for a cold "
        "adapter while the streams decode, and LoadAdapter of one):",
        table(["CPU measures", "loads", "loading windows (s)", "ITL p50, no loads (ms)",
               "ITL p50, loads (ms)", "ITL p99, no loads (ms)", "ITL p99, loads (ms)",
               "p99 ratio", "cold probe TTFT (ms)", "cold / (link + resident)",
               "cold probe load (ms)"], rows),
        "Loads are back to back in the loading windows, so the loads column is how fast "
        "adapters reach their slots while the batch decodes: the fetch and the store run at "
        "idle priority on the time the decode leaves. The ITL p99 ratio moves from run to run "
        "on this machine (one run per row here), the loads column by more.",
    ])


def _first_use_explained(r: Result) -> str:
    first = as_number(get(r, "overlap_on", "trace", "first_use_requests"))
    requests = as_number(get(r, "overlap_on", "trace", "requests"))
    if first is None or not requests:
        return ""
    return (
        f"**Where the TTFT p50 falls.** {number(first, 0)} of the {number(requests, 0)} "
        f"requests ({first / requests:.0%}) are the first to name their adapter: they wait for "
        "its store fetch in either mode. The others find it in a slot, in host memory or on its "
        "way. With overlap on, the requests asked for before no longer wait for other adapters' "
        "loads, which is where its TTFT gain comes from. A first request can wait longer with "
        "overlap on: its fetch then gets only the CPU time decoding leaves (and its fetch turns, "
        "if on), where with overlap off it has the cores while every other request waits. The "
        "overall p50 lies near the "
        "boundary between the two groups, so it moves more from run to run than either group's."
    )


def _cold_probe_explained(r: Result, c: Mapping[str, Any]) -> str:
    probe = get(r, "overlap_on", "cold_probe") or {}
    cold, load, warm = (as_number(probe.get(k)) for k in ("cold_ttft_ms", "load_ms",
                                                          "warm_ttft_ms"))
    if cold is None or load is None or warm is None:
        return ""
    return (
        f"**What a cold request waits for.** The cold probe asks, while "
        f"{text(c.get('background'))} base-model streams decode, for adapters no trace request "
        f"names. With overlap on, a cold request's first token came after {ms(cold)} ms: the "
        f"adapter's store fetch and copy into a slot take {ms(load)} ms (LoadAdapter), and a "
        f"request whose adapter is resident waits {ms(warm)} ms (the step in progress, then its "
        f"prefill step), {ms(load + warm)} ms together. The load starts when the request "
        "arrives and the copy as soon as the last chunk landed, so the load itself is the only "
        "wait left. It is bounded by the store link and, on a CPU, by the CPU time decoding "
        "leaves the idle-priority fetch, which is little while streams decode back to back."
        + _fetch_turns_probe(r) + _layer_order_bound(cold, load) + _layered_probe(r, cold)
    ) + (
        " TTFT with overlap falls below half of TTFT without it only where loads stall the batch "
        "long enough to double the wait of the requests behind them, which this trace's load "
        "does not do." if (as_number(r.get("ttft_p50_on_vs_off")) or 0) > 0.5 else ""
    )


def _loader_budget_explained(r: Result) -> str:
    """The CPU arithmetic behind the two goals of the cold probe and the interference part."""
    probe = get(r, "overlap_on", "cold_probe") or {}
    cpu, link = as_number(probe.get("loader_cpu_ms_per_load")), as_number(probe.get("link_ms"))
    cores = as_number(get(r, "machine", "usable_cores")) or 2
    if not cpu or not link:
        return ""
    share = cpu / link / cores
    goal = Goal.parse(r.get("goal_itl_p99_ratio"))
    allowed = f"{goal.threshold - 1:.0%}" if goal is not None else MISSING
    return (
        f"**What a load at link speed costs the decode here.** The loaders (the store, which on "
        f"this box shares the worker's cores, and the worker's fetch process) spent {ms(cpu)} ms "
        f"of CPU per load of the probe's adapter, whose link time is {ms(link)} ms: to land at "
        f"link speed they need {share:.0%} of the machine's {number(cores, 0)} cores for that "
        "long, taken from decode steps that otherwise keep both cores busy. A step that loses "
        f"that share runs {1 / (1 - min(share, 0.99)) - 1:.0%} longer, where the interference "
        f"goal allows {allowed} at the p99. Most of the loaders' CPU is gRPC's own per-byte work "
        "on both ends of the stream, not the landing and checksums (docs/loading.md, \"Cold "
        "adapters on a CPU\"). The worker leaves the loaders what decoding leaves (and fetch "
        "turns, if asked for: the table above), so the two goals hold together only as far as "
        "that share suffices; holding both in every run needs fewer CPU cycles per byte on the "
        "loaders' side."
    )


def _layer_order_bound(cold: float, load: float) -> str:
    """What layer-ordered admission could win at most, from the cold probe's figures."""
    tail = cold - load
    if tail <= 0:
        return ""
    return (
        " Layer-ordered admission (`--layered-admission`: a cold request's prefill runs each "
        "layer of its adapter as that layer lands, between the steps) can hide at most what "
        f"follows the load, cold TTFT less LoadAdapter, {ms(tail)} ms here (the copy into the "
        f"slot, the step in progress, the prefill step), {tail / cold:.0%} of the cold TTFT."
    )


def _layered_probe(r: Result, cold: float) -> str:
    """The cold probe with layer-ordered admission on, against the defaults' (``cold``)."""
    probe = get(r, "layered_admission", "cold_probe") or {}
    layered, load = as_number(probe.get("cold_ttft_ms")), as_number(probe.get("load_ms"))
    if layered is None or load is None:
        return ""
    verdict = ("faster in this run; it stays off by default because the gain has not held "
               "from run to run (docs/loading.md, Layer-ordered admission)"
               if layered < 0.95 * cold else
               "no gain beyond the run-to-run spread here, so it stays off by default")
    ratio = as_number(get(r, "layered_admission", "interference", "itl_p99_ratio"))
    cost = (f" The running streams' ITL p99 ratio during loads was {ratio:.2f}× with it on."
            if ratio is not None else "")
    return (
        f" With it on (the table above), the same probe's first token came after {ms(layered)} "
        f"ms against {ms(cold)} ms with the defaults ({layered / cold:.2f}x; LoadAdapter "
        f"{ms(load)} ms): {verdict}. The layers that landed are prefilled between the decode "
        f"steps, so the running streams never wait for a layer.{cost}"
    )


def _fetch_turns_probe(r: Result) -> str:
    probe = get(r, "fetch_turns_2ms", "cold_probe") or {}
    cold, load = as_number(probe.get("cold_ttft_ms")), as_number(probe.get("load_ms"))
    if cold is None or load is None:
        return ""
    return (f" With fetch turns of 2 ms (the table above) the same probe's first token came "
            f"after {ms(cold)} ms and LoadAdapter took {ms(load)} ms.")


def _link(c: Mapping[str, Any]) -> str:
    mbps = as_number(c.get("store_link_mbps"))
    if not mbps:
        return "The store streams at loopback speed."
    burst = as_number(c.get("store_link_burst_bytes"))
    banked = (f" The link banks up to {number(burst / 2**20, 0)} MiB of time the store spent off "
              "the CPU, as a real link drains a socket's send buffer meanwhile."
              if burst else "")
    return (f"The store's egress is capped at {number(mbps, 0)} MB/s ({number(mbps * 8 / 1000, 1)} "
            "Gb/s), standing in for the network between store and worker: on loopback the "
            f"transfer would otherwise run at memory speed on the worker's own cores.{banked}")
