"""The engine against HF transformers + PEFT: one mixed batch, every adapter, same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.core.generation import FinishReason, PromptInput
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.service.operations import WorkerOperations
from tests.support.batched_forward import model_and_slots, prefill_last_logits
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


@pytest.mark.parametrize("chunk", [None, 3], ids=["whole-prompt", "chunked-prefill"])
def test_mixed_batch_logits_agree_with_peft_within_fp32_tolerance(
    tiny_model: Path,
    tiny_adapters: dict[str, Path],
    chunk: int | None,
) -> None:
    model, slots, slot_of = model_and_slots(tiny_model, tiny_adapters, rank=64, first_slot=1)
    names = ["base", *ADAPTERS]
    out = prefill_last_logits(model, slots, slot_of, names, PROMPTS[1], chunk)  # [names, V]
    logits = dict(zip(names, out, strict=True))
    prompt = PROMPTS[1]
    for name in names:
        ref_model = peft_model(tiny_model, None if name == "base" else tiny_adapters[name])
        with torch.no_grad():
            expected = ref_model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[name], expected, rtol=1e-4, atol=1e-4)
        if name != "base":
            assert not torch.allclose(logits[name], logits["base"], atol=1e-3), name
