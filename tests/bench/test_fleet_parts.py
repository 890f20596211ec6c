"""The pure parts of `lorastream bench fleet`: the zipf trace, the held share from worker
counters, the re-serve times after a kill, and the counters parsed from real /metrics text."""

from __future__ import annotations

from collections import Counter

import pytest

from lorastream.bench.fleet import Result, held_share, reserve_times, worker_counters, zipf_trace
from lorastream.worker.metrics import WorkerMetrics


@pytest.mark.parametrize("s", [0.8, 1.1, 1.5])
def test_zipf_trace_is_reproducible_in_range_and_skewed(s: float) -> None:
    trace = zipf_trace(100, s, 3000, seed=4)
    assert trace == zipf_trace(100, s, 3000, seed=4)
    assert all(0 <= i < 100 for i in trace)
    counts = sorted(Counter(trace).values(), reverse=True)
    # the most popular adapter takes about 1/H(100, s) of the requests: far above uniform
    assert counts[0] > 3000 / 100 * 4
    assert counts[0] > 1.6 * counts[1] if s >= 1.1 else counts[0] > counts[2]


@pytest.mark.parametrize(
    ("after", "expected_held", "expected_device", "fetches"),
    [
        # worker a: 6 requests, 4 device hits, of 2 device misses 1 host hit; b: 4, all fetched
        ({"a": {"hits:device": 4, "misses:device": 2, "hits:host": 1, "misses:host": 1},
          "b": {"hits:device": 0, "misses:device": 4, "hits:host": 0, "misses:host": 4}},
         0.5, 0.4, 5),
        ({"a": {"hits:device": 10, "misses:device": 0}}, 1.0, 1.0, 0),
        ({"a": {"misses:device": 3, "misses:host": 3}}, 0.0, 0.0, 3),
    ],
)
def test_held_share_counts_device_and_host_hits_over_requests(
    after: dict[str, dict[str, float]], expected_held: float, expected_device: float,
    fetches: int,
) -> None:
    before = {w: {k: 1.0 for k in v} for w, v in after.items()}  # a previous run's counts
    after = {w: {k: v + 1.0 for k, v in c.items()} for w, c in after.items()}
    share = held_share(before, after)
    assert share["held_share"] == expected_held
    assert share["device_share"] == expected_device
    assert share["store_fetches"] == fetches


def test_held_share_of_no_requests_is_none() -> None:
    assert held_share({}, {"a": {}})["held_share"] is None


def test_worker_counters_read_the_workers_own_metrics_text() -> None:
    from prometheus_client import generate_latest

    metrics = WorkerMetrics()
    metrics.hits.labels("device").inc(3)
    metrics.misses.labels("device").inc(2)
    metrics.misses.labels("host").inc()
    counters = worker_counters(generate_latest(metrics.registry).decode())
    assert counters["hits:device"] == 3 and counters["misses:device"] == 2
    assert counters["misses:host"] == 1 and counters["hits:host"] == 0


def test_reserve_times_take_the_first_success_after_the_kill_per_held_adapter() -> None:
    results = [
        Result("x", 0.0, 9.0, 0.1, 4),  # ended before the kill: not a re-serve
        Result("x", 9.5, 11.0, None, 0, "stream error: worker_failed"),  # failed
        Result("x", 10.5, 12.5, 0.2, 4),  # first success: 2.5 s after the kill
        Result("x", 11.0, 13.0, 0.2, 4),
        Result("y", 10.0, 40.0, 0.2, 4),  # after the worker was back (at 30)
        Result("z", 10.0, 11.0, 0.2, 4),  # not held by the killed worker
    ]
    out = reserve_times(10.0, ["x", "y", "w"], results, back_at=30.0)
    assert out["per_adapter_s"] == {"x": 2.5, "y": 30.0}
    assert out["held"] == 3 and out["requested_after_kill"] == 2 and out["reserved"] == 2
    assert out["reserved_before_worker_back"] == 1
    assert out["seconds"] == {"min": 2.5, "p50": 30.0, "max": 30.0}
