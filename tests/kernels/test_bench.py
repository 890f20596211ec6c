"""The GPU kernel benchmark refuses to run without CUDA (every machine of this project)."""

from __future__ import annotations

import pytest
import torch

from lorastream.kernels.bench import main, run_kernel_bench

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")


def test_run_kernel_bench_raises_without_cuda() -> None:
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU.*unmeasured"):
        run_kernel_bench(batch_sizes=[1], ranks=[16])


def test_bench_main_exits_non_zero_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--batch-sizes", "1", "--ranks", "16"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "needs a CUDA GPU" in captured.err
