"""``--quantization int8`` / ``int8-dynamic`` / ``fp8`` on CUDA: torch's kernels as the device
layer picks them (``device/quant_matmul.py``: ``_weight_int8pack_mm`` with bf16/fp16
activations, ``torch._int_mm`` padded to more than 16 rows, ``torch._scaled_mm`` with per-row
scales and a bf16 output), against the dequantized product and against HF transformers + PEFT
over the dequantized weights on the same GPU. fp8 needs compute capability 8.9 or newer: on an
older GPU its tests skip with the reason, and the worker's refusal of it is tested instead.

Bounds as on the CPU (tests/worker/model/test_quantization.py), the model in bf16 on the GPU: logits
within ``LOGIT_BOUND[mode] * max |logit|`` of the fp32 reference per token.
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
from tests.worker.conftest import ADAPTERS, PROMPTS, EngineFactory, peft_model

LOGIT_BOUND = {"int8": 0.04, "int8-dynamic": 0.10, "fp8": 0.65}  # bf16: a little above the CPU's


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


@pytest.mark.parametrize("mode", MODES)
def test_cuda_int8_mixed_batch_logits_agree_with_peft_over_dequantized_weights(
    cuda: torch.device, mode: str, tiny_model: Path, tiny_adapters: dict[str, Path]
) -> None:
    config = ModelConfig.from_dir(tiny_model)
    dtype = torch.bfloat16
    model = DecoderModel(config, load_weights(tiny_model, config, dtype, cuda), cuda,
                         mode)  # type: ignore[arg-type]  # mode: a str from the parametrize list
    slots = LoraSlots(config, len(ADAPTERS), 64, dtype, cuda)
    slot_of = {}
    for slot, (name, path) in enumerate(tiny_adapters.items()):
        w = adapter_weights(AdapterFetcher(Device(cuda), None).read_local(name, path), config, 64)
        slots.write(slot, w.adapter_id, w.rank, w.scaling, list(w.blocks))
        slot_of[name] = slot
    kv = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 4 << 20, dtype, cuda)
    backend = TorchLoraBackend(dtype, cuda)
    names, prompt = ["base", *ADAPTERS], PROMPTS[1]
    ids: list[int] = []
    positions: list[int] = []
    cache: list[int] = []
    token_slots: list[int] = []
    spans, rows = [], []
    for name in names:
        table, start, n = kv.allocator.allocate(len(prompt)), len(ids), len(prompt)
        ids += prompt
        positions += range(n)
        cache += slot_mapping(table, 0, n)
        token_slots += [slot_of.get(name, -1)] * n
        spans.append(PrefillSpan(start, n, n, torch.tensor(table)))
        rows.append(len(ids) - 1)
    batch = ForwardBatch(
        torch.tensor(ids), torch.tensor(positions), torch.tensor(positions) + 1,
        torch.tensor(cache), 0, torch.zeros(0, 0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long), tuple(spans), torch.tensor(rows),
    ).to(cuda)
    logits = model.forward(batch, kv, LoraStep(slots, backend, backend.prepare(token_slots, slots)))
    for row, name in enumerate(names):
        reference = _dequantized_peft(tiny_model, tiny_adapters.get(name), cuda, mode)
        with torch.no_grad():
            expected = reference(torch.tensor([prompt], device=cuda)).logits[0, -1]  # [V]
        err = float((logits[row] - expected).abs().max() / expected.abs().max())
        assert err <= LOGIT_BOUND[mode], f"{name}: max |Δlogit| / max |logit| = {err:.4f}"


@pytest.mark.parametrize("mode", MODES)
def test_cuda_int8_engine_serves_every_adapter(
    cuda: torch.device, mode: str, engine_factory: EngineFactory, tiny_adapters: dict[str, Path]
) -> None:
    engine = engine_factory(device="cuda", quantization=mode)
    assert all(isinstance(p, QuantLinear) for layer in engine.model.proj for p in layer)
    ops = WorkerOperations(engine)
    for name, path in tiny_adapters.items():
        ops.load_adapter(name, str(path))
    outputs = {}
    for name in ["tiny", *ADAPTERS]:
        stream = engine.submit(name, PromptInput(token_ids=tuple(PROMPTS[0])),
                               SamplingParams(max_tokens=8, ignore_eos=True))
        outputs[name] = [t for event in stream for t in event.token_ids]
    assert all(len(tokens) == 8 for tokens in outputs.values())
    assert any(outputs[name] != outputs["tiny"] for name in ADAPTERS)


@pytest.mark.skipif(_fp8_here(), reason="this GPU runs fp8: the refusal is for older ones")
def test_a_gpu_without_fp8_tensor_cores_refuses_fp8_before_loading_anything(
    engine_factory: EngineFactory,
) -> None:
    with pytest.raises(InvalidArgument, match=r"compute capability .* 8\.9 or newer"):
        engine_factory(device="cuda", quantization="fp8")
