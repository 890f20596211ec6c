"""``--cpu-kernels``: whether a worker takes the C++ CPU ops, and what happens when they cannot be
built (a machine without a C++ compiler): ``auto`` keeps torch's paths and says why, ``native``
refuses to start with the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.worker.device.cpu.kernel_choice import use_cpu_kernels

CPU = torch.device("cpu")


def test_auto_and_native_take_the_kernels_for_fp32_on_the_cpu() -> None:
    assert cpu_ops.load() is None, cpu_ops.load()
    assert use_cpu_kernels("auto", CPU, torch.float32) is True
    assert use_cpu_kernels("native", CPU, torch.float32) is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_never_takes_the_kernels(dtype: torch.dtype) -> None:
    assert use_cpu_kernels("torch", CPU, dtype) is False


def test_auto_keeps_torch_where_the_kernels_do_not_apply_and_native_says_why() -> None:
    assert use_cpu_kernels("auto", CPU, torch.bfloat16) is False
    with pytest.raises(ValueError, match="run fp32 on the CPU; this model is bfloat16 on cpu"):
        use_cpu_kernels("native", CPU, torch.bfloat16)


BROKEN_BUILD = """
import json, logging
import torch
from lorastream.worker.device.cpu.kernel_choice import use_cpu_kernels
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("lorastream").addHandler(Keep())
auto = use_cpu_kernels("auto", torch.device("cpu"), torch.float32)
try:
    use_cpu_kernels("native", torch.device("cpu"), torch.float32)
    refused = None
except RuntimeError as err:
    refused = str(err)
print(json.dumps({"auto": auto, "warnings": records, "refused": refused}))
"""


def test_kernels_that_cannot_build_leave_auto_on_torch_with_a_warning_and_native_refused(
    tmp_path: Path,
) -> None:
    """A fresh extension cache and a compiler that fails: the real build, failing."""
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", BROKEN_BUILD], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["auto"] is False
    [warning] = result["warnings"]
    assert "did not build" in warning and "torch's slower paths" in warning
    assert "/bin/false" in warning  # the reason, from the build
    assert result["refused"].startswith("--cpu-kernels native: the C++ CPU kernels did not build")
    assert "/bin/false" in result["refused"]


FRESH_BUILD = """
import json, os
from lorastream.kernels.cpu import ops as cpu_ops
before = os.environ["PATH"]
error = cpu_ops.load()
print(json.dumps({"error": error, "path_kept": os.environ["PATH"] == before}))
"""


def test_the_kernels_build_with_the_ninja_package_alone_and_leave_path_as_it_was(
    tmp_path: Path,
) -> None:
    """A fresh machine may have no ninja on PATH (only the runtime dependency's, in the venv):
    the build finds it there, and the process's PATH is unchanged afterwards (``lorastream up``
    prints commands by what PATH holds)."""
    tools = tmp_path / "bin"  # the compiler's toolchain, and no ninja
    tools.mkdir()
    for tool in ("c++", "as", "ld"):
        found = shutil.which(tool)
        assert found is not None, f"no {tool} on this machine"
        (tools / tool).symlink_to(found)
    env = {**os.environ, "PATH": str(tools),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    done = subprocess.run([sys.executable, "-c", FRESH_BUILD], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"error": None, "path_kept": True}, done.stderr[-2000:]


def test_the_build_directory_follows_the_sources_content_not_their_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two checkouts of one version share one build; another version gets its own directory,
    so neither rebuilds over the other (as a CI clone beside a working tree did)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    trees = []
    for tree in ("a", "b"):
        (tmp_path / tree).mkdir()
        trees.append([Path(shutil.copy(source, tmp_path / tree)) for source in cpu_ops.SOURCES])
    flags = cpu_ops._flags()
    named = []
    for sources in trees:
        monkeypatch.setattr(cpu_ops, "SOURCES", sources)
        named.append(cpu_ops._build_directory(flags))
    (name_a, build_a, copies_a), (name_b, build_b, _) = named
    assert name_a == name_b and build_a == build_b  # same content, other place: one build
    assert [c.read_bytes() for c in copies_a] == [s.read_bytes() for s in trees[0]]
    changed = trees[1][0]
    changed.write_bytes(changed.read_bytes() + b"\n// another version\n")
    name_c, build_c, copies_c = cpu_ops._build_directory(flags)
    assert name_c != name_a and build_c != build_a
    assert copies_c[0].read_bytes().endswith(b"// another version\n")
    assert cpu_ops._build_directory([*flags, "-DOTHER"])[0] != name_a  # flags count too
