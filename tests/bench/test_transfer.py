"""The transfer benchmark's chunk-size sweep: size parsing and a tiny real run."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from benchpage.report_transfer import transfer_goals, transfer_section
from lorastream.bench.transfer import (
    CLIENTS,
    checked_chunk_sizes,
    parse_size,
    parse_sizes,
    run_transfer_bench,
)
from lorastream.cli.main import app
from lorastream.core.checksum import DEFAULT_TENSOR_DIGEST, TENSOR_DIGESTS


@pytest.mark.parametrize(
    ("text", "size"),
    [("64K", 64 << 10), ("1M", 1 << 20), ("1048576", 1 << 20), ("4m", 4 << 20),
     (" 256k ", 256 << 10), ("1MiB", 1 << 20), ("2G", 2 << 30)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "-1K", "1.5M", "64Q", "K", "1 M B x"])
def test_parse_size_rejects_with_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match=r"e.g. 64K, 1M, 1048576"):
        parse_size(text)


def test_parse_sizes_and_range_check() -> None:
    assert parse_sizes("1M,64K,") == [1 << 20, 64 << 10]
    assert checked_chunk_sizes([1 << 20, 64 << 10, 1 << 20]) == [64 << 10, 1 << 20]
    with pytest.raises(ValueError, match=r"out of range"):
        checked_chunk_sizes([16 << 20])
    with pytest.raises(ValueError, match=r"separated by commas"):
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
    result = run_transfer_bench(adapter_mb=2, repeats=1, chunk_sizes=[1 << 20, 256 << 10],
                                staging_mb=2)
    points = result["points"]
    assert isinstance(points, list)
    assert [p["chunk_bytes"] for p in points] == [256 << 10, 1 << 20]
    for point in points:
        for kind in CLIENTS:
            assert point[f"{kind}_mb_s"] > 0, kind
            assert point[f"{kind}_cpu_ms_per_mb"] > 0, kind  # the client process's CPU
        assert point["verified_vs_bare_kept"] > 0
    head = points[1]
    assert result["chunk_bytes"] == 1 << 20
    assert result["store_vs_bare"] == head["store_vs_bare"]
    assert result["bare_grpc_MBps"] == head["bare_mb_s"]
    assert result["goal"] == "store_vs_bare >= 0.8"
    assert result["bare_kept_MBps"] == head["bare_kept_mb_s"]
    assert result["store_verified_vs_bare_kept"] == head["verified_vs_bare_kept"]
    assert isinstance(result["command"], str) and isinstance(result["machine"], dict)
    # every tensor digest measured in the same run; the headline is the default's
    assert result["verified_digest"] == DEFAULT_TENSOR_DIGEST
    by_digest = result["verified_by_digest_vs_bare"]
    assert set(by_digest) == set(TENSOR_DIGESTS)
    assert result["store_verified_vs_bare"] == by_digest[DEFAULT_TENSOR_DIGEST]
    assert set(result["hash_GBps"]) == {"sha256", "blake3", "blake3_auto", "xxh3_128", "crc32c"}
    staging = result["staging"]
    assert staging["boto3_s"] > 0 and staging["preload_s"] > 0
    assert set(staging["preload_phases_s"]) == {"resolve", "download", "validate", "stage"}
    assert staging["goal"] == "preload_vs_boto3 >= 0.9"


def test_staging_can_be_skipped() -> None:
    assert run_transfer_bench(adapter_mb=1, repeats=1, staging_mb=0)["staging"] is None


def _result(point: dict[str, float], store_vs_bare: float, verified_vs_bare: float,
            **extra: object) -> dict[str, object]:
    """A transfer result of one 1 MiB point, as run_transfer_bench writes it."""
    return {"adapter_bytes": 96_000_000, "adapter_rank": 79, "repeats": 3,
            "chunk_bytes": 1 << 20, "store_vs_bare": store_vs_bare,
            "goal": "store_vs_bare >= 0.8", "store_verified_vs_bare": verified_vs_bare,
            "verified_digest": "xxh3-128", "goal_verified": "store_verified_vs_bare >= 0.8",
            "points": [point], **extra}


def test_the_section_shows_every_digest_and_the_staging_goal() -> None:
    point = {"chunk_bytes": 1 << 20, "bare_mb_s": 1000.0, "store_mb_s": 900.0,
             "store_vs_bare": 0.9, "verified_sha256_mb_s": 450.0, "verified_sha256_vs_bare": 0.45,
             "verified_blake3_mb_s": 700.0, "verified_blake3_vs_bare": 0.7,
             "verified_xxh3_mb_s": 850.0, "verified_xxh3_vs_bare": 0.85,
             "verified_mb_s": 850.0, "verified_vs_bare": 0.85}
    result = _result(point, 0.9, 0.85, hash_GBps={"sha256": 1.8, "xxh3_128": 24.0},
                     staging={"adapter_bytes": 78_000_000, "repeats": 1, "boto3_s": 1.0,
                              "preload_s": 1.2, "preload_vs_boto3": 0.83,
                              "goal": "preload_vs_boto3 >= 0.9",
                              "preload_phases_s": {"download": 1.0, "stage": 0.2}})
    goals = transfer_goals(result)
    assert [row[1] for row in goals] == ["0.90×", "0.85×", "0.83×"]
    assert [row[3] for row in goals][1:] == ["met", "**not met**"]
    section = transfer_section(result, {})
    for shown in ("verified, sha256: MB/s / bare", "450 / 0.45×", "850 / 0.85×", "… stage",
                  "xxh3-128", "S3 preload / boto3 download"):
        assert shown in section, shown
    old = {k: v for k, v in result.items() if k not in ("verified_digest", "goal_verified",
                                                          "hash_GBps", "staging")}
    old["points"] = [{k: v for k, v in point.items() if not k.startswith("verified_")}
                     | {"verified_mb_s": 450.0, "verified_vs_bare": 0.45}]
    assert "store, landed + sha256 MB/s" in transfer_section(old, {})
    assert len(transfer_goals(old)) == 1


def test_the_section_compares_with_a_bare_client_that_keeps_freed_buffers() -> None:
    point = {"chunk_bytes": 1 << 20, "bare_mb_s": 900.0, "bare_cpu_ms_per_mb": 1.1,
             "bare_kept_mb_s": 1500.0, "bare_kept_vs_bare": 1.667, "bare_kept_cpu_ms_per_mb": 0.6,
             "store_mb_s": 700.0, "store_vs_bare": 0.78, "store_cpu_ms_per_mb": 1.2,
             "verified_xxh3_mb_s": 950.0, "verified_xxh3_vs_bare": 1.05,
             "verified_xxh3_cpu_ms_per_mb": 0.95, "verified_mb_s": 950.0,
             "verified_vs_bare": 1.05, "verified_vs_bare_kept": 0.633}
    result = _result(point, 0.78, 1.05, store_verified_vs_bare_kept=0.633,
                     goal_verified_kept="store_verified_vs_bare_kept >= 0.8")
    goals = transfer_goals(result)
    assert [(row[1], row[3]) for row in goals] == [
        ("0.78×", "**not met**"), ("1.05×", "met"), ("0.63×", "**not met**")]
    assert "both keeping freed buffers" in goals[2][0]
    section = transfer_section(result, {})
    for shown in ("bare, buffers kept: MB/s / bare", "1,500 / 1.67×", "**Freed buffers.**",
                  "| bare gRPC, buffers kept | 0.60 | 1,500 |",
                  "| verified, xxh3-128, buffers kept | 0.95 | 950 |",
                  "On equal terms the verified stream runs at 0.63×"):
        assert shown in section, shown
