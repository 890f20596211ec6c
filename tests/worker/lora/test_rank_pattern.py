"""PEFT's per-module ranks and alphas (``rank_pattern`` / ``alpha_pattern``) served exactly.

Each batch holds the bare base model, a plain adapter and adapters whose modules have their own
rank and alpha; each row's last logits must be PEFT's for its adapter, and each adapter must
change them. On the MoE families the adapters are PEFT's "all-linear" (which gives the fused
gate_up_proj twice the rank and alpha), once as PEFT writes it and once with patterns of our
own put first (first key wins) so the ratio folded into B is not 1. On the dense families (Llama,
and Phi-3's fused projections) q (qkv) gets rank 4 with its own alpha, the others rank 8, with
and without rsLoRA; a DoRA adapter with patterns, a LoRA on embed_tokens and lm_head of their
own ranks and alphas, and a weighted mix of two patterned adapters ride along. The patterned
adapter is also written into a slot that held a full-rank adapter before: its padding must be
zeros again. The worker's --max-lora-rank is compared with the largest module rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import adapter_weights
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.backend import RowLora
from lorastream.worker.model.config import ModelConfig
from tests.support.batched_forward import model_and_slots, prefill_last_logits
from tests.support.families import BASE, PROMPTS, peft_mix_model, reference_model
from tests.support.models import (
    MOE_CONFIGS,
    make_family_adapter,
    make_tiny_family,
    make_vocab_adapter,
)

SLOT_RANK = 16  # model_and_slots' slots: every adapter here is padded in them


@dataclass(frozen=True)
class Case:
    family: str
    checkpoint: Path
    adapters: dict[str, Path]
    mix: tuple[tuple[str, float], ...] = ()


def _logits_match_peft(case: Case, reused: str) -> None:
    """Every adapter's row (and the base's, and the mix's) gives PEFT's last logits, with
    ``reused`` written last over the slot of the full-rank adapter "filler"."""
    model, slots, slot_of = model_and_slots(case.checkpoint, case.adapters, rank=SLOT_RANK)
    fetcher = AdapterFetcher(Device("cpu"), None)
    w = adapter_weights(fetcher.read_local(reused, case.adapters[reused]),
                        ModelConfig.from_dir(case.checkpoint), SLOT_RANK)
    assert w.rank < SLOT_RANK
    slots.write(slot_of["filler"], w.adapter_id, w.rank, w.scaling, list(w.blocks),
                folds=w.folds)
    rows: dict[str, RowLora] = {BASE: -1, **slot_of, f"{reused}@reused": slot_of["filler"]}
    del rows["filler"]
    if case.mix:
        rows["mix"] = tuple((slot_of[a], weight) for a, weight in case.mix)
    prompt = PROMPTS[0]
    logits = dict(zip(rows, prefill_last_logits(model, slots, rows, list(rows), prompt),
                      strict=True))  # name -> [V]
    for name in rows:
        if name == "mix":
            reference = peft_mix_model(case.checkpoint, case.adapters, case.mix)
        else:
            reference = reference_model(case.checkpoint, case.adapters.get(name.split("@")[0]))
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, -1]  # [V]
        torch.testing.assert_close(logits[name], expected, rtol=1e-4, atol=1e-4, msg=name)
        if name != BASE:
            assert not torch.allclose(logits[name], logits[BASE], atol=1e-3), name


@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_peft_all_linear_on_moe_bases_gives_peft_logits(
    family: str, tmp_path: Path
) -> None:
    checkpoint = make_tiny_family(family, tmp_path / "model")
    adapters = {
        "all-linear": make_family_adapter(checkpoint, tmp_path / "all-linear", rank=4,
                                          targets="all-linear", seed=60),
        # ours first: q at rank 2, gate_up's and o's own alphas (their B gets a ratio != 1)
        "all-linear-own": make_family_adapter(
            checkpoint, tmp_path / "all-linear-own", rank=4, targets="all-linear", seed=61,
            rank_pattern={"q_proj": 2}, alpha_pattern={"gate_up_proj": 5.0, "o_proj": 3.0}),
        "attn-r8": make_family_adapter(checkpoint, tmp_path / "attn-r8", rank=8,
                                       targets=["q_proj", "v_proj"], seed=62),
        "filler": make_family_adapter(checkpoint, tmp_path / "filler", rank=SLOT_RANK // 2,
                                      targets="all-linear", seed=63),  # gate_up at SLOT_RANK
    }
    _logits_match_peft(Case(family, checkpoint, adapters), "all-linear-own")


@pytest.mark.parametrize(("family", "q"), [("llama", "q_proj"), ("phi3", "qkv_proj")])
@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_dense_rank_and_alpha_patterns_give_peft_logits(
    family: str, q: str, rslora: bool, tmp_path: Path
) -> None:
    checkpoint = make_tiny_family(family, tmp_path / "model")

    def patterned(name: str, seed: int, use_dora: bool = False) -> Path:
        return make_family_adapter(
            checkpoint, tmp_path / name, rank=8, alpha=16.0, targets="all-linear",
            use_rslora=rslora, use_dora=use_dora, seed=seed,
            rank_pattern={q: 4}, alpha_pattern={q: 16.0, "down_proj": 6.0})

    adapters = {
        "patterned": patterned("patterned", 70),
        "patterned-2": make_family_adapter(
            checkpoint, tmp_path / "patterned-2", rank=4, alpha=8.0, targets="all-linear",
            rank_pattern={"o_proj": 2, "gate_up_proj|gate_proj": 6}, seed=71),
        "dora-patterned": patterned("dora-patterned", 72, use_dora=True),
        "vocab-patterned": make_vocab_adapter(
            checkpoint, tmp_path / "vocab-patterned", rank=4, seed=75,
            target_modules=["q_proj", "embed_tokens", "lm_head"],
            rank_pattern={"embed_tokens": 2, "lm_head": 6},
            alpha_pattern={"embed_tokens": 5.0, "lm_head": 3.0}),
        "plain": make_family_adapter(checkpoint, tmp_path / "plain", rank=8,
                                     targets=["o_proj"], seed=73),
        "filler": make_family_adapter(checkpoint, tmp_path / "filler", rank=SLOT_RANK,
                                      targets="all-linear", seed=74),
    }
    # PEFT's cat mix copies its first component's config: a plain (not rsLoRA) one first
    mix = (("patterned-2", 0.6), ("patterned", -0.5))
    _logits_match_peft(Case(family, checkpoint, adapters, mix), "patterned")


def test_max_lora_rank_is_compared_with_the_largest_module_rank(tmp_path: Path) -> None:
    """PEFT's all-linear at r 4 on a MoE base holds gate_up_proj at rank 8: a worker of
    --max-lora-rank 4 refuses it before a slot, one of 8 takes it."""
    from lorastream.core.errors import InvalidAdapter

    checkpoint = make_tiny_family("qwen3_moe", tmp_path / "model")
    adapter = make_family_adapter(checkpoint, tmp_path / "all-linear", rank=4,
                                  targets="all-linear", seed=80)
    config = ModelConfig.from_dir(checkpoint)
    fetcher = AdapterFetcher(Device("cpu"), None)
    with pytest.raises(InvalidAdapter, match=r"has rank 8, above this worker's --max-lora-rank 4"):
        adapter_weights(fetcher.read_local("all-linear", adapter), config, 4)
    assert adapter_weights(fetcher.read_local("all-linear", adapter), config, 8).rank == 8
