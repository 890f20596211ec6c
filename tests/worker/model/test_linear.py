"""The base projections' prepared product agrees with ``x @ w.T`` for every row count."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lorastream.worker.model.linear import Linear
from tests.worker.conftest import EngineFactory


@pytest.mark.parametrize("rows", [0, 1, 3, 32, 133])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (257, 65)])  # odd sizes too
def test_prepacked_fp32_product_matches_the_plain_one(rows: int, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(*shape, generator=gen)  # [N, K]
    linear = Linear(weight)
    assert linear.prepacked == torch.backends.mkldnn.is_available()
    x = torch.randn(rows, shape[1], generator=gen)  # [T, K]
    expected = x @ weight.T
    got = linear(x)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_a_strided_input_view_is_multiplied_correctly() -> None:
    weight = torch.randn(192, 64)
    wide = torch.randn(8, 150)
    x = wide[:, 10:74]  # [8, 64], rows 150 apart
    torch.testing.assert_close(Linear(weight)(x), x @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_use_the_plain_product(dtype: torch.dtype) -> None:
    weight = torch.randn(32, 16).to(dtype)
    linear = Linear(weight)
    assert not linear.prepacked
    x = torch.randn(4, 16).to(dtype)
    assert torch.equal(linear(x), x @ weight.T)


def test_prepacking_can_be_turned_off() -> None:
    weight = torch.randn(32, 16)
    linear = Linear(weight, prepack=False)
    assert not linear.prepacked
    x = torch.randn(4, 16)
    assert torch.equal(linear(x), x @ weight.T)


def test_a_prepacked_weight_is_not_kept_twice() -> None:
    weight = torch.randn(64, 32)
    ref = weakref.ref(weight)
    linear = Linear(weight)
    assert linear.prepacked  # the CPU build of torch ships oneDNN
    del weight
    gc.collect()
    assert ref() is None and linear.weight is None  # only the prepacked copy is left
    assert linear(torch.randn(3, 32)).shape == (3, 64)
    assert linear(torch.randn(0, 32)).shape == (0, 64)


def test_the_model_holds_each_projection_once(engine_factory: EngineFactory) -> None:
    model = engine_factory(start=False).model
    for layer, proj in zip(model.weights.layers, model.proj, strict=True):
        assert (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down) == (None, None, None, None)
        assert all(p.prepacked and p.weight is None for p in proj)
