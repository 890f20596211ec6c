"""``--quantization int8`` / ``int8-dynamic`` / ``fp8`` on CUDA: torch's kernels as the device
layer picks them (``device/quant_matmul.py``: ``_weight_int8pack_mm`` with bf16/fp16
activations, ``torch._int_mm`` padded to more than 16 rows, ``torch._scaled_mm`` with per-row
scales and a bf16 output), against the dequantized product and against HF transformers + PEFT
over the dequantized weights on the same GPU. fp8 needs compute capability 8.9 or newer: on an
older GPU its tests skip with the reason, and the worker's refusal of it is tested instead.

Bounds as on the CPU (tests/worker/model/test_quantization.py), a little wider, the model in bf16 on
the GPU, fixed here: teacher-forced over every prompt plus the reference's greedy tokens, the worst
and the 95th-percentile max |Δlogit| / max |logit| per token, the argmax at the decisive positions
(top-2 margin above ``DECISIVE_MARGIN``) and at all of them; served tokens that are the reference's
choice or a near-tie at every step, for every adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import PromptInput
from lorastream.worker.device.device import Device
from lorastream.worker.device.quant_matmul import FP8_MIN_CAPABILITY
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.loading.adapter import adapter_weights
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.backend import LoraStep, TorchLoraBackend
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.forward_batch import ForwardBatch, PrefillSpan
from lorastream.worker.model.kv_cache import KVCache, slot_mapping
from lorastream.worker.model.quant_linear import QuantLinear, dequantized_weight
from lorastream.worker.model.weights import load_weights
from lorastream.worker.service.operations import WorkerOperations
from tests.support.logit_agreement import logit_agreement, within_near_tie
from tests.worker.conftest import (
    ADAPTERS,
    NEW_TOKENS,
    PROMPTS,
    EngineFactory,
    peft_model,
)

# The CPU's bounds (tests/worker/model/test_quantization.py), wider for the bf16 model, fixed here.
# Not yet measured on a GPU: set from this test run on the CPU with the model in bf16 (worst row
# 0.10-0.11 in every mode, 95th percentile 0.039 / 0.039 / 0.067, argmax 310, 316 and 302 of 320,
# every decisive position at these margins, 49-115 of them).
LOGIT_BOUND = {"int8": 0.15, "int8-dynamic": 0.15, "fp8": 0.65}
LOGIT_BOUND_P95 = {"int8": 0.06, "int8-dynamic": 0.08, "fp8": 0.15}
DECISIVE_MARGIN = {"int8": 0.08, "int8-dynamic": 0.10, "fp8": 0.15}
MIN_DECISIVE_AGREEMENT = 0.99
MIN_DECISIVE_SHARE = 0.15
MIN_RAW_AGREEMENT = {"int8": 0.93, "int8-dynamic": 0.93, "fp8": 0.85}


def _fp8_here() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY


NO_FP8 = pytest.mark.skipif(
    not _fp8_here(), reason="fp8 needs CUDA compute capability 8.9+ (Ada, Hopper, Blackwell)")
MODES = ["int8", "int8-dynamic", pytest.param("fp8", marks=NO_FP8)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_quant_linear_matches_the_dequantized_product(
    cuda: torch.device, mode: str, rows: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    w = (torch.randn(96, 128, device=cuda) * 0.1).to(dtype)
    x = torch.randn(rows, 128, device=cuda).to(dtype)
    linear = QuantLinear(w, None, mode)  # type: ignore[arg-type]  # mode: a str from the parametrize list
    assert linear.weight_q.device.type == "cuda"
    expected = x.float() @ linear.dequantized().T  # [T, N]
    y = linear(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    if mode == "fp8":  # K = 128 and N = 96: the tensor-core kernel, not the dequantize path
        assert linear.kernel == "scaled_mm" and linear.weight_q.dtype == torch.float8_e4m3fn
    bound = {"int8": 2e-2, "int8-dynamic": 4e-2, "fp8": 8e-2}[mode] * float(expected.abs().max())
    assert float((y.float() - expected).abs().max()) <= bound


def _dequantized_peft(tiny_model: Path, adapter: Path | None, cuda: torch.device, mode: str
                      ) -> torch.nn.Module:
    model = peft_model(tiny_model, None)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):  # int8-dynamic's weights are 7-bit
                module.weight.copy_(dequantized_weight(module.weight, mode))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    return model.to(cuda)


def _mixed_batch_logits(
    tiny_model: Path, tiny_adapters: dict[str, Path], sequences: dict[tuple[str, int], list[int]],
    mode: str, device: torch.device, dtype: torch.dtype,
) -> dict[tuple[str, int], torch.Tensor]:
    """Every sequence in ONE forward (each under its adapter), logits at every row [S, V]."""
    config = ModelConfig.from_dir(tiny_model)
    model = DecoderModel(config, load_weights(tiny_model, config, dtype, device), device,
                         mode)  # type: ignore[arg-type]  # mode: a str from the parametrize list
    slots = LoraSlots(config, len(ADAPTERS), 64, dtype, device)
    slot_of = {}
    for slot, (name, path) in enumerate(tiny_adapters.items()):
        w = adapter_weights(AdapterFetcher(Device(device), None).read_local(name, path), config, 64)
        slots.write(slot, w.adapter_id, w.rank, w.scaling, list(w.blocks))
        slot_of[name] = slot
    kv = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 4 << 20, dtype, device)
    backend = TorchLoraBackend(dtype, device)
    ids: list[int] = []
    positions: list[int] = []
    cache: list[int] = []
    token_slots: list[int] = []
    spans, where = [], {}
    for key, sequence in sequences.items():
        table, start, n = kv.allocator.allocate(len(sequence)), len(ids), len(sequence)
        ids += sequence
        positions += range(n)
        cache += slot_mapping(table, 0, n)
        token_slots += [slot_of.get(key[0], -1)] * n
        spans.append(PrefillSpan(start, n, n, torch.tensor(table)))
        where[key] = (start, n)
    batch = ForwardBatch(
        torch.tensor(ids), torch.tensor(positions), torch.tensor(positions) + 1,
        torch.tensor(cache), 0, torch.zeros(0, 0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long), tuple(spans), torch.arange(len(ids)),
    ).to(device)
    logits = model.forward(batch, kv, LoraStep(slots, backend, backend.prepare(token_slots, slots)))
    return {key: logits[start : start + n].float() for key, (start, n) in where.items()}


def _reference_greedy(model: torch.nn.Module, prompt: list[int], device: torch.device
                      ) -> list[int]:
    """HF greedy generation of up to NEW_TOKENS (stops at eos), generated ids only."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device), max_new_tokens=NEW_TOKENS, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        )
    return out[0, len(prompt):].tolist()


def _reference_logits(model: torch.nn.Module, sequence: list[int], device: torch.device
                      ) -> torch.Tensor:  # [S, V]
    with torch.no_grad():
        return model(torch.tensor([sequence], device=device)).logits[0].float()


@pytest.mark.parametrize("mode", MODES)
def test_cuda_int8_mixed_batch_agrees_with_peft_over_dequantized_weights(
    cuda: torch.device, mode: str, tiny_model: Path, tiny_adapters: dict[str, Path]
) -> None:
    """Teacher-forced over every prompt plus the reference's greedy tokens, the base model and
    every adapter in ONE mixed batch: the bounds of the CPU's test, a little wider for bf16."""
    references = {}
    for name in ["base", *ADAPTERS]:
        reference = _dequantized_peft(tiny_model, tiny_adapters.get(name), cuda, mode)
        for i, prompt in enumerate(PROMPTS):
            sequence = prompt + _reference_greedy(reference, prompt, cuda)
            references[(name, i)] = (sequence, _reference_logits(reference, sequence, cuda))
    ours = _mixed_batch_logits(tiny_model, tiny_adapters,
                               {key: seq for key, (seq, _) in references.items()}, mode, cuda,
                               torch.bfloat16)
    found = logit_agreement(((ours[key], expected) for key, (_, expected) in references.items()),
                            DECISIVE_MARGIN[mode])
    assert found.worst <= LOGIT_BOUND[mode], f"max |Δlogit| / max |logit| = {found.worst:.4f}"
    assert found.p95 <= LOGIT_BOUND_P95[mode], f"95th percentile {found.p95:.4f}"
    assert found.decisive >= MIN_DECISIVE_SHARE * found.positions, (
        f"{found.decisive}/{found.positions} decisive")
    assert found.decisive_agree >= MIN_DECISIVE_AGREEMENT * found.decisive, (
        f"{found.decisive_agree}/{found.decisive}")
    assert found.agree >= MIN_RAW_AGREEMENT[mode] * found.positions, (
        f"greedy agreement {found.agree}/{found.positions}")
    n = len(PROMPTS[1])  # the prompt's rows: the same input under every adapter
    for name in ADAPTERS:  # the adapters change the logits: the comparison proves something
        assert not torch.allclose(ours[(name, 1)][:n], ours[("base", 1)][:n], atol=1e-2)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_int8_engine_serves_every_adapter(
    cuda: torch.device, mode: str, engine_factory: EngineFactory, tiny_model: Path,
    tiny_adapters: dict[str, Path],
) -> None:
    """Each adapter's served tokens are its own reference's greedy choice at every step (or a
    near-tie there), teacher-forced through that adapter's dequantized PEFT model; and each
    differs from the base model's, so an adapter served with another's weights shows."""
    engine = engine_factory(device=cuda.type, quantization=mode)
    assert all(isinstance(p, QuantLinear) for layer in engine.model.proj for p in layer)
    ops = WorkerOperations(engine)
    for name, path in tiny_adapters.items():
        ops.load_adapter(name, str(path))
    prompt, outputs = PROMPTS[0], {}
    for name in ["tiny", *ADAPTERS]:
        stream = engine.submit(name, PromptInput(token_ids=tuple(prompt)),
                               SamplingParams(max_tokens=8, ignore_eos=True))
        outputs[name] = [t for event in stream for t in event.token_ids]
    assert all(len(tokens) == 8 for tokens in outputs.values())
    for name in ADAPTERS:
        assert outputs[name] != outputs["tiny"], f"{name} served as the base model"
    for name, tokens in outputs.items():
        reference = _dequantized_peft(tiny_model, tiny_adapters.get(name), cuda, mode)
        expected = _reference_logits(reference, prompt + tokens, cuda)[len(prompt) - 1 : -1]
        off = [step for step, token in enumerate(tokens)
               if not within_near_tie(token, expected[step], DECISIVE_MARGIN[mode])]
        assert not off, f"{name}: steps {off} are neither the reference's argmax nor a near-tie"


@pytest.mark.skipif(_fp8_here(), reason="this GPU runs fp8: the refusal is for older ones")
def test_a_gpu_without_fp8_tensor_cores_refuses_fp8_before_loading_anything(
    engine_factory: EngineFactory,
) -> None:
    with pytest.raises(InvalidArgument, match=r"compute capability .* 8\.9 or newer"):
        engine_factory(device="cuda", quantization="fp8")
