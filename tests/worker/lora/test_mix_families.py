"""Weighted mixes of adapters (lorastream.worker.lora: a mix row's ``(slot, weight)`` entries)
on every dense family, against PEFT's ``add_weighted_adapter(combination_type="cat")``.

Per family (sliding windows, soft-caps, q/k norms, biases, Phi-3's fused projections): the
family case's three plain adapters; two mixes of different weights, one sharing ``attn-r4``
with a single-adapter row, neither starting with the rsLoRA adapter (PEFT copies the first
component's config). In ONE batch with the base model and that single adapter, each row's
last-token logits and greedy tokens (through the engine, prefix caching on and off) are PEFT's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.core.adapter_mix import mix_model
from lorastream.worker.engine.engine import Engine
from lorastream.worker.lora.backend import RowLora
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.operations import WorkerOperations
from tests.support.batched_forward import model_and_slots, prefill_last_logits
from tests.support.engine_rounds import two_rounds_match
from tests.support.families import (
    BASE,
    NEW_TOKENS,
    PROMPTS,
    FamilyCase,
    make_family_case,
    peft_mix_model,
    reference_model,
)
from tests.support.models import FAMILY_CONFIGS

FAMILIES = list(FAMILY_CONFIGS)  # the dense families
SINGLE = "attn-r4"
MIXES: dict[str, tuple[tuple[str, float], ...]] = {
    "mix-a": (("attn-r4", 0.7), ("mlp-r8", 0.6)),
    "mix-b": (("mlp-r8", 0.5), ("all-r16-rslora", 1.3)),
}


@pytest.fixture(scope="module", params=FAMILIES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    return make_family_case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def mix_reference(case: FamilyCase) -> dict[tuple[str, int], list[int]]:
    """(``mix:`` model name, prompt index) -> PEFT's cat-mix greedy tokens."""
    refs = {}
    for mix in MIXES.values():
        model = peft_mix_model(case.checkpoint, case.adapters, mix)
        with torch.no_grad():
            for i, prompt in enumerate(PROMPTS):
                out = model.generate(
                    torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                      dtype=torch.long),
                    max_new_tokens=NEW_TOKENS, do_sample=False,
                )
                refs[(mix_model(mix), i)] = out[0, len(prompt):].tolist()
    return refs


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole-prompt", "chunked-prefill"])
def test_mix_rows_beside_a_single_adapter_and_the_base_give_peft_cat_logits(
    case: FamilyCase, chunk: int | None
) -> None:
    model, slots, slot_of = model_and_slots(case.checkpoint, case.adapters)
    rows: dict[str, RowLora] = {SINGLE: slot_of[SINGLE]}
    rows |= {name: tuple((slot_of[a], w) for a, w in mix) for name, mix in MIXES.items()}
    names, prompt = [BASE, SINGLE, *MIXES], PROMPTS[1]
    logits = prefill_last_logits(model, slots, rows, names, prompt, chunk)  # [names, V]
    for row, name in enumerate(names):
        reference = (peft_mix_model(case.checkpoint, case.adapters, MIXES[name]) if name in MIXES
                     else reference_model(case.checkpoint, case.adapters.get(name)))
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, -1]  # [V]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4, msg=name)
    for row in (2, 3):  # a mix is neither the base nor the single adapter it shares
        assert not torch.allclose(logits[row], logits[0], atol=1e-3), names[row]
        assert not torch.allclose(logits[row], logits[1], atol=1e-3), names[row]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_mixes_in_the_engine_give_peft_cat_greedy_tokens(
    case: FamilyCase, mix_reference: dict[tuple[str, int], list[int]], tmp_path: Path,
    prefix_caching: bool,
) -> None:
    """Two rounds of one batch each (the base, the single adapter, both mixes by their ``mix:``
    model names); with the cache on a mix's second round reuses its own first-round blocks."""
    settings = WorkerSettings(
        model=str(case.checkpoint), served_model_name=BASE, max_loras=4, max_lora_rank=16,
        kv_cache_bytes=4 << 20, model_cache_dir=tmp_path / "models", prefix_caching=prefix_caching,
    )
    engine: Engine = build_engine(settings, checkpoint=case.checkpoint)
    try:
        ops = WorkerOperations(engine)
        for name, path in case.adapters.items():
            ops.load_adapter(name, str(path))
        mixes = [mix_model(mix) for mix in MIXES.values()]
        reference = {**case.reference, **mix_reference}
        cached = two_rounds_match(engine, [BASE, SINGLE, *mixes], PROMPTS, NEW_TOKENS, reference,
                                  case.family)
        assert all((cached[(mix, 1)] > 0) is prefix_caching for mix in mixes)
    finally:
        engine.stop()
    for mix, spec in zip(mixes, MIXES.values(), strict=True):  # the comparison proves something
        for component, _ in spec:
            assert any(mix_reference[(mix, i)] != case.reference[(component, i)]
                       for i in range(len(PROMPTS))), (case.family, mix, component)
