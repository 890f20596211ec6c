"""``--attention-backend``: which decode path a model takes, and what happens when the native
kernel cannot be built (a machine without a C++ compiler): ``auto`` keeps torch's path and says
why, ``native`` refuses to start with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorastream.kernels import cpu_attention
from lorastream.worker.model.attention import use_native

CPU = torch.device("cpu")


def test_auto_and_native_take_the_kernel_for_fp32_on_the_cpu() -> None:
    assert cpu_attention.load() is None, cpu_attention.load()
    assert use_native("auto", CPU, torch.float32) is True
    assert use_native("native", CPU, torch.float32) is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_never_takes_the_kernel(dtype: torch.dtype) -> None:
    assert use_native("torch", CPU, dtype) is False


def test_auto_keeps_torch_where_the_kernel_does_not_apply_and_native_says_why() -> None:
    assert use_native("auto", CPU, torch.bfloat16) is False
    with pytest.raises(ValueError, match="fp32 on the CPU; this model is bfloat16 on cpu"):
        use_native("native", CPU, torch.bfloat16)


BROKEN_BUILD = """
import json, logging
import torch
from lorastream.worker.model.attention import use_native
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("lorastream").addHandler(Keep())
auto = use_native("auto", torch.device("cpu"), torch.float32)
try:
    use_native("native", torch.device("cpu"), torch.float32)
    refused = None
except RuntimeError as err:
    refused = str(err)
print(json.dumps({"auto": auto, "warnings": records, "refused": refused}))
"""


def test_a_kernel_that_cannot_build_leaves_auto_on_torch_with_a_warning_and_native_refused(
    tmp_path: Path,
) -> None:
    """A fresh extension cache and a compiler that fails: the real build, failing."""
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", BROKEN_BUILD], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["auto"] is False
    [warning] = result["warnings"]
    assert "did not build" in warning and "torch's slower SDPA path" in warning
    assert "/bin/false" in warning  # the reason, from the build
    assert result["refused"].startswith("--attention-backend native: the CPU kernel did not build")
    assert "/bin/false" in result["refused"]
