"""Per model family, a tiny checkpoint, PEFT adapters on it and the transformers + PEFT greedy
tokens the worker must reproduce (shared by the family tests and the Triton backend's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.support.models import FAMILY_TARGETS, make_family_adapter, make_tiny_family

PROMPTS: list[list[int]] = [  # all longer than the sliding window (models.WINDOW)
    [5, 9, 33, 41, 7, 100, 3, 60, 61, 62, 90],
    [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82],
    [200, 17, 44, 45, 120, 121, 3, 8, 9],
]
NEW_TOKENS = 8
BASE = "base"


@dataclass(frozen=True)
class FamilyCase:
    family: str
    checkpoint: Path
    adapters: dict[str, Path]
    reference: dict[tuple[str, int], list[int]]  # (adapter or BASE, prompt index) -> tokens


def adapter_specs(family: str) -> dict[str, dict[str, object]]:
    """Three adapters: different ranks and targets (the family's names), one rsLoRA."""
    attention, mlp = FAMILY_TARGETS[family]
    return {
        "attn-r4": dict(rank=4, targets=attention, seed=11),
        "mlp-r8": dict(rank=8, targets=mlp, seed=12),
        "all-r16-rslora": dict(rank=16, targets="all-linear", use_rslora=True, seed=13),
    }


def reference_model(checkpoint: Path, adapter: Path | None) -> torch.nn.Module:
    """transformers (+ PEFT) with eager attention (Gemma 2's soft-capping needs it)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def peft_mix_model(
    checkpoint: Path, adapters: dict[str, Path], mix: tuple[tuple[str, float], ...]
) -> torch.nn.Module:
    """:func:`reference_model` with PEFT's ``add_weighted_adapter(combination_type="cat")`` of
    ``mix`` (adapter name, weight) active: the reference a weighted mix must match. The first
    component must not be rsLoRA (PEFT copies its config, so the new adapter's scaling would not
    be 1)."""
    from peft import PeftModel

    names = [name for name, _ in mix]
    model = PeftModel.from_pretrained(
        reference_model(checkpoint, None), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.add_weighted_adapter(names, [w for _, w in mix], "mix", combination_type="cat")
    model.set_adapter("mix")
    return model.eval()


def reference_tokens(checkpoint: Path, adapter: Path | None) -> dict[int, list[int]]:
    """Greedy tokens (up to NEW_TOKENS, stopping at eos) for every prompt."""
    model = reference_model(checkpoint, adapter)
    tokens = {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, do_sample=False,
            )
            tokens[i] = out[0, len(prompt):].tolist()
    return tokens


def dora_adapter_specs(family: str) -> dict[str, dict[str, object]]:
    """Two DoRA adapters (attention only; every projection, rsLoRA) beside a plain LoRA."""
    attention, _ = FAMILY_TARGETS[family]
    return {
        "lora-r8": dict(rank=8, targets="all-linear", seed=21),
        "dora-attn-r4": dict(rank=4, targets=attention, seed=22, use_dora=True),
        "dora-all-r8-rslora": dict(rank=8, targets="all-linear", use_rslora=True, seed=23,
                                   use_dora=True),
    }


def make_family_case(
    family: str, root: Path, specs: dict[str, dict[str, object]] | None = None
) -> FamilyCase:
    """``specs``: the adapters (:func:`adapter_specs` by default)."""
    checkpoint = make_tiny_family(family, root / "model")
    adapters = {
        name: make_family_adapter(checkpoint, root / name, **spec)  # type: ignore[arg-type]  # spec: the function's own keywords
        for name, spec in (specs or adapter_specs(family)).items()
    }
    reference = {}
    for name in [BASE, *adapters]:
        for i, tokens in reference_tokens(checkpoint, adapters.get(name)).items():
            reference[(name, i)] = tokens
    return FamilyCase(family, checkpoint, adapters, reference)
