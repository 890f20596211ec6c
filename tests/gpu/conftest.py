"""GPU tests: the CUDA side of the device layer, the model and the Triton kernels, run by
``make test-gpu`` on a machine with CUDA (README, "GPU tests").

Without a CUDA device every test here is skipped, at setup, before its fixtures run, with the
reason ``NO_CUDA`` (``pytest -rs`` lists it); collection never needs a GPU, so ``make test``
collects these files everywhere. ``make test-gpu`` also sets ``TRITON_INTERPRET=0``:
tests/conftest.py otherwise puts Triton in its interpreter for the CPU-only machines, and the
kernel tests here refuse to run interpreted (they check the kernels compiled for the GPU).

The worker fixtures (tiny random Llama, PEFT adapters made on it, their HF + PEFT reference
tokens, engines, a store on loopback) are those of tests/worker/conftest.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.worker.conftest import (  # noqa: F401 - fixtures, used by name
    engine_factory,
    reference,
    store,
    tiny_adapters,
    tiny_model,
)

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip every test under tests/gpu when there is no CUDA device (before any fixture)."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)


@pytest.fixture(autouse=True)
def exact_fp32_matmuls() -> Iterator[None]:
    """fp32 on CUDA as on the CPU: no TF32 in matmuls or convolutions (parity is exact)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")
