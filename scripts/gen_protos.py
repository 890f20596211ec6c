"""Regenerate the protobuf/gRPC modules under lorastream/ from protos/.

Usage: python scripts/gen_protos.py [OUT_DIR]   (default: the repository root)

protoc writes ``lorastream/<area>/v1/*_pb2*.py`` whose absolute imports (``from lorastream.common.v1
import common_pb2``) match the package layout, so no import rewriting is needed. The output depends
only on the .proto files and the pinned grpcio-tools, which tests/test_protos.py checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    """Generate every proto into ``out_dir``; return the generated files."""
    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    generated = []
    for proto in protos:
        rel_dir = Path(proto).parent  # e.g. lorastream/common/v1
        for pkg in [rel_dir, *rel_dir.parents][:-1]:  # every package level below out_dir
            (out_dir / pkg / "__init__.py").touch()
        generated += sorted((out_dir / rel_dir).glob("*_pb2*.py*"))
    return generated


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path)
