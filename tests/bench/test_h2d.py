"""The host -> device benchmark refuses to run without CUDA (every machine of this project);
tests/gpu/test_h2d_bench_cuda.py runs it on a GPU."""

from __future__ import annotations

import pytest
import torch

from lorastream.bench.h2d import main, run_h2d_bench

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")


def test_run_raises_without_cuda() -> None:
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU.*unmeasured"):
        run_h2d_bench(repeats=1)


def test_main_exits_2_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--repeats", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "needs a CUDA GPU" in captured.err
