"""``bench soak``: outcome accounting, the report section and plots (fast), and a short soak on the
tiny model (slow)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchpage import plots
from benchpage.report import render_page
from benchpage.report_soak import soak_goals, soak_section
from lorastream.bench.soak import SoakConfig, cdf_points, make_soak_requests, rss_growth
from lorastream.bench.soak_client import (
    OUTCOMES,
    SoakRequest,
    _read_events,
    alive_at,
    count_outcomes,
    outcome,
)

INF = math.inf
# worker 0 serves throughout; worker 1 is killed at 50 and serves again from 60
BOTH = [[(0.0, INF)], [(0.0, 50.0), (60.0, INF)]]
NONE_BETWEEN = [[(0.0, 40.0)], [(0.0, 50.0), (60.0, INF)]]  # nothing serves in 50..60


def _request(status: int | None, *, done: bool = False, cancelled: bool = False,
             error: str | None = None, at: float = 55.0) -> SoakRequest:
    r = SoakRequest("s0", "q", None, arrival=at, status=status, done=done, cancelled=cancelled,
                    error=error)
    if status == 503:
        r.failed_at = at
    return r


@pytest.mark.parametrize(("request_", "lifetimes", "expected"), [
    (_request(200, done=True), BOTH, "ok"),
    (_request(200, cancelled=True), BOTH, "cancelled"),
    (_request(200, cancelled=True, error="worker_unavailable"), BOTH, "cancelled"),
    (_request(200, error="worker_unavailable"), BOTH, "error_midstream"),
    (_request(200, done=True, error="worker_unavailable"), BOTH, "error_midstream"),
    (_request(200), BOTH, "error"),  # cut without [DONE] and without an error event
    (_request(429), BOTH, "rejected_429"),
    (_request(503), BOTH, "unavailable_503_worker_alive"),
    (_request(503), NONE_BETWEEN, "unavailable_503_no_worker"),
    (_request(503, at=30.0), NONE_BETWEEN, "unavailable_503_worker_alive"),
    (_request(500), BOTH, "error"),
    (_request(None, error="ConnectError: refused"), BOTH, "error"),
])
def test_each_request_has_one_outcome(request_: SoakRequest, lifetimes: list, expected: str
                                      ) -> None:
    assert outcome(request_, lifetimes) == expected


def test_outcome_counts_list_every_outcome_and_add_up() -> None:
    requests = [_request(200, done=True), _request(200, done=True), _request(429),
                _request(503)]
    counts = count_outcomes(requests, NONE_BETWEEN)
    assert list(counts) == list(OUTCOMES)
    assert counts["ok"] == 2 and counts["rejected_429"] == 1
    assert counts["unavailable_503_no_worker"] == 1 and counts["unavailable_503_worker_alive"] == 0
    assert sum(counts.values()) == len(requests)


def test_alive_at_reads_open_and_closed_lifetimes() -> None:
    assert alive_at(55.0, BOTH) and alive_at(100.0, NONE_BETWEEN)
    assert not alive_at(55.0, NONE_BETWEEN)


@pytest.mark.parametrize(("cancel_after", "chunks", "text", "done", "cancelled"), [
    (None, 3, "abc", True, False),
    (2, 2, "ab", False, True),  # closed after the second content chunk, before [DONE]
])
def test_the_stream_reader_counts_content_and_cancels_as_planned(
    cancel_after: int | None, chunks: int, text: str, done: bool, cancelled: bool
) -> None:
    lines = ['data: {"choices": [{"delta": {"role": "assistant"}}]}', "",
             *(f'data: {{"choices": [{{"delta": {{"content": "{c}"}}}}]}}' for c in "abc"),
             "data: [DONE]"]
    request = SoakRequest("s0", "q", cancel_after)
    _read_events(iter(lines), request)
    assert (request.chunks, request.text, request.done, request.cancelled) == (
        chunks, text, done, cancelled)
    assert request.first_token is not None


def test_an_error_event_is_recorded_with_its_code() -> None:
    lines = ['data: {"choices": [{"delta": {"content": "a"}}]}',
             'data: {"error": {"code": "worker_unavailable", "message": "gone"}}']
    request = SoakRequest("s0", "q", None, status=200)
    _read_events(iter(lines), request)
    assert request.error == "worker_unavailable" and not request.done
    assert outcome(request, BOTH) == "error_midstream"


def test_soak_requests_cancel_about_the_asked_fraction_within_the_duration() -> None:
    config = SoakConfig(adapters=10, duration_s=100.0, cancel_fraction=0.25, max_tokens=32)
    requests, offsets = make_soak_requests(config, rate=20.0)
    assert 1800 < len(requests) < 2200 and offsets == sorted(offsets) and offsets[-1] < 100.0
    cancels = [r.cancel_after for r in requests if r.cancel_after is not None]
    assert 0.22 < len(cancels) / len(requests) < 0.28
    assert min(cancels) >= 1 and max(cancels) <= 16
    assert {r.adapter for r in requests} <= {f"s{i}" for i in range(10)}


@pytest.mark.parametrize(("before", "after", "growth"), [
    (1000.0, 1040.0, 0.04), (1000.0, 1270.0, 0.27), (1000.0, 990.0, -0.01), (None, 5.0, None),
    (1000.0, None, None),
])
def test_rss_growth(before: float | None, after: float | None, growth: float | None) -> None:
    assert rss_growth(before, after) == growth


def test_cdf_points_keep_the_extremes_of_many_samples() -> None:
    points = cdf_points([i / 1000 for i in range(5000)])
    assert len(points) == 200 and points[0] == 0.0 and points[-1] == 4999.0
    assert points == sorted(points)


def _result(**overrides: object) -> dict[str, object]:
    result: dict[str, object] = {
        "benchmark": "soak", "command": "lorastream bench soak",
        "config": {"model": "default", "workers": 2, "adapters": 100, "rank": 8,
                   "popularity": "zipf:1.1", "max_tokens": 32, "load_factor": 2.0,
                   "settle_s": 10.0, "max_requests_per_worker": 48},
        "capacity": {"concurrency": 16, "seconds": 30.0, "req_s": 12.5},
        "soak": {"rate_req_s": 25.0, "duration_s": 600.0, "requests": 15000,
                 "cancel_planned": 3750,
                 "outcomes": {"ok": 9000, "cancelled": 3000, "rejected_429": 2990,
                              "unavailable_503_worker_alive": 3,
                              "unavailable_503_no_worker": 0, "error_midstream": 7,
                              "error": 0},
                 "error_kinds": {"error_midstream: 200: worker_unavailable": 7},
                 "restart": {"worker": 1, "how": "kill", "serving_again_after_s": 9.5}},
        "latency": {"ttft_ms": {"p50": 300.0, "p90": 800.0, "p99": 2000.0},
                    "e2e_ms": {"p50": 900.0, "p90": 1500.0, "p99": 3000.0},
                    "cdf": {"ttft_ms": [100.0, 300.0, 2000.0], "e2e_ms": [500.0, 3000.0]}},
        "rss": {"timeline_mb": [[[1.0, 1000.0], [2.0, 1010.0]], [[1.0, 990.0]]],
                "marks_s": {"warm_up_end": 1.5, "restart": 1.8, "soak_end": 2.0},
                "post_warm_up_mb": [1000.0, 995.0], "settled_mb": [1030.0, 900.0],
                "restarted_worker": 1, "growth_surviving": [0.03]},
        "settled": [{"running_requests": 0, "waiting_requests": 0, "loading_adapters": 0,
                     "kv_tokens_used": 0, "adapter_references": 0, "device_slots_used": 16,
                     "host_mb_used": 180.0}] * 2,
        "greedy": {"sampled": 60, "wrong": 0, "examples": []},
        "unavailable_503_worker_alive": 3, "goal_503_worker_alive": "== 0",
        "wrong_outputs": 0, "goal_wrong_outputs": "== 0",
        "rss_growth_max": 0.03, "goal_rss_growth": "<= 0.05",
        "settled_counters_nonzero": 0, "goal_settled_counters": "== 0",
    }
    result.update(overrides)
    return result


def test_soak_goals_show_counts_and_verdicts() -> None:
    rows = soak_goals(_result())
    assert [row[1] for row in rows] == ["3", "0", "3.0%", "0"]
    assert [row[3] for row in rows] == ["**not met**", "met", "met", "met"]
    missing = soak_goals(_result(rss_growth_max=None))[2]
    assert missing[3] == "not measured"


def test_soak_section_shows_outcomes_counters_and_plots() -> None:
    section = soak_section(_result(), {"soak_rss": "plots/soak_rss.png"})
    assert "| 503 while a worker was serving | 3 | 0.0% |" in section
    assert "| 429 (overloaded, Retry-After) | 2,990 | 19.9% |" in section
    assert "12.50 req/s" in section and "25.0%" in section  # capacity; share cancelled
    assert "| adapter_references | 0 | 0 |" in section
    assert "![worker RSS over the soak](plots/soak_rss.png)" in section
    assert "soak_latency" not in section  # a plot not drawn is not linked
    assert "worker_unavailable" in section and "None" not in section


def test_the_page_has_the_soak_section_and_its_goals() -> None:
    page = render_page({"soak": _result()}, {})
    assert "## Soak: two workers at 2x capacity" in page
    assert "soak: 503s while a worker was serving" in page


def test_soak_plots_are_drawn_from_the_result(tmp_path: Path) -> None:
    for draw, name in ((plots.soak_rss, "rss.png"), (plots.soak_latency, "latency.png")):
        path = draw(_result(), tmp_path / name)
        assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.soak_rss(_result(rss={}), tmp_path / "none.png") is None


@pytest.mark.slow
def test_a_short_soak_meets_its_goals_on_the_tiny_model(tiny_model: Path) -> None:
    config = SoakConfig(model=str(tiny_model), adapters=12, rank=4, slots=4, max_tokens=8,
                        capacity_concurrency=8, capacity_seconds=5.0, duration_s=30.0,
                        settle_s=3.0, greedy_sample=10)
    result = run(config)
    outcomes = result["soak"]["outcomes"]
    assert sum(outcomes.values()) == result["soak"]["requests"] > 0
    assert outcomes["ok"] > 0 and outcomes["cancelled"] > 0 and outcomes["rejected_429"] > 0
    assert result["soak"]["restart"]["worker"] == 1
    assert result["unavailable_503_worker_alive"] == 0
    assert result["wrong_outputs"] == 0 and result["greedy"]["sampled"] == 10
    assert result["settled_counters_nonzero"] == 0
    assert all(len(timeline) > 10 for timeline in result["rss"]["timeline_mb"])
    assert result["latency"]["ttft_ms"]["p50"] is not None


def run(config: SoakConfig) -> dict:
    from lorastream.bench.soak import run_soak_bench

    return run_soak_bench(config)
