"""The soak benchmark's section of the benchmark page and its goal rows (``bench soak``).

Every figure is read from the result JSON (lorastream/bench/soak.py); the prose says what was
done to the stack and what each goal guards against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from benchpage.report_format import (
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
    table,
    text,
    verdict,
)
from lorastream.bench.soak_client import OUTCOMES

_OUTCOME_LABELS = {
    "ok": "200, read to [DONE]",
    "cancelled": "200, closed by the client mid-stream (planned)",
    "rejected_429": "429 (overloaded, Retry-After)",
    "unavailable_503_worker_alive": "503 while a worker was serving",
    "unavailable_503_no_worker": "503 while no worker was serving",
    "error_midstream": "200, then an error event (stream cut by the restarted worker)",
    "error": "other errors (status, transport, stream cut without [DONE])",
}
_COUNTERS = ("running_requests", "waiting_requests", "loading_adapters", "kv_tokens_used",
             "adapter_references", "device_slots_used", "host_mb_used")


def soak_goals(r: Result) -> list[list[str]]:
    return [
        _count_goal("soak: 503s while a worker was serving",
                    r.get("unavailable_503_worker_alive"), r.get("goal_503_worker_alive")),
        _count_goal("soak: wrong greedy outputs against a quiet rerun", r.get("wrong_outputs"),
                    r.get("goal_wrong_outputs")),
        goal_row("soak: RSS growth of the surviving worker, settled / post-warm-up",
                 r.get("rss_growth_max"), r.get("goal_rss_growth"), percent=True),
        _count_goal("soak: counters not back to 0 after settling (running, waiting, loading, "
                    "KV, references)", r.get("settled_counters_nonzero"),
                    r.get("goal_settled_counters")),
    ]


def soak_section(r: Result, plots: Mapping[str, str]) -> str:
    c = r.get("config") or {}
    soak = r.get("soak") or {}
    outcomes = soak.get("outcomes") or {}
    total = sum(int(as_number(outcomes.get(k)) or 0) for k in OUTCOMES)
    outcome_rows = [[_OUTCOME_LABELS[k], number(outcomes.get(k), 0), _share(outcomes.get(k), total)]
                    for k in OUTCOMES]
    restart = soak.get("restart") or {}
    latency_rows = [[f"{name} {p}", ms(get(r, "latency", key, p))]
                    for key, name in (("ttft_ms", "TTFT"), ("e2e_ms", "end-to-end"))
                    for p in ("p50", "p90", "p99")]
    rss = r.get("rss") or {}
    settled = r.get("settled") or []
    counter_rows = [[name, *(text(w.get(name)) for w in settled if isinstance(w, Mapping))]
                    for name in _COUNTERS]
    greedy = r.get("greedy") or {}
    kinds = soak.get("error_kinds") or {}
    return paragraphs([
        f"Model {text(c.get('model'))}; {text(c.get('workers'))} workers behind the gateway "
        f"(`--max-requests-per-worker {text(c.get('max_requests_per_worker'))}`), "
        f"{text(c.get('adapters'))} adapters of rank {text(c.get('rank'))} in the store, drawn by "
        f"{text(c.get('popularity'))}; greedy chat completions of {text(c.get('max_tokens'))} "
        "tokens. Every adapter is asked for once, then the closed-loop capacity is measured "
        f"({text(get(r, 'capacity', 'concurrency'))} clients for "
        f"{text(get(r, 'capacity', 'seconds'))} s: "
        f"**{number(get(r, 'capacity', 'req_s'), 2)} req/s**). The soak then sends Poisson "
        f"arrivals at {text(c.get('load_factor'))}x that "
        f"({number(soak.get('rate_req_s'), 2)} req/s) for {text(soak.get('duration_s'))} s; "
        f"{_share(soak.get('cancel_planned'), soak.get('requests'))} of the requests close "
        "their stream after a few tokens. Half-way, worker "
        f"{text(restart.get('worker'))} is stopped ({text(restart.get('how'))}) and started "
        f"again (serving again after {text(restart.get('serving_again_after_s'))} s).",
        table(("outcome", "requests", "share"), outcome_rows),
        _kinds(kinds),
        table(("latency of the soak's requests", "ms"), latency_rows),
        "TTFT counts every request that streamed a token (the cancelled ones too); end-to-end "
        "only those read to `[DONE]`. Both include the queueing of an overloaded stack.",
        plot_image(plots, "soak_latency", "TTFT and end-to-end latency CDF of the soak"),
        f"Resident memory of each worker (RSS, sampled each second): after warm-up and 3 s idle "
        f"{_mbs(rss.get('post_warm_up_mb'))} MB; after the soak and "
        f"{text(c.get('settle_s'))} s idle {_mbs(rss.get('settled_mb'))} MB. Worker "
        f"{text(rss.get('restarted_worker'))} was restarted, so its numbers are not comparable "
        "across the soak; the goal is on the others.",
        plot_image(plots, "soak_rss", "worker RSS over the soak"),
        "Each worker's counters after settling (the first five must be 0; slots and host memory "
        "keep adapters resident on purpose):",
        table(("counter", *(f"worker {i}" for i in range(len(settled)))), counter_rows),
        f"Greedy check: {text(greedy.get('sampled'))} completed requests sent again one at a "
        f"time after the soak; **{text(greedy.get('wrong'))} differed**.",
    ])


def _count_goal(label: str, value: object, goal_text: object) -> list[str]:
    """A goals-table row for a count (shown as an integer)."""
    goal = Goal.parse(goal_text)
    if goal is None:
        return [label, number(value, 0), MISSING, "no goal"]
    return [label, number(value, 0), goal.shown(), verdict(goal.met(value))]


def _share(part: object, whole: object) -> str:
    p, w = as_number(part), as_number(whole)
    return f"{p / w:.1%}" if p is not None and w else "–"


def _mbs(values: object) -> str:
    if not isinstance(values, Sequence):
        return "–"
    return " / ".join(number(v, 0) for v in values)


def _kinds(kinds: Mapping[str, object]) -> str:
    if not kinds:
        return ""
    lines = [f"- `{name}`: {text(count)}" for name, count in kinds.items()]
    return "The errors and 503s by kind (outcome: status: error code):\n\n" + "\n".join(lines)
