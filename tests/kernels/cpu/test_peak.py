"""``lorastream/kernels/cpu/peak.py``: the cores' multiply-add peak per kind of product, the
roofline of the quantized-base benchmark (lorastream/bench/roofline.py)."""

from __future__ import annotations

import time

import pytest
import torch

from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.kernels.cpu.peak import KINDS, multiply_add_peak


@pytest.fixture(autouse=True)
def _ops() -> None:
    assert cpu_ops.load() is None, cpu_ops.load()  # the machines here build them


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_peak_is_a_rate_the_loop_really_ran_at(kind: str, threads: int) -> None:
    """A rate an AVX2 core can hold (8-32 multiply-adds per instruction, a few per cycle): a
    loop the compiler had dropped or folded would give thousands of times more, or none."""
    if threads > torch.get_num_threads():
        pytest.skip(f"torch runs {torch.get_num_threads()} thread(s) here")
    rate = multiply_add_peak(kind, seconds=0.02, threads=threads, repeats=2)
    assert 1e9 < rate < 1e12 * threads  # 1 G/s to 1 T/s a thread


@pytest.mark.parametrize("kind", KINDS)
def test_more_iterations_take_longer(kind: str) -> None:
    """The op's time follows its iteration count: the loops run, each iteration's work."""
    op = torch.ops.lorastream.multiply_add_peak
    op(kind, 100_000, 1)  # warm
    def seconds(iterations: int) -> float:
        start = time.perf_counter()
        op(kind, iterations, 1)
        return time.perf_counter() - start

    short = min(seconds(200_000) for _ in range(3))
    long = min(seconds(2_000_000) for _ in range(3))
    assert long > 3 * short  # 10x the iterations


@pytest.mark.parametrize(("kind", "iterations", "threads", "message"), [
    ("fp16", 10, 1, "kind is fp32, int8 or int16, not 'fp16'"),
    ("fp32", 0, 1, "iterations must be positive"),
    ("fp32", 10, 0, "threads is 1 to torch's thread count"),
    ("fp32", 10, 10_000, "threads is 1 to torch's thread count"),
])
def test_the_op_names_a_bad_argument(kind: str, iterations: int, threads: int,
                                     message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.lorastream.multiply_add_peak(kind, iterations, threads)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "bf16"}, "kind is one of fp32, int8, int16, not 'bf16'"),
    ({"kind": "fp32", "seconds": 0}, "seconds must be positive"),
    ({"kind": "fp32", "repeats": 0}, "repeats at least 1"),
])
def test_the_wrapper_names_a_bad_argument(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        multiply_add_peak(**kwargs)  # type: ignore[arg-type]  # a bad value on purpose
