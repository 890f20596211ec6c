"""Every adapter kind on mixture-of-experts bases, batched with expert LoRA and the base model.

Per MoE family (Qwen3-MoE, Mixtral, Qwen2-MoE), one prefill batch holds the bare base model, a
LoRA on the experts (PEFT's fused ``target_parameters``), a DoRA adapter on attention, the
vocabulary kinds (new token rows, LoRA on ``embed_tokens`` and on ``lm_head``, saved
``embed_tokens`` and ``lm_head``) and a weighted mix of two attention LoRAs. Each row's last
logits must be PEFT's for its adapter (``add_weighted_adapter(combination_type="cat")`` for the
mix); each adapter must change them (the comparison proves something). The same kinds on the
dense families: test_dora.py, test_vocab.py, test_mix_families.py; aLoRA on MoE bases:
tests/worker/engine/test_activated_lora.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lorastream.worker.lora.backend import RowLora
from tests.support.batched_forward import model_and_slots, prefill_last_logits
from tests.support.families import BASE, PROMPTS, peft_mix_model, reference_model
from tests.support.models import (
    EXPERT_PARAMETERS,
    MOE_CONFIGS,
    make_expert_adapter,
    make_family_adapter,
    make_tiny_family,
    make_vocab_adapter,
)

NEW_ROWS = [5, 9, 64, 70, 200, 17]  # token ids of the prompts whose rows the adapter replaces
MIX = (("attn-q-r4", 0.7), ("attn-kv-r8", -0.4))


@dataclass(frozen=True)
class Case:
    family: str
    checkpoint: Path
    adapters: dict[str, Path]


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    checkpoint = make_tiny_family(family, root / "model")
    adapters = {
        "experts-r4": make_expert_adapter(checkpoint, root / "experts-r4", rank=4,
                                          targets=["o_proj"], parameters=EXPERT_PARAMETERS,
                                          seed=40),
        "dora-attn-r4": make_family_adapter(checkpoint, root / "dora-attn-r4", rank=4,
                                            targets=["q_proj", "v_proj"], use_dora=True, seed=41),
        "attn-q-r4": make_family_adapter(checkpoint, root / "attn-q-r4", rank=4,
                                         targets=["q_proj"], seed=42),
        "attn-kv-r8": make_family_adapter(checkpoint, root / "attn-kv-r8", rank=8,
                                          targets=["k_proj", "v_proj"], seed=43),
    }
    kinds: dict[str, dict[str, object]] = {
        "new-tokens": dict(target_modules=["q_proj"], trainable_token_indices=NEW_ROWS),
        "embed-lora": dict(target_modules=["embed_tokens", "q_proj"]),
        "head-lora": dict(target_modules=["lm_head", "o_proj"]),
        "saved-modules": dict(target_modules=["q_proj"],
                              modules_to_save=["embed_tokens", "lm_head"]),
    }
    for i, (name, spec) in enumerate(kinds.items()):
        adapters[name] = make_vocab_adapter(checkpoint, root / name, rank=4, seed=50 + i, **spec)
    return Case(family, checkpoint, adapters)


def test_every_kind_expert_lora_and_the_base_in_one_batch_give_peft_logits(case: Case) -> None:
    model, slots, slot_of = model_and_slots(case.checkpoint, case.adapters)
    rows: dict[str, RowLora] = {BASE: -1, **slot_of,
                                "mix": tuple((slot_of[a], w) for a, w in MIX)}
    prompt = PROMPTS[0]
    logits = dict(zip(rows, prefill_last_logits(model, slots, rows, list(rows), prompt),
                      strict=True))  # name -> [V]
    for name in rows:
        if name == "mix":
            reference = peft_mix_model(case.checkpoint, case.adapters, MIX)
        else:
            reference = reference_model(case.checkpoint, case.adapters.get(name))
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, -1]  # [V]
        torch.testing.assert_close(logits[name], expected, rtol=1e-4, atol=1e-4, msg=name)
        if name != BASE:
            assert not torch.allclose(logits[name], logits[BASE], atol=1e-3), name
