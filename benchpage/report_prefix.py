"""The prefix-caching benchmark's section and goal rows on the benchmark page."""

from __future__ import annotations

from collections.abc import Mapping

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
    text,
)
from lorastream.bench.prefix_routing import THINK_S


def prefix_goals(r: Result) -> list[list[str]]:
    return [
        goal_row("chat TTFT p50, prefix caching on / off", r.get("ttft_p50_on_over_off"),
                 r.get("goal_ttft"), digits=3),
        goal_row("chat tokens/s, prefix caching on / off", r.get("tokens_per_s_on_over_off"),
                 r.get("goal_throughput"), digits=3),
        goal_row("no-sharing tokens/s, prefix caching on / off",
                 r.get("no_sharing_tokens_per_s_on_over_off"), r.get("goal_no_sharing"),
                 digits=3),
        goal_row("greedy outputs identical, on and off (1 = yes)", r.get("outputs_identical"),
                 r.get("goal_identical"), digits=0),
    ]


def _rows(r: Result, workload: str) -> list[list[str]]:
    rows = []
    for side in ("on", "off"):
        s = get(r, workload, side) or {}
        rows.append([
            f"{workload.replace('_', '-')}, caching {side}", number(s.get("requests"), 0),
            ms(s.get("ttft_p50_ms")), ms(s.get("ttft_p90_ms")), number(s.get("tokens_per_s")),
            number(s.get("wall_s"), 2), pct(s.get("prefix_hit_rate")),
        ])
    return rows


def _pairs(r: Result) -> str:
    pairs = (r.get("no_sharing") or {}).get("pairs") or []
    if not pairs:
        return ""
    listed = ", ".join(f"{text(p.get('first'))} first {ratio(p.get('on_over_off'), 3)}"
                       for p in pairs)
    return f" The no-sharing pairs, on / off: {listed}."


def _routing(r: Result) -> list[str]:
    routing = r.get("routing")
    if not isinstance(routing, Mapping):
        return []
    # runs before think_s was recorded used the module's value (1.0 s then)
    think = routing.get("think_s", THINK_S)
    header = ("gateway", "requests", "follow-ups on the last turn's worker",
              "follow-ups' prompt tokens cached", "all prompt tokens cached",
              "requests per worker", "TTFT p50 (ms)", "TTFT p90 (ms)", "tokens/s")
    rows = []
    for side, label in (("affinity", "prefix affinity on"), ("no_affinity", "prefix affinity off")):
        s = routing.get(side) or {}
        rows.append([
            label, number(s.get("requests"), 0), pct(s.get("follow_ups_on_previous_worker")),
            pct(s.get("cached_share_follow_ups")), pct(s.get("cached_share_all")),
            " / ".join(str(n) for n in s.get("requests_per_worker") or []) or "—",
            ms(s.get("ttft_p50_ms")), ms(s.get("ttft_p90_ms")), number(s.get("tokens_per_s")),
        ])
    return [
        f"**Routing.** The same conversations, as text, through the gateway over "
        f"{text(routing.get('workers'))} workers on loopback (each caching prefixes, each "
        "holding every adapter, so load and prefix affinity decide, not residency), with the "
        "gateway's prefix affinity on and then off (`--prefix-affinity-entries 0`: the routing "
        "before it); both workers' caches are emptied before each. Clients do not move in "
        f"lockstep: each starts within {think} s and thinks up to {2 * think:g} s between turns "
        "(the same pauses on both sides; wall time includes them). Where each turn went is the "
        "gateway's own routing line; cached tokens are the responses' "
        "`usage.prompt_tokens_details.cached_tokens`.",
        table(header, rows),
        f"With affinity, TTFT p50 is {ratio(routing.get('ttft_p50_affinity_over_none'), 3)} "
        f"and throughput {ratio(routing.get('tokens_per_s_affinity_over_none'), 3)} of the "
        "run without it; greedy outputs are "
        f"{'identical' if routing.get('outputs_identical') == 1 else '**not identical**'}.",
    ]


def prefix_section(r: Result, plots: Mapping[str, str]) -> str:
    c = r.get("config") or {}
    header = ("workload", "requests", "TTFT p50 (ms)", "TTFT p90 (ms)", "tokens/s", "wall (s)",
              "prompt tokens from the cache")
    return paragraphs([
        f"Chat traffic over {text(c.get('adapters'))} adapters (rank {text(c.get('rank'))}, "
        f"model {text(c.get('model'))}), each with its own system prompt of "
        f"{text(c.get('system_tokens'))} tokens; {text(c.get('clients'))} clients at once, each "
        f"in a conversation of {text(c.get('turns'))} turns with one adapter (a user message of "
        f"{text(c.get('user_tokens'))} tokens, a greedy reply of {text(c.get('reply_tokens'))}; "
        "each turn's prompt carries the whole conversation so far). The same run also builds "
        "a worker with `--prefix-caching off` and replays the same conversations. "
        "**no-sharing**: as many requests, each a fresh random prompt of the first turn's "
        "length: the cache never hits (and evicts the chat's blocks), so its cost shows; it runs "
        "as pairs of one request per client on each worker, in alternating order, and its ratio "
        "is the median of the pairs' ratios. TTFT is from submission to the first "
        "token, over every request; tokens/s is generated tokens over the workload's wall time.",
        table(header, _rows(r, "chat") + _rows(r, "no_sharing")),
        f"With the cache, TTFT p50 is {ratio(r.get('ttft_p50_on_over_off'), 3)} and throughput "
        f"{ratio(r.get('tokens_per_s_on_over_off'), 3)} of the run without it; on prompts that "
        f"share nothing, throughput is {ratio(r.get('no_sharing_tokens_per_s_on_over_off'), 3)}."
        f"{_pairs(r)} Greedy outputs are "
        f"{'identical' if r.get('outputs_identical') == 1 else '**not identical**'} between "
        "the two runs.",
        *_routing(r),
    ])
