"""``bench saturate`` at a tiny size: the stack as ``lorastream up`` starts it, driven through the
gateway, and the engine alone on the same requests; the JSON carries what the page and the goals
read."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorastream.bench.saturate import (
    ENGINE_RATIO_GOAL,
    UTILISATION_GOAL,
    Request,
    SaturateConfig,
    goals_met,
    make_requests,
    run_saturate_bench,
    summarise,
)


def test_saturate_bench_reports_served_engine_and_cpu_per_service(tiny_model: Path) -> None:
    config = SaturateConfig(model=str(tiny_model), requests=6, concurrency=3, prompt_tokens=(4, 8),
                            new_tokens=4, adapters=(0, 2), rank=4, warm_up=2)
    lines: list[str] = []
    result = run_saturate_bench(config, report=lines.append)
    assert result["benchmark"] == "saturate" and result["command"]
    assert result["goals"] == {"utilisation": f">= {UTILISATION_GOAL}",
                               "served_over_engine": f">= {ENGINE_RATIO_GOAL}"}
    assert [w["adapters"] for w in result["workloads"]] == [0, 2]
    assert len(lines) == 2 and all("CPU busy" in line and "served/engine" in line for line in lines)
    for w in result["workloads"]:
        for side in ("served", "engine"):
            r = w[side]
            assert r["errors"] == 0, r["first_error"]
            assert r["requests"] == 6 and r["expected_tokens"] == 6 * 4
            # a stream's first chunk may carry no text: at most one token a request uncounted
            assert 6 * 3 <= r["tokens"] <= 6 * 4
            assert r["output_tok_s"] > 0 and r["ttft_ms"]["p50"] > 0
            assert r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"]
            # /proc counts CPU in 10 ms ticks: each process read at the window's two ends can be
            # a tick over, which a window of a few tens of ms (this tiny run) can see
            ticks = 0.01 * 2 * max(3, len(r.get("cpu_s", {})))
            allowed = r["cpu_available_s"] * 1.05 + ticks
            assert 0 < r["cpu_used_s"] <= allowed
            assert 0 < r["utilisation"] <= allowed / r["cpu_available_s"]
            assert 0 <= r["machine_idle_share"] <= 1
            assert r["busiest_threads_cpu_s"] == sorted(r["busiest_threads_cpu_s"], reverse=True)
        assert set(w["served"]["cpu_s"]) == {"store", "worker", "gateway"}
        assert w["served"]["cpu_s"]["worker"] > 0
        assert w["served_over_engine"] == pytest.approx(
            w["served"]["output_tok_s"] / w["engine"]["output_tok_s"], rel=0.01)
    assert result["met"] == goals_met(result["workloads"])


def test_requests_are_the_same_every_run_and_name_adapters_round_robin() -> None:
    config = SaturateConfig(requests=7, prompt_tokens=(3, 5))
    first = make_requests(config, ["a", "b", "c"], vocab=50)
    assert [r.model for r in first] == ["a", "b", "c", "a", "b", "c", "a"]
    assert all(3 <= len(r.prompt) <= 5 and all(0 <= t < 50 for t in r.prompt) for r in first)
    assert [r.prompt for r in first] == [r.prompt for r in make_requests(config, ["x"], 50)]
    assert {r.model for r in make_requests(config, [], 50)} == {""}  # the base model


def test_summary_counts_tokens_errors_and_ttft() -> None:
    done = [Request("", [1], ttft=0.1, tokens=4), Request("", [1], ttft=0.3, tokens=3),
            Request("", [1], error="HTTP 503")]
    s = summarise(done, wall=2.0, new_tokens=4)
    assert s["tokens"] == 7 and s["output_tok_s"] == 3.5 and s["expected_tokens"] == 12
    assert s["errors"] == 1 and s["first_error"] == "HTTP 503"
    assert s["ttft_ms"]["p50"] == 300.0


@pytest.mark.parametrize("utilisation, ratio, met", [
    (0.95, 0.9, {"utilisation": True, "served_over_engine": True}),
    (0.52, 0.9, {"utilisation": False, "served_over_engine": True}),
    (0.95, 0.6, {"utilisation": True, "served_over_engine": False}),
    (0.95, None, {"utilisation": True, "served_over_engine": False}),  # engine not measured
])
def test_goals_hold_over_every_workload(utilisation: float, ratio: float | None,
                                        met: dict[str, bool]) -> None:
    good = {"served": {"utilisation": 0.97}, "served_over_engine": 0.95}
    other = {"served": {"utilisation": utilisation}, "served_over_engine": ratio}
    assert goals_met([good, other]) == met


def test_a_window_over_this_process_does_not_count_it_twice() -> None:
    import os
    import time

    from lorastream.bench.saturate import CpuWindow

    with CpuWindow({"engine": os.getpid()}, threads_of=os.getpid()) as window:
        end = time.process_time() + 0.3
        while time.process_time() < end:  # busy on this thread
            pass
    r = window.result()
    assert r["client_cpu_s"] == 0.0 and r["cpu_s"]["engine"] >= 0.25
    assert r["busiest_threads_cpu_s"][0] >= 0.25
