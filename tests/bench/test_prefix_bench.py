"""``bench prefix`` at tiny size through the CLI: both workloads on and off (no-sharing as
alternating pairs), the fields the page reads, the cache hitting on chat and never on random
prompts, the routing part through the gateway (affinity on and off), and its section on the
page."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from benchpage.__main__ import main as benchpage_main
from lorastream.cli.main import app

runner = CliRunner()


def test_a_tiny_run_reports_both_workloads_on_and_off_and_the_page_shows_them(
    tiny_model: Path, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    result = runner.invoke(app, [
        "bench", "prefix", "--model", str(tiny_model), "--adapters", "2", "--clients", "3",
        "--turns", "2", "--system-tokens", "40", "--user-tokens", "5", "--reply-tokens", "4",
        "--rank", "4", "--output", str(results / "prefix.json"),
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads((results / "prefix.json").read_text())
    assert doc["benchmark"] == "prefix" and doc["config"]["clients"] == 3
    for workload in ("chat", "no_sharing"):
        for side in ("on", "off"):
            s = doc[workload][side]
            assert s["requests"] == 6 and s["generated_tokens"] == 6 * 4
            assert 0 < s["ttft_p50_ms"] <= s["ttft_p90_ms"] and s["tokens_per_s"] > 0
    # 2 adapters x 2 system blocks, then each later turn its conversation's earlier blocks
    assert doc["chat"]["on"]["prefix_hit_rate"] > 0.3
    assert doc["chat"]["off"]["prefix_hit_rate"] == 0
    assert doc["no_sharing"]["on"]["prefix_hit_rate"] == 0  # random prompts never hit
    assert doc["outputs_identical"] == 1
    # no-sharing as pairs in alternating order; the headline is the median of their ratios
    pairs = doc["no_sharing"]["pairs"]
    assert [p["first"] for p in pairs] == ["on", "off"]
    for p in pairs:
        assert p["on_over_off"] == round(p["on_tokens_per_s"] / p["off_tokens_per_s"], 3)
    assert doc["no_sharing_tokens_per_s_on_over_off"] == round(
        (pairs[0]["on_over_off"] + pairs[1]["on_over_off"]) / 2, 3)
    on, off = doc["chat"]["on"], doc["chat"]["off"]
    assert doc["ttft_p50_on_over_off"] == round(on["ttft_p50_ms"] / off["ttft_p50_ms"], 3)
    assert doc["tokens_per_s_on_over_off"] == round(on["tokens_per_s"] / off["tokens_per_s"], 3)

    # the routing part: every turn's route was read from the gateway's line (else it raises)
    routing = doc["routing"]
    assert routing["workers"] == 2 and routing["outputs_identical"] == 1
    for side in ("affinity", "no_affinity"):
        s = routing[side]
        assert s["requests"] == 6 and sum(s["requests_per_worker"]) == 6
        assert s["generated_tokens"] == 6 * 4 and sum(s["reasons"].values()) == 6
        assert 0 <= s["follow_ups_on_previous_worker"] <= 1
        assert 0 <= s["cached_share_all"] <= s["cached_share_follow_ups"] < 1
    assert "prefix" not in routing["no_affinity"]["reasons"]  # the table is off
    assert routing["ttft_p50_affinity_over_none"] == round(
        routing["affinity"]["ttft_p50_ms"] / routing["no_affinity"]["ttft_p50_ms"], 3)

    page = tmp_path / "BENCHMARKS.md"
    assert benchpage_main(["--results", str(results), "--out", str(page)]) == 0
    text = page.read_text()
    section = text[text.index("(prefix)\n"):]
    assert "Chat traffic over 2 adapters (rank 4" in section
    assert f"| chat, caching on | 6 | {on['ttft_p50_ms']:,.1f} |" in section
    assert "Greedy outputs are identical" in section
    assert f"The no-sharing pairs, on / off: on first {pairs[0]['on_over_off']:.3f}×" in section
    assert "chat TTFT p50, prefix caching on / off" in text
    affinity = routing["affinity"]
    assert (f"| prefix affinity on | 6 | {affinity['follow_ups_on_previous_worker']:.1%} |"
            in section)


def test_without_routing_the_page_has_no_routing_part(tiny_model: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    result = runner.invoke(app, [
        "bench", "prefix", "--model", str(tiny_model), "--adapters", "1", "--clients", "1",
        "--turns", "1", "--system-tokens", "60", "--user-tokens", "4", "--reply-tokens", "2",
        "--rank", "4", "--no-routing", "--output", str(results / "prefix.json"),
    ])
    assert result.exit_code == 0, result.output
    assert json.loads((results / "prefix.json").read_text())["routing"] is None
    page = tmp_path / "BENCHMARKS.md"
    assert benchpage_main(["--results", str(results), "--out", str(page)]) == 0
    assert "(prefix)" in page.read_text() and "**Routing.**" not in page.read_text()
