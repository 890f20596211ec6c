"""``bench scale`` end to end on the tiny model: a real store, workers and the PEFT peer."""

from __future__ import annotations

import json
from pathlib import Path

from lorastream.bench.scale import ScaleConfig, run_scale_bench


def test_scale_bench_serves_every_request_at_each_count_and_runs_the_peft_peer(
    tiny_model: Path,
) -> None:
    config = ScaleConfig(
        model=str(tiny_model), counts=(6, 2), rate=50.0, requests=8, max_tokens=3, slots=2,
        peft_batch=4,
    )
    result = run_scale_bench(config)
    json.dumps(result)  # printable as is

    assert result["registration"]["adapters"] == 6
    runs = result["runs"]
    assert [r["adapters"] for r in runs] == [2, 6]
    for run in runs:
        assert run["requests"] == 8 and run["errors"] == 0
        assert run["throughput_req_s"] > 0 and run["throughput_tok_s"] > 0
        assert run["rounds"] == 2  # the counts took turns twice; the best round is reported
        assert run["throughput_req_s"] == max(run["throughput_req_s_rounds"])
        assert 1 <= run["distinct_adapters_requested"] <= run["adapters"]
        assert len(run["samples"]["ttft_ms"]) == 8
        assert len(run["samples"]["itl_ms"]) == 8 * (3 - 1)
        assert run["samples"]["ttft_ms"] == sorted(run["samples"]["ttft_ms"])
        worker = run["worker"]
        assert worker["load_failures"] == 0
        assert 1 <= worker["store_fetches"] <= run["distinct_adapters_requested"]
    assert isinstance(result["throughput_loss_max_vs_min"], float)
    assert result["goal_throughput_loss"] == "<= 0.10"

    peft = result["peft"]
    assert peft["requests"] == 8 and peft["tokens"] == 8 * 3 and peft["batches"] == 2
    assert peft["adapters_loaded"] == runs[-1]["distinct_adapters_requested"]
    assert peft["throughput_tok_s"] > 0 and "t=0" in peft["note"]
    assert result["lorastream_vs_peft"] > 0


def test_each_count_reports_its_best_round_and_keeps_every_rounds_throughput() -> None:
    from lorastream.bench.scale import _best_round

    rounds = [{"adapters": 10, "throughput_req_s": 3.1, "ttft_ms": {"p50": 900.0}},
              {"adapters": 10, "throughput_req_s": 3.6, "ttft_ms": {"p50": 700.0}},
              {"adapters": 10, "throughput_req_s": None, "ttft_ms": {"p50": None}}]
    best = _best_round(rounds)
    assert best["throughput_req_s"] == 3.6 and best["ttft_ms"] == {"p50": 700.0}
    assert best["rounds"] == 3 and best["throughput_req_s_rounds"] == [3.1, 3.6, None]


def test_the_scale_section_states_the_adapter_size_and_the_push_registration() -> None:
    from benchpage.report_sections import scale_goals, scale_section

    runs = [{"adapters": n, "throughput_req_s": 5.0 - n / 10_000, "ttft_ms": {"p50": 900.0}}
            for n in (10, 100, 1000, 10_000)]
    result = {
        "config": {"model": "default", "ranks": [2, 4, 8], "targets": ["q_proj", "v_proj"]},
        "registration": {"adapters": 10_000, "parallel": 4, "staged_mb": 5376.0,
                         "adapter_mb_mean": 0.538, "seconds": 140.2,
                         "registrations_per_s": 71.3, "push_ms_mean": 52.4},
        "runs": runs, "throughput_loss_max_vs_min": 0.2, "goal_throughput_loss": "<= 0.10",
    }
    page = scale_section(result, {})
    assert ("5,376 MB staged, 0.54 MB per adapter on average; pushed from memory in 140.2 s, "
            "4 uploads at a time, 71.3 adapters/s, 52.4 ms each on average") in page
    assert "| 10000 |" in page
    assert scale_goals(result)[0][0] == "scale throughput loss, 10 → 10000 adapters"
