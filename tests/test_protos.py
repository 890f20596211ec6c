"""The committed protobuf modules are exactly what the pinned grpcio-tools generates from
protos/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    generated = _load_generator().generate(tmp_path)
    assert generated, "no protos were generated"
    for fresh in generated:
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `make protos` and commit"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is stale: run `make protos` and commit the result"
        )


@pytest.mark.parametrize(
    "module",
    [
        "lorastream.common.v1.common_pb2",
        "lorastream.adapter_store.v1.adapter_store_pb2_grpc",
        "lorastream.gpu_worker.v1.gpu_worker_pb2_grpc",
    ],
)
def test_generated_modules_import(module: str) -> None:
    __import__(module)
    assert module in sys.modules


def test_enums_start_with_unspecified() -> None:
    from lorastream.adapter_store.v1 import adapter_store_pb2
    from lorastream.common.v1 import common_pb2
    from lorastream.gpu_worker.v1 import gpu_worker_pb2

    enums = [
        common_pb2.DType,
        adapter_store_pb2.PreloadPhase,
        gpu_worker_pb2.FinishReason,
        gpu_worker_pb2.Residency,
    ]
    for enum in enums:
        zero = enum.Name(0)
        assert zero.endswith("_UNSPECIFIED"), zero
