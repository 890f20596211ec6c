"""The pool routing benchmark's section and goal rows on the benchmark page (``bench pool``)."""

from __future__ import annotations

from collections.abc import Mapping

from benchpage.report_format import (
    MISSING,
    Goal,
    Result,
    get,
    ms,
    number,
    paragraphs,
    pct,
    table,
    text,
    verdict,
)

POLICY_LABELS = {
    "picker": "endpoint picker, running = held (slot or host memory; the default)",
    "picker-device": "endpoint picker, running = in a slot (--picker-running device)",
    "random": "random",
    "gateway": "lorastream gateway",
}


def _goal(label: str, value: object, goal_text: object, unit: str) -> list[str]:
    """``[label, value, target, verdict]`` with the unit written out (points, ms)."""
    goal = Goal.parse(goal_text)
    shown = number(value, 1, f" {unit}")
    if goal is None:
        return [label, shown, MISSING, "no goal"]
    return [label, shown, f"{goal.shown()} {unit}", verdict(goal.met(value))]


def pool_goals(r: Result) -> list[list[str]]:
    return [
        _goal("pool: held share, lorastream gateway minus endpoint picker",
              r.get("gateway_minus_picker_points"), r.get("goal_picker_near_gateway"), "points"),
        _goal("pool: held share, endpoint picker minus random",
              r.get("picker_minus_random_points"), r.get("goal_picker_over_random"), "points"),
        _goal("pool: worker /metrics p99 while saturated", r.get("metrics_p99_ms_saturated"),
              r.get("goal_metrics_p99"), "ms"),
    ]


def _per_worker(values: object) -> str:
    return " / ".join(str(v) for v in values) if isinstance(values, list) and values else MISSING


def _mib(value: object) -> str:
    return number(value / 2**20, 0, " MiB") if isinstance(value, int) else MISSING


def _loads(values: object) -> str:
    return ", ".join(number(v, 2) for v in values) if isinstance(values, list) else MISSING


def pool_section(r: Result, plots: Mapping[str, str]) -> str:
    c, runs = get(r, "config") or {}, get(r, "runs") or {}
    rows = [[POLICY_LABELS.get(p, text(p)), pct(get(x, "held_share")),
             pct(get(x, "device_share")), number(get(x, "store_fetches"), 0),
             _per_worker(get(x, "requests_per_worker")), number(get(x, "output_tok_s"), 1),
             ms(get(x, "ttft_ms", "p50")), f"{text(get(x, 'ok'))}/{text(get(x, 'requests'))}"]
            for p, x in runs.items()]
    sat = get(r, "metrics_saturated") or {}
    during = get(runs, "picker", "metrics") or {}
    latency = [
        [f"pod 0 saturated ({text(sat.get('streams'))} streams, batch {text(sat.get('batch'))})",
         number(sat.get("saturated_scrapes"), 0), ms(get(sat, "saturated_ms", "p50")),
         ms(get(sat, "saturated_ms", "p99")), ms(sat.get("saturated_max_ms"))],
        ["… the same, from a thread beside the streaming clients",
         number(get(sat, "from_benchmark_thread", "saturated_scrapes"), 0),
         ms(get(sat, "from_benchmark_thread", "saturated_ms", "p50")),
         ms(get(sat, "from_benchmark_thread", "saturated_ms", "p99")),
         ms(get(sat, "from_benchmark_thread", "saturated_max_ms"))],
        ["every pod during the picker's run, all scrapes", number(during.get("scrapes"), 0),
         ms(get(during, "all_ms", "p50")), ms(get(during, "all_ms", "p99")), MISSING],
        ["… of them with requests waiting", number(during.get("saturated_scrapes"), 0),
         ms(get(during, "saturated_ms", "p50")), ms(get(during, "saturated_ms", "p99")),
         ms(during.get("saturated_max_ms"))],
    ]
    weights = get(r, "picker_weights") or {}
    trace = get(r, "trace") or {}
    return paragraphs([
        f"{text(c.get('workers'))} pod-shaped model servers on loopback (each a worker process "
        f"with {text(c.get('slots'))} device slots and a {_mib(c.get('host_cache_bytes'))} "
        "host cache, its metrics port, and a one-worker gateway as its OpenAI front, as "
        "`deploy/k8s/inference-pool/model-server.yaml` runs them), "
        f"{text(c.get('adapters'))} adapters (rank {text(c.get('rank'))}) in the store: "
        f"{text(trace.get('total_slots'))} slots in all. One trace of "
        f"{text(c.get('requests'))} streamed completions of {text(c.get('max_tokens'))} tokens, "
        f"zipf s={text(c.get('zipf_s'))} ({text(trace.get('distinct_adapters'))} distinct "
        f"adapters, the most popular {pct(trace.get('top_adapter_share'))} of requests), "
        f"{text(c.get('concurrency'))} in flight, routed four ways, every worker restarted "
        "before each (cold): **endpoint picker**: llm-d-router's metrics extractor and its "
        "lora-affinity, queue and kv-cache scorers re-implemented "
        "(`lorastream/bench/endpoint_picker.py`, weights "
        f"{number(weights.get('lora_affinity'), 0)} / {number(weights.get('queue'), 0)} / "
        f"{number(weights.get('kv_cache'), 0)} as in `deploy/k8s/inference-pool/"
        f"epp-config.yaml`), each pod's `/metrics` scraped every "
        f"{number(c.get('refresh_ms'), 0)} ms, the request sent to the chosen pod's front; "
        "**random**: a pod drawn uniformly; **lorastream gateway**: one gateway over all the "
        "workers (its residency routing, from its own polls). **Held share**: requests served by "
        "a worker that already held the adapter (device slot or host memory), counted by the "
        "workers themselves (`lorastream_worker_adapter_{hits,misses}_total`). The picker runs "
        "twice: with the workers' default `--picker-running held` (`running_lora_adapters` "
        "lists the adapters in a slot or in host memory) and with `--picker-running device` "
        "(only those ready in a slot, the protocol document's wording).",
        table(["routing", "held share", "device share", "store fetches", "requests per worker",
               "tok/s", "TTFT p50 (ms)", "ok"], rows),
        "Held share, lorastream gateway minus endpoint picker (held): "
        f"{number(r.get('gateway_minus_picker_points'), 1)} points; endpoint picker minus "
        f"random: {number(r.get('picker_minus_random_points'), 1)} points; with "
        "`--picker-running device`, gateway minus picker: "
        f"{number(r.get('gateway_minus_picker_device_points'), 1)} points. With `device`, an "
        "adapter evicted from a slot to host memory is not listed, so the picker scores the pod "
        "holding it as one that lacks it, while the gateway sends it where it sits in host "
        "memory.",
        "**`/metrics` latency**, each scrape timed by the scraper from request to body read: "
        "while pod 0's worker is saturated (more streams than its batch, requests waiting), "
        "scraped from a process of its own as the picker is (the goal's figure); and every "
        "scrape of the picker's routing run (three pods loading and evicting adapters, the "
        "scrapers on threads of the benchmark's process beside the fronts and the clients).",
        table(["scrapes", "count", "p50 (ms)", "p99 (ms)", "max (ms)"], latency),
        f"Load average (1, 5, 15 min) at start / end: {_loads(r.get('load_average_at_start'))} "
        f"/ {_loads(r.get('load_average_at_end'))} (a shared 2-core machine: timings are noisy; "
        "three worker processes share its two cores).",
    ])
