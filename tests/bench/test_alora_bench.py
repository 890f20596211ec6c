"""``bench alora`` at tiny size through the CLI: the activated adapter's turn after a base
turn on both workers, the base blocks it takes with the cache and not without, and its
section and goal rows on the page."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from benchpage.report import write_report
from lorastream.cli.main import app
from lorastream.worker.model.kv_cache import BLOCK_SIZE

runner = CliRunner()


def test_a_tiny_run_shares_the_base_blocks_only_with_the_cache_and_the_page_shows_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    result = runner.invoke(app, [
        "bench", "alora", "--model", str(tiny_model), "--conversations", "2",
        "--conversation-tokens", "40", "--reply-tokens", "3", "--invocation-tokens", "2",
        "--rank", "4", "--output", str(results / "alora.json"),
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads((results / "alora.json").read_text())
    assert doc["benchmark"] == "alora" and len(doc["conversations"]) == 2
    assert [c["first"] for c in doc["conversations"]] == ["on", "off"]
    for c in doc["conversations"]:
        assert c["prompt_tokens"] == 40 + 3 + 2
        # blocks before the invocation (at 43): 0 and 1, from the base model's turn
        assert c["alora_cached_on"] == 2 * BLOCK_SIZE and c["alora_cached_off"] == 0
        assert c["lora_cached_on"] == 0  # a plain LoRA takes none of the base's blocks
        assert c["alora_ttft_on_ms"] > 0 and c["alora_ttft_off_ms"] > 0
    assert doc["outputs_identical"] == 1
    assert isinstance(doc["alora_ttft_on_over_off"], float)
    page = write_report(results, tmp_path / "page.md").read_text()
    assert "Activated LoRA after a base-model turn" in page
    assert "activated LoRA TTFT after a base turn, prefix caching on / off" in page
