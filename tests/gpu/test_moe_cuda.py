"""Mixture-of-experts bases on CUDA: the expert-LoRA Triton kernel compiled for the GPU, and the
engine's mixed batches of expert adapters and the base model against transformers + PEFT.

- ``moe_lora`` (``lorastream/kernels/moe_lora.py``) against its ``Semantics`` row by row, in
  fp32 and fp16 (tests/kernels/test_moe_lora.py runs the same kernel in the interpreter);
- fp32 (TF32 off) on a tiny random Qwen3-MoE, Mixtral and Qwen2-MoE: the engine with the torch
  and the Triton LoRA backends gives PEFT's greedy tokens (computed on the CPU) for LoRA on the
  routed experts (PEFT's ``target_parameters``) beside attention LoRA and the base model in one
  batch, prefix caching on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.core.generation import PromptInput
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.operations import WorkerOperations
from tests.support.families import BASE, NEW_TOKENS, PROMPTS, reference_tokens
from tests.support.models import (
    EXPERT_PARAMETERS,
    MOE_CONFIGS,
    make_expert_adapter,
    make_family_adapter,
    make_tiny_family,
)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("projections", [1, 2], ids=["down", "gate-up"])
def test_the_compiled_moe_lora_kernel_adds_each_rows_expert_delta_only(
    cuda: torch.device, dtype: torch.dtype, tol: float, projections: int
) -> None:
    from lorastream.kernels import _sgmv_triton
    from lorastream.kernels.moe_lora import moe_lora

    if _sgmv_triton.is_interpreted():
        pytest.skip("Triton runs in its interpreter (TRITON_INTERPRET=1): run `make test-gpu`, "
                    "which sets TRITON_INTERPRET=0")
    torch.manual_seed(0)
    slots, experts, rank, k, n, rows = 4, 8, 16, 64, 48, 200
    groups_n = slots * experts
    x = torch.randn(rows, k).to(dtype)  # [P, K]
    groups = torch.randint(-1, groups_n, (rows,), dtype=torch.int32)  # [P]; -1: no adapter
    a = (torch.randn(groups_n, projections * rank, k) * 0.3).to(dtype)  # [G, W * R, K]
    bs = [(torch.randn(groups_n, n, rank) * 0.3).to(dtype) for _ in range(projections)]
    scalings = torch.rand(groups_n, dtype=torch.float32) + 0.5  # [G]
    out = torch.randn(rows, n * projections).to(dtype)  # [P, W * N]
    expected = out.float().clone()
    for p, g in enumerate(groups.tolist()):  # the Semantics, row by row, on the CPU
        if g < 0:
            continue
        h = x[p].float() @ a[g].float().T
        for w, b in enumerate(bs):
            expected[p, w * n : (w + 1) * n] += (
                scalings[g] * h[w * rank : (w + 1) * rank] @ b[g].float().T)
    on = [t.to(cuda) for t in (x, groups, a, scalings, out)]
    out_cuda = on[4]
    moe_lora(on[0], on[1], on[2], [b.to(cuda) for b in bs], on[3], out_cuda)
    torch.testing.assert_close(out_cuda.float().cpu(), expected, rtol=tol, atol=tol)
    untouched = groups < 0
    assert bool(untouched.any()) and torch.equal(out_cuda.cpu()[untouched], out[untouched])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_fp32_mixed_batch_of_expert_adapters_on_cuda_gives_peft_greedy_tokens(
    cuda: torch.device, tmp_path: Path, family: str, backend: str
) -> None:
    checkpoint = make_tiny_family(family, tmp_path / "model")
    adapters = {
        "experts-q-r4": make_expert_adapter(checkpoint, tmp_path / "experts", rank=4,
                                            targets=["q_proj"], parameters=EXPERT_PARAMETERS,
                                            seed=21),
        "qkvo-r4": make_family_adapter(checkpoint, tmp_path / "qkvo", rank=4,
                                       targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=11),
    }
    reference = {(name, i): tokens
                 for name, path in [(BASE, None), *adapters.items()]
                 for i, tokens in reference_tokens(checkpoint, path).items()}
    engine = build_engine(WorkerSettings(
        model=str(checkpoint), served_model_name=BASE, max_loras=4, max_lora_rank=16,
        kv_cache_bytes=4 << 20, model_cache_dir=tmp_path / "models", device="cuda",
        dtype="float32", lora_backend=backend,
    ), checkpoint=checkpoint)
    try:
        assert engine.device.is_cuda
        ops = WorkerOperations(engine)
        for name, path in adapters.items():
            ops.load_adapter(name, str(path))
        streams = {
            (name, i): engine.submit(name, PromptInput(token_ids=tuple(PROMPTS[i])),
                                     SamplingParams(max_tokens=NEW_TOKENS))
            for name in [BASE, *adapters] for i in range(len(PROMPTS))
        }
        engine.start()  # every request queued: they run as one batch
        for key, stream in streams.items():
            assert [t for event in stream for t in event.token_ids] == reference[key], key
    finally:
        engine.stop()
    assert any(reference[("experts-q-r4", i)] != reference[(BASE, i)]
               for i in range(len(PROMPTS)))  # the expert deltas change the output
