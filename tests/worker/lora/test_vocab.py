"""An adapter's vocabulary modules served as transformers + PEFT compute them, in one mixed
batch with plain LoRAs and the base model (lorastream.worker.lora.vocab).

Per family (Llama: untied lm_head; Qwen2: tied; Gemma 2: tied, scaled embeddings, final
soft-cap): a tiny random checkpoint and one PEFT adapter of each kind -- new token rows
(TrainableTokens, on ids the prompts use), LoRA on embed_tokens, LoRA on lm_head (one saved with
the base layer PEFT keeps beside it), modules_to_save of both -- beside a plain LoRA, every
trained part drawn at random.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.worker.engine.engine import Engine
from lorastream.worker.engine.step_inputs import StepPlan, build_step_inputs
from lorastream.worker.lora.backend import LoraStep, TorchLoraBackend
from lorastream.worker.model.kv_cache import KVCache
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from tests.support.batched_forward import model_and_slots, prefill_last_logits, preloaded_store
from tests.support.engine_rounds import two_rounds_match
from tests.support.families import (
    BASE,
    NEW_TOKENS,
    PROMPTS,
    FamilyCase,
    reference_model,
    reference_tokens,
)
from tests.support.models import (
    FAMILY_CONFIGS,
    FAMILY_TARGETS,
    make_family_adapter,
    make_tiny_family,
    make_vocab_adapter,
)
from tests.support.step_sequences import StepSeq

FAMILIES = list(FAMILY_CONFIGS)  # the dense families
CPU = torch.device("cpu")
NEW_ROWS = [5, 9, 64, 70, 200, 17]  # token ids of the prompts whose rows the adapter replaces
FIRST = 4  # the tokens of every prompt the first step of test_logit_rows_... prefills
# (name, prompt, what it runs in the second step): one decode token, the rest of its prompt
# (its last row's logits) or 3 more tokens (rows without logits); two sequences of each head
# kind, the base model's rows between theirs
SECOND_STEP = [
    ("head-lora", 0, "decode"), (BASE, 1, "decode"), ("saved-modules", 2, "decode"),
    ("new-tokens", 0, "decode"), ("embed-lora", 1, "decode"),
    ("head-lora", 1, "rest"), (BASE, 0, "rest"), ("saved-modules", 1, "rest"),
    ("head-lora-base-saved", 2, "rest"), ("new-tokens-3", 2, "rest"), ("lora-r8", 0, "rest"),
    ("head-lora", 2, "some"), ("saved-modules", 0, "some"), ("head-lora-base-saved", 1, "some"),
]


def _adapters(checkpoint: Path, root: Path, family: str) -> dict[str, Path]:
    attention, _ = FAMILY_TARGETS[family]
    q = [attention[0]]
    kinds: dict[str, dict[str, object]] = {
        "new-tokens": dict(target_modules=q, trainable_token_indices=NEW_ROWS),
        # fewer rows, some at the same ids: each row reads its own slot's in the batched lookup
        "new-tokens-3": dict(target_modules=q, trainable_token_indices=NEW_ROWS[1:4]),
        "embed-lora": dict(target_modules=["embed_tokens", *q]),
        "head-lora": dict(target_modules=["lm_head", attention[-1]]),
        "head-lora-base-saved": dict(target_modules=["lm_head"], save_embedding_layers=True),
        "saved-modules": dict(target_modules=q, modules_to_save=["embed_tokens", "lm_head"]),
    }
    adapters = {name: make_vocab_adapter(checkpoint, root / name, rank=4, seed=30 + i, **spec)
                for i, (name, spec) in enumerate(kinds.items())}
    adapters["lora-r8"] = make_family_adapter(checkpoint, root / "lora-r8", rank=8,
                                              targets="all-linear", seed=29)
    return adapters


@pytest.fixture(scope="module", params=FAMILIES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    checkpoint = make_tiny_family(family, root / "model")
    adapters = _adapters(checkpoint, root, family)
    reference = {(name, i): tokens for name in [BASE, *adapters]
                 for i, tokens in reference_tokens(checkpoint, adapters.get(name)).items()}
    return FamilyCase(family, checkpoint, adapters, reference)


def test_mixed_batch_gives_peft_logits(case: FamilyCase) -> None:
    """Every kind, a plain LoRA and the base model prefill one prompt in ONE batch; each row's
    last logits are PEFT's for its adapter."""
    model, slots, slot_of = model_and_slots(case.checkpoint, case.adapters)
    prompt, names = PROMPTS[0], [BASE, *case.adapters]
    logits = prefill_last_logits(model, slots, slot_of, names, prompt)  # [names, V]
    base = None
    for row, name in enumerate(names):
        with torch.no_grad():
            expected = reference_model(case.checkpoint, case.adapters.get(name))(
                torch.tensor([prompt])).logits[0, -1]  # [V]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4, msg=name)
        if name == BASE:
            base = expected
        else:  # every adapter changes the logits: the comparison proves something
            assert not torch.allclose(expected, base, atol=1e-3), name


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_mixed_batch_from_the_store_gives_peft_greedy_tokens(
    case: FamilyCase, tmp_path: Path, prefix_caching: bool
) -> None:
    """Through the store's stream and the worker's tiers into slots, twice (the second round
    reuses cached prefixes where caching is on, each adapter's own): every request's greedy
    tokens are PEFT's."""
    with preloaded_store(case.adapters, tmp_path) as store:
        settings = WorkerSettings(
            model=str(case.checkpoint), served_model_name=BASE, port=0, store=store,
            max_loras=len(case.adapters), max_lora_rank=16, kv_cache_bytes=4 << 20,
            model_cache_dir=tmp_path / "models", prefix_caching=prefix_caching,
        )
        engine: Engine = build_engine(settings, checkpoint=case.checkpoint)
        try:
            cached = two_rounds_match(engine, [BASE, *case.adapters], PROMPTS, NEW_TOKENS,
                                      case.reference, case.family)
            assert (cached[("new-tokens", 1)] > 0) is prefix_caching
        finally:
            engine.stop()
    for name in case.adapters:  # each adapter changes the tokens: the comparison proves something
        assert any(case.reference[(name, i)] != case.reference[(BASE, i)] for i in range(3)), name


def test_logit_rows_in_step_order_read_their_own_heads(case: FamilyCase) -> None:
    """A step of decode rows (ordered by slot, the base model's last) and prefill chunks, some
    finishing their prompt and some not (rows without logits): the logit rows are a subset of
    the batch rows in another order, two of each head kind's slot with a base row between;
    every logits row is PEFT's at its position for its sequence's adapter."""
    model, slots, slot_of = model_and_slots(case.checkpoint, case.adapters)
    config = model.config
    kv = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 8 << 20,
                 torch.float32, CPU)
    backend = TorchLoraBackend(torch.float32, CPU)
    seqs = [StepSeq(PROMPTS[i], 0, kv.allocator.allocate(len(PROMPTS[i]) + 1),
                    slot_of.get(name, -1)) for name, i, _ in SECOND_STEP]

    def step(plan: StepPlan) -> tuple[torch.Tensor, list[StepSeq]]:  # [n, V], the rows' seqs
        inputs = build_step_inputs(plan)
        lora = LoraStep.for_step(slots, backend, inputs.token_slots, torch.float32, CPU,
                                 logit_rows=inputs.logit_rows)
        logits = model.forward(inputs.batch, kv, lora)
        for seq, count in inputs.fed:
            seq.num_computed += count
        return logits, inputs.samplers  # type: ignore[return-value]  # StepSeq as a Sequence

    step(StepPlan(prefill=[(seq, FIRST) for seq in seqs]))  # type: ignore[misc]  # StepSeq
    roles = [role for *_, role in SECOND_STEP]
    plan = StepPlan(
        decode=[seq for seq, role in zip(seqs, roles, strict=True) if role == "decode"],  # type: ignore[misc]  # StepSeq
        prefill=[(seq, len(seq.prompt_ids) - FIRST if role == "rest" else 3)  # type: ignore[misc]  # StepSeq
                 for seq, role in zip(seqs, roles, strict=True) if role != "decode"],
    )
    logits, samplers = step(plan)
    assert len(samplers) == sum(role != "some" for role in roles)
    expected = {}
    for name, i, _ in SECOND_STEP:
        if (name, i) not in expected:
            with torch.no_grad():
                expected[(name, i)] = reference_model(case.checkpoint, case.adapters.get(name))(
                    torch.tensor([PROMPTS[i]])).logits[0]  # [L, V]
    for row, seq in enumerate(samplers):
        name, i, role = SECOND_STEP[next(j for j, s in enumerate(seqs) if s is seq)]
        position = FIRST if role == "decode" else len(PROMPTS[i]) - 1
        torch.testing.assert_close(logits[row], expected[(name, i)][position],
                                   rtol=1e-4, atol=1e-4, msg=f"{name} prompt {i} {role}")
