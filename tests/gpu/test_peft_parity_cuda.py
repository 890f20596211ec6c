"""The engine on CUDA against HF transformers + PEFT on the same GPU: mixed batches of every
adapter and the base model.

- fp32 (TF32 off): the same greedy tokens as PEFT, with the torch and the Triton LoRA backends;
- bf16: the mixed batch's last-position logits within ``BF16_ATOL + BF16_RTOL * |ref|`` of PEFT in
  fp32, and each adapter's effect (its logits minus the base model's) pointing the same way as
  PEFT's (cosine >= ``BF16_MIN_COSINE``): bf16 rounds every weight and activation to 8 bits of
  mantissa, so tokens may part after a near tie, but an adapter read from the wrong slot or
  scaled wrongly is far outside these bounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.core.generation import PromptInput
from lorastream.worker.device.device import Device
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.loading.adapter import adapter_weights
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.backend import LoraStep, TorchLoraBackend
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.forward_batch import ForwardBatch, PrefillSpan
from lorastream.worker.model.kv_cache import KVCache
from lorastream.worker.model.weights import load_weights
from lorastream.worker.service.operations import WorkerOperations
from tests.worker.conftest import ADAPTERS, NEW_TOKENS, PROMPTS, EngineFactory, peft_model

BF16_ATOL = 5e-2  # logits of the tiny model are O(1)
BF16_RTOL = 2e-2
BF16_MIN_COSINE = 0.98


def _peft_on(device: torch.device, tiny_model: Path, adapter: Path | None) -> torch.nn.Module:
    return peft_model(tiny_model, adapter).to(device)


def _peft_greedy(model: torch.nn.Module, prompt: list[int], device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_mixed_batch_on_cuda_gives_peft_greedy_tokens(
    engine_factory: EngineFactory, tiny_model: Path, tiny_adapters: dict[str, Path],
    cuda: torch.device, backend: str,
) -> None:
    engine = engine_factory(start=False, device="cuda", dtype="float32", lora_backend=backend)
    assert engine.device.is_cuda
    ops = WorkerOperations(engine)
    for name, path in tiny_adapters.items():
        ops.load_adapter(name, str(path))
    streams = {
        (name, i): engine.submit(name, PromptInput(token_ids=tuple(prompt)),
                                 SamplingParams(max_tokens=NEW_TOKENS))
        for name in ["tiny", *ADAPTERS] for i, prompt in enumerate(PROMPTS)
    }
    engine.start()  # every request queued: they share the first steps
    for name in ["tiny", *ADAPTERS]:
        reference = _peft_on(cuda, tiny_model, None if name == "tiny" else tiny_adapters[name])
        for i, prompt in enumerate(PROMPTS):
            tokens = [t for event in streams[(name, i)] for t in event.token_ids]
            assert tokens == _peft_greedy(reference, prompt, cuda), f"{name} prompt {i}"
    assert engine.stats.peak_running == len(streams)


def _mixed_batch_logits(tiny_model: Path, tiny_adapters: dict[str, Path], dtype: torch.dtype,
                        device: torch.device) -> dict[str, torch.Tensor]:
    """One prefill step of PROMPTS[1] for the base model and every adapter together, on
    ``device`` in ``dtype``: the last position's logits of each, as fp32 [V]."""
    config = ModelConfig.from_dir(tiny_model)
    model = DecoderModel(config, load_weights(tiny_model, config, dtype, device), device)
    slots = LoraSlots(config, len(ADAPTERS) + 1, 64, dtype, device)
    fetcher = AdapterFetcher(Device(device), None)
    slot_of: dict[str, int] = {}
    for slot, (name, path) in enumerate(tiny_adapters.items(), start=1):
        w = adapter_weights(fetcher.read_local(name, path), config, 64)
        slots.write(slot, w.adapter_id, w.rank, w.scaling, list(w.blocks))
        slot_of[name] = slot
    kv = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 8 << 20, dtype, device)
    names, prompt = ["base", *ADAPTERS], PROMPTS[1]
    ids, positions, cache, token_slots, spans, rows = [], [], [], [], [], []
    for name in names:
        table = kv.allocator.allocate(len(prompt))
        start = len(ids)
        ids += prompt
        positions += range(len(prompt))
        cache += [table[j // 16] * 16 + j % 16 for j in range(len(prompt))]
        token_slots += [slot_of.get(name, -1)] * len(prompt)
        block_table = torch.tensor(table, device=device)
        spans.append(PrefillSpan(start, len(prompt), len(prompt), block_table))
        rows.append(len(ids) - 1)

    def on(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, device=device)

    batch = ForwardBatch(
        on(ids), on(positions), on(positions) + 1, on(cache), 0,
        torch.zeros(0, 0, dtype=torch.long, device=device),
        torch.zeros(0, dtype=torch.long, device=device), tuple(spans), on(rows),
    )
    backend = TorchLoraBackend(dtype, device)
    with torch.no_grad():
        meta = backend.prepare(token_slots, slots)
        out = model.forward(batch, kv, LoraStep(slots, backend, meta))
    return {name: row.float() for name, row in zip(names, out, strict=True)}


def test_bf16_mixed_batch_on_cuda_stays_within_the_stated_tolerance_of_peft_fp32(
    tiny_model: Path, tiny_adapters: dict[str, Path], cuda: torch.device
) -> None:
    logits = _mixed_batch_logits(tiny_model, tiny_adapters, torch.bfloat16, cuda)
    prompt = torch.tensor([PROMPTS[1]], device=cuda)
    expected: dict[str, torch.Tensor] = {}
    for name in ["base", *ADAPTERS]:
        ref = _peft_on(cuda, tiny_model, None if name == "base" else tiny_adapters[name])
        with torch.no_grad():
            expected[name] = ref(prompt).logits[0, -1].float()  # [V] fp32 reference
        torch.testing.assert_close(logits[name], expected[name], atol=BF16_ATOL, rtol=BF16_RTOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for name in ADAPTERS:
        ours = logits[name] - logits["base"]  # [V] what the adapter changes
        theirs = expected[name] - expected["base"]
        assert theirs.norm() > 10 * BF16_ATOL, f"{name} changes too little to prove anything"
        cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item()
        assert cosine >= BF16_MIN_COSINE, f"{name}: adapter effect cosine {cosine:.4f}"
