"""``lorastream/kernels/cpu/int8.py``: the C++ int8 weight-only product (fp32 activations)
against the product over the dequantized weight, its packed layout, and ``--quantization int8``
on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.kernels.cpu.int8 import int8_weight_mm, pack, packed_rows, unpack
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.quant_linear import QuantLinear, dequantize, quantize
from lorastream.worker.model.weights import load_weights
from tests.support.models import make_tiny_family

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _ops() -> None:
    assert cpu_ops.load() is None, cpu_ops.load()  # the machines here build them


# N: whole blocks of 16, a partial last block, fewer than one; K: AVX2 lanes and a scalar tail
@pytest.mark.parametrize(("n", "k"), [(48, 64), (50, 37), (3, 5), (16, 576)])
# rows: the direct path (1-3), the panel's 6-row tiles and their partial last tile
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 6, 7, 13, 32])
def test_the_op_is_the_product_over_the_dequantized_weight(n: int, k: int, rows: int) -> None:
    torch.manual_seed(n * k + rows)
    wq = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n).bfloat16().float()  # int8 mode's scales are bf16 values
    x = torch.randn(rows, k)
    y = int8_weight_mm(x, pack(wq), scale)  # [T, N]
    expected = (x.double() @ (wq.double() * scale.double()[:, None]).T).float()
    assert y.shape == (rows, n) and y.dtype == torch.float32
    # fp32 sums in another order: within fp32 rounding of the largest term, not bf16's
    torch.testing.assert_close(y, expected, atol=2e-5 * k ** 0.5 * 127, rtol=1e-5)


def test_the_packed_layout_gives_back_the_matrix_and_its_rows() -> None:
    wq = torch.randint(-127, 128, (37, 9), dtype=torch.int8)
    packed = pack(wq)
    assert packed.shape == (3, 9, 16)  # ceil(37 / 16) blocks, zero past row 37
    assert torch.equal(packed[2, :, 5:], torch.zeros(9, 11, dtype=torch.int8))
    assert torch.equal(unpack(packed, 37), wq)
    ids = torch.tensor([[0, 36], [17, 16]])
    assert torch.equal(packed_rows(packed, ids), wq[ids])  # [2, 2, K], no whole copy


def test_the_op_refuses_a_layout_it_cannot_read() -> None:
    x, wq = torch.randn(2, 8), torch.randint(-127, 128, (16, 8), dtype=torch.int8)
    with pytest.raises(RuntimeError, match="packed must be"):
        int8_weight_mm(x, wq, torch.ones(16))  # [N, K], not packed
    with pytest.raises(RuntimeError, match="scale must be"):
        int8_weight_mm(x, pack(wq), torch.ones(40))


@pytest.mark.parametrize("k", [64, 72])  # 72: torch's int8pack would need K % 16 == 0
def test_int8_on_the_cpu_ops_holds_one_packed_copy_and_computes_in_fp32(k: int) -> None:
    torch.manual_seed(k)
    w, b, x = torch.randn(40, k) * 0.1, torch.randn(40), torch.randn(5, k)
    native = QuantLinear(w, b, "int8", keep_rows=True, native=True)
    plain = QuantLinear(w, b, "int8")  # torch's path: bf16 activations (or dequantize)
    assert native.kernel == "int8_weight_mm" and native._held is None
    wq, scale = quantize(w, "int8")
    assert torch.equal(native.weight_q, wq) and torch.equal(native.scale, scale)
    ids = torch.tensor([0, 39, 7])
    torch.testing.assert_close(native.rows(ids), dequantize(wq, scale)[ids], rtol=0, atol=0)
    expected = x @ dequantize(wq, scale).T + b  # [5, 40]
    y = native(x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    if k % 16 == 0:  # int8pack rounds the activations to bf16: the op's error is far smaller
        assert (y - expected).abs().max() * 50 < (plain(x) - expected).abs().max()
        assert not torch.equal(plain.exact_top(x, plain(x)), plain(x))  # so its top is redone
    assert native.exact_top(x, y) is y  # the op's product is already the fp32 one


def test_an_int8_model_runs_every_projection_on_the_op(tmp_path: Path) -> None:
    checkpoint = make_tiny_family("qwen3", tmp_path / "m")  # tied: the lookup reads packed rows
    config = ModelConfig.from_dir(checkpoint)
    weights = load_weights(checkpoint, config, torch.float32, CPU)
    model = DecoderModel(config, weights, CPU, "int8")
    projections = [p for layer in model.proj for p in layer] + [model.lm_head]
    assert all(isinstance(p, QuantLinear) and p.kernel == "int8_weight_mm" and p._held is None
               for p in projections)
    torch_path = DecoderModel(config, load_weights(checkpoint, config, torch.float32, CPU), CPU,
                              "int8", cpu_kernels="torch")
    assert all(p.kernel != "int8_weight_mm" for layer in torch_path.proj for p in layer)
