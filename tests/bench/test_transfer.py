"""The transfer benchmark's chunk-size sweep: size parsing and a tiny real run."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lorastream.bench.transfer import (
    checked_chunk_sizes,
    parse_size,
    parse_sizes,
    run_transfer_bench,
)
from lorastream.cli.main import app


@pytest.mark.parametrize(
    ("text", "size"),
    [("64K", 64 << 10), ("1M", 1 << 20), ("1048576", 1 << 20), ("4m", 4 << 20),
     (" 256k ", 256 << 10), ("1MiB", 1 << 20), ("2G", 2 << 30)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "-1K", "1.5M", "64Q", "K", "1 M B x"])
def test_parse_size_rejects_with_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="e.g. 64K, 1M, 1048576"):
        parse_size(text)


def test_parse_sizes_and_range_check() -> None:
    assert parse_sizes("1M,64K,") == [1 << 20, 64 << 10]
    assert checked_chunk_sizes([1 << 20, 64 << 10, 1 << 20]) == [64 << 10, 1 << 20]
    with pytest.raises(ValueError, match="out of range"):
        checked_chunk_sizes([16 << 20])
    with pytest.raises(ValueError, match="separated by commas"):
        parse_sizes(",")


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--chunk-sizes", "64K,huge"], "invalid size 'huge'"),
     (["--chunk-bytes", "9M"], "out of range")],
)
def test_cli_rejects_bad_sizes_before_running(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["bench", "transfer", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_sweep_reports_one_point_per_chunk_size_and_the_1m_point_at_top_level() -> None:
    result = run_transfer_bench(adapter_mb=2, repeats=1, chunk_sizes=[1 << 20, 256 << 10])
    points = result["points"]
    assert isinstance(points, list)
    assert [p["chunk_bytes"] for p in points] == [256 << 10, 1 << 20]
    for point in points:
        assert point["bare_mb_s"] > 0 and point["store_mb_s"] > 0 and point["verified_mb_s"] > 0
    head = points[1]
    assert result["chunk_bytes"] == 1 << 20
    assert result["store_vs_bare"] == head["store_vs_bare"]
    assert result["bare_grpc_MBps"] == head["bare_mb_s"]
    assert result["goal"] == "store_vs_bare >= 0.8"
    assert isinstance(result["command"], str) and isinstance(result["machine"], dict)
