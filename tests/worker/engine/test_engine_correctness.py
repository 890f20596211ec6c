"""The engine against HF transformers + PEFT: one mixed batch, every adapter, same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.core.generation import FinishReason, PromptInput
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


def _collect(stream) -> tuple[list[int], str, FinishReason | None]:
    tokens, text, reason = [], "", None
    for event in stream:
        tokens.extend(event.token_ids)
        text += event.text
        reason = event.finish_reason
    return tokens, text, reason


@pytest.mark.parametrize("kernels", ["native", "torch"])  # --cpu-kernels
def test_one_mixed_batch_of_every_adapter_and_the_base_gives_peft_greedy_tokens(
    engine_factory: EngineFactory,
    tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
    kernels: str,
) -> None:
    # requests queue up and land in the same first step
    engine = engine_factory(start=False, cpu_kernels=kernels)
    assert engine.model.native_attention is (kernels == "native")
    assert engine.backend.native is (kernels == "native")  # type: ignore[attr-defined]  # native: on the torch backend only
    ops = WorkerOperations(engine)
    for name, path in tiny_adapters.items():
        ops.load_adapter(name, str(path))
    streams = {}
    for name in ["tiny", *ADAPTERS]:
        for i, prompt in enumerate(PROMPTS):
            streams[(name, i)] = engine.submit(
                name, PromptInput(token_ids=tuple(prompt)), SamplingParams(max_tokens=NEW_TOKENS)
            )
    engine.start()
    for (name, i), stream in streams.items():
        tokens, _, reason = _collect(stream)
        expected = reference[("base" if name == "tiny" else name, i)]
        assert tokens == expected, f"{name} prompt {i}"
        assert reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert engine.stats.peak_running == len(streams)  # all of them in one running batch
    for name in ADAPTERS:  # the adapters do change the output: the comparison proves something
        assert any(reference[(name, i)] != reference[("base", i)] for i in range(len(PROMPTS)))


@pytest.fixture(scope="module")
def model_and_slots(
    tiny_model: Path, tiny_adapters: dict[str, Path]
) -> tuple[DecoderModel, LoraSlots, dict[str, int]]:
    config = ModelConfig.from_dir(tiny_model)
    cpu = torch.device("cpu")
    model = DecoderModel(config, load_weights(tiny_model, config, torch.float32, cpu), cpu)
    slots = LoraSlots(config, len(ADAPTERS) + 1, 64, torch.float32, cpu)
    fetcher = AdapterFetcher(Device("cpu"), None)
    slot_of = {}
    for slot, (name, path) in enumerate(tiny_adapters.items(), start=1):
        buffer = fetcher.read_local(name, path)
        assert buffer.manifest is not None
        w = adapter_weights(buffer, config, 64)
        slots.write(slot, w.adapter_id, w.rank, w.scaling, list(w.blocks))
        slot_of[name] = slot
    return model, slots, slot_of


@pytest.mark.parametrize("chunk", [None, 3], ids=["whole-prompt", "chunked-prefill"])
def test_mixed_batch_logits_agree_with_peft_within_fp32_tolerance(
    model_and_slots: tuple[DecoderModel, LoraSlots, dict[str, int]],
    tiny_model: Path,
    tiny_adapters: dict[str, Path],
    chunk: int | None,
) -> None:
    model, slots, slot_of = model_and_slots
    config = model.config
    kv = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 8 << 20,
                 torch.float32, model.device)
    backend = TorchLoraBackend(torch.float32, model.device)
    names = ["base", *ADAPTERS]
    prompt = PROMPTS[1]
    tables = {name: kv.allocator.allocate(len(prompt)) for name in names}
    done, logits = 0, {}
    if chunk is None:
        steps = [len(prompt)]
    else:
        steps = [chunk] * (len(prompt) // chunk) + [len(prompt) % chunk]
    for length in [s for s in steps if s]:  # every adapter prefills the same chunk each step
        ids, positions, cache, token_slots, spans, rows = [], [], [], [], [], []
        for name in names:
            table = tables[name]
            start = len(ids)
            ids += prompt[done : done + length]
            positions += range(done, done + length)
            cache += [table[j // 16] * 16 + j % 16 for j in range(done, done + length)]
            token_slots += [slot_of.get(name, -1)] * length
            spans.append(PrefillSpan(start, length, done + length, torch.tensor(table)))
            rows.append(len(ids) - 1)
        batch = ForwardBatch(
            torch.tensor(ids), torch.tensor(positions), torch.tensor(positions) + 1,
            torch.tensor(cache), 0, torch.zeros(0, 0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long), tuple(spans), torch.tensor(rows),
        )
        meta = backend.prepare(token_slots, slots)
        out = model.forward(batch, kv, LoraStep(slots, backend, meta))
        done += length
        logits = dict(zip(names, out, strict=True))
    for name in names:
        ref_model = peft_model(tiny_model, None if name == "base" else tiny_adapters[name])
        with torch.no_grad():
            expected = ref_model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[name], expected, rtol=1e-4, atol=1e-4)
        if name != "base":
            assert not torch.allclose(logits[name], logits["base"], atol=1e-3), name
