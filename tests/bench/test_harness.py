"""The benchmark harness: traces, statistics and raw samples, without processes."""

from __future__ import annotations

from collections import Counter

import pytest

from lorastream.bench.harness import (
    RequestResult,
    itls,
    make_shared_arrival_trace,
    make_trace,
    percentiles,
    samples_ms,
    sse_chunk,
    summarise,
)


def test_serve_trace_is_unchanged_by_the_refactor() -> None:
    # The first entries of `bench serve`'s default trace before the harness existed.
    trace = make_trace(24, "zipf:1.2", 0.5, 4, 0)
    assert [(round(t, 4), a, q) for t, a, q in trace] == [
        (2.6174, 19, 5), (3.419, 17, 2), (4.5579, 7, 1), (11.3567, 0, 4),
    ]


@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf:1.5"])
def test_shared_arrival_traces_differ_only_in_adapters(popularity: str) -> None:
    traces = {n: make_shared_arrival_trace(n, popularity, 8.0, 200, 7) for n in (10, 100, 1000)}
    columns = {n: [(t, q) for t, _, q in trace] for n, trace in traces.items()}
    assert columns[10] == columns[100] == columns[1000]
    for n, trace in traces.items():
        assert all(0 <= a < n for _, a, _ in trace)


def test_zipf_popularity_concentrates_requests_on_few_adapters() -> None:
    trace = make_shared_arrival_trace(1000, "zipf:1.5", 8.0, 500, 0)
    counts = Counter(a for _, a, _ in trace).most_common()
    assert counts[0][1] > 0.25 * len(trace)  # rank 1 of zipf 1.5 over 1000: about 38%
    assert len(counts) < 250


@pytest.mark.parametrize(
    ("popularity", "message"),
    [("pareto", "distinct, uniform or zipf:ALPHA"), ("zipf:x", "ALPHA must be a number")],
)
def test_bad_popularity_is_refused_with_what_to_write(popularity: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_trace(4, popularity, 1.0, 4, 0)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], {"p50": None, "p90": None, "p99": None}),
        ([0.001], {"p50": 1.0, "p90": 1.0, "p99": 1.0}),
        ([i / 1000 for i in range(1, 101)], {"p50": 51.0, "p90": 91.0, "p99": 100.0}),
    ],
)
def test_percentiles_are_in_milliseconds(values: list[float], expected: dict) -> None:
    assert percentiles(values) == expected


def test_itls_inside_a_window_are_the_gaps_ending_in_it() -> None:
    r = RequestResult(arrival=0.0, token_times=[1.0, 1.5, 3.0, 3.25])
    assert itls([r]) == [0.5, 1.5, 0.25]
    assert itls([r], (1.2, 3.0)) == [0.5, 1.5]


def test_summary_has_sorted_raw_samples_one_per_token_gap_and_request() -> None:
    results = [
        RequestResult(arrival=0.0, first_token=0.1, token_times=[0.1, 0.13, 0.2], end=0.2),
        RequestResult(arrival=0.05, first_token=0.0601234, token_times=[0.0601234, 0.08],
                      end=0.08),
        RequestResult(arrival=0.06, error="Unavailable: gone", end=0.07),
    ]
    summary = summarise(results, start=0.0)
    assert summary["requests"] == 3 and summary["errors"] == 1
    assert summary["samples"] == {"ttft_ms": [10.1, 100.0], "itl_ms": [19.9, 30.0, 70.0]}
    assert summary["throughput_tok_s"] == pytest.approx(25.0)
    assert summary["throughput_req_s"] == pytest.approx(10.0)
    assert samples_ms([0.00204, 0.001]) == [1.0, 2.0]


@pytest.mark.parametrize(("line", "chunk"), [
    ('data: {"id": "cmpl-1", "choices": []}', {"id": "cmpl-1", "choices": []}),
    ('data:{"usage": {"prompt_tokens": 3}}', {"usage": {"prompt_tokens": 3}}),
    ("data: [DONE]", None),
    ("", None),
    (": keep-alive", None),
])
def test_an_event_stream_line_gives_its_json_chunk_or_none(line: str, chunk: object) -> None:
    assert sse_chunk(line) == chunk


def test_a_broken_event_stream_line_raises() -> None:
    with pytest.raises(ValueError):
        sse_chunk("data: {not json")

