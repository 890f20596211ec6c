"""Activated LoRA (PEFT's ``alora_invocation_tokens``) in the engine
(lorastream.worker.engine: ``activation.py``, the step's per-row slots, the prefix cache's keys).

Real PEFT aLoRA adapters on a tiny random checkpoint of every family, dense and MoE (B drawn at
random): the delta applies from the last invocation sequence of the prompt on, and to every
generated token; a prompt without it runs the base model. Greedy tokens equal PEFT's in ONE
mixed batch with a plain LoRA and the base model, with prefix caching on and off (a small token
budget splits prefills across the activation point); the blocks before the activation point
are the base model's and are shared (``cached_tokens``) with base-model requests and with
other activated adapters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lorastream.core.adapter_validation import validate_adapter_dir
from lorastream.core.errors import InvalidAdapter
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.engine.activation import NEVER, activation_start
from lorastream.worker.engine.engine import Engine
from lorastream.worker.loading.adapter import check_fits
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.kv_cache import BLOCK_SIZE
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from tests.support.families import reference_model
from tests.support.models import (
    ALORA_INVOCATION,
    FAMILY_CONFIGS,
    FAMILY_TARGETS,
    MOE_CONFIGS,
    make_family_adapter,
    make_tiny_family,
)

BASE = "base"
INV = ALORA_INVOCATION
CONV = [(i * 37 + 11) % 250 + 3 for i in range(40)]  # a conversation: blocks 0, 1 and 8 tokens
PROMPTS: dict[str, list[int]] = {
    "mid": [*CONV, *INV, *range(100, 120)],  # activation at 40: blocks 0, 1 are the base's
    "twice": [*CONV[:10], *INV, *CONV[10:30], *INV, 70],  # the last one counts: 33
    "absent": [*CONV[:20], 17, 44, 5, 6],  # a partial invocation: the base model throughout
    "at-end": [*CONV[:35], *INV],  # activation at 35, the last prompt token invokes
    "at-start": [*INV, *CONV[:12]],  # activation at 0: a plain LoRA
}
# the dense families (sliding windows, soft-caps, fused qkv) and the MoE ones ("all-linear":
# attention, the router and Qwen2-MoE's shared expert)
FAMILIES = [*FAMILY_CONFIGS, *MOE_CONFIGS]
ADAPTERS = ("lora-r8", "alora-attn-r4", "alora-all-r8")
MODELS = (BASE, *ADAPTERS)
NEW_TOKENS = 6


def specs(family: str) -> dict[str, dict[str, object]]:
    """name -> make_family_adapter keywords: a plain LoRA and two activated ones on the same
    tokens (attention only, B large enough to change Gemma's soft-capped tokens; every
    projection, rsLoRA), in the family's module names."""
    # MoE bases: the activated ones on attention only (PEFT has no activated LoRA of a router);
    # the plain one is PEFT's all-linear everywhere (on a MoE base: the experts too, gate_up
    # at twice the rank by its rank_pattern)
    attention, _ = FAMILY_TARGETS.get(family, (["q_proj", "k_proj", "v_proj", "o_proj"], []))
    every = "all-linear" if family in FAMILY_TARGETS else attention
    return {
        "lora-r8": dict(rank=8, targets="all-linear", seed=21),
        "alora-attn-r4": dict(rank=4, targets=attention, seed=31, b_std=0.5,
                              alora_invocation_tokens=INV),
        "alora-all-r8": dict(rank=8, targets=every, use_rslora=True, seed=32,
                             alora_invocation_tokens=INV),
    }


@dataclass(frozen=True)
class Case:
    family: str
    checkpoint: Path
    adapters: dict[str, Path]
    reference: dict[tuple[str, str], list[int]]  # (model, prompt) -> PEFT's greedy tokens


def _greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False,
        )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    family = request.param
    root = tmp_path_factory.mktemp(f"alora-{family}")
    checkpoint = make_tiny_family(family, root / "model")
    adapters = {
        name: make_family_adapter(checkpoint, root / name, **spec)  # type: ignore[arg-type]  # spec: the function's own keywords
        for name, spec in specs(family).items()
    }
    reference = {}
    for name in MODELS:
        model = reference_model(checkpoint, adapters.get(name))
        for label, prompt in PROMPTS.items():
            reference[(name, label)] = _greedy(model, prompt)
    return Case(family, checkpoint, adapters, reference)


def make_engine(case: Case, tmp: Path, prefix_caching: bool) -> Engine:
    settings = WorkerSettings(
        model=str(case.checkpoint), served_model_name=BASE, model_cache_dir=tmp / "models",
        max_loras=4, max_lora_rank=16, prefix_caching=prefix_caching, kv_cache_bytes=4 << 20,
        max_num_tokens=24,  # prefills run in chunks, some of them across the activation point
    )
    engine = build_engine(settings, checkpoint=case.checkpoint)
    for name, path in case.adapters.items():
        engine.adapters.load(name, path, False, 60)
    return engine.start()


@pytest.fixture
def engines(case: Case, tmp_path: Path) -> Iterator[dict[bool, Engine]]:
    made = {on: make_engine(case, tmp_path / str(on), on) for on in (True, False)}
    yield made
    for engine in made.values():
        engine.stop()
        assert engine.healthy_after_stop(), "KV blocks or adapter references leaked"


def run_batch(engine: Engine, requests: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """Submit every (model, prompt) before reading any: one mixed batch. (tokens, cached)."""
    params = SamplingParams(max_tokens=NEW_TOKENS)
    streams = [engine.submit(m, PromptInput(token_ids=tuple(PROMPTS[p])), params)
               for m, p in requests]
    results = []
    for stream in streams:
        events = list(stream)
        results.append(([t for e in events for t in e.token_ids], events[-1].cached_tokens))
    return results


def test_the_activation_point_is_peft_offset(case: Case) -> None:
    """PEFT's ``calculate_alora_offsets`` counts from the end of the prompt (None: absent)."""
    from peft.tuners.lora.variants import calculate_alora_offsets

    peft = reference_model(case.checkpoint, case.adapters["alora-attn-r4"])
    for label, prompt in PROMPTS.items():
        (offset,) = calculate_alora_offsets(peft.peft_config, "default", torch.tensor([prompt]))
        start = activation_start(prompt, INV)
        assert start == (NEVER if offset is None else len(prompt) - offset), label
    assert activation_start(PROMPTS["mid"], ()) == 0  # a plain LoRA


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_mixed_batch_with_lora_and_base_gives_peft_greedy_tokens(
    case: Case, engines: dict[bool, Engine], prefix_caching: bool
) -> None:
    """Every (model, prompt) in one batch, twice (the second round reuses cached blocks where
    caching is on): PEFT's tokens each time."""
    engine = engines[prefix_caching]
    requests = [(m, p) for p in PROMPTS for m in MODELS]
    for round_ in range(2):
        for (model, prompt), (tokens, _) in zip(requests, run_batch(engine, requests),
                                                strict=True):
            assert tokens == case.reference[(model, prompt)], (
                f"{case.family} {model} {prompt} round {round_}")
    hits = engine.prefix.stats.hit_tokens
    assert (hits > 0) is prefix_caching


def test_the_references_tell_the_activation_point_apart(case: Case) -> None:
    """The comparison above proves something: each activated adapter changes the tokens where
    it is invoked (on every invoking prompt: one of them, Gemma's soft-caps keep some tokens;
    each such prompt: by one of them at least), its delta applied over the whole prompt would
    give other tokens, and a prompt that does not invoke it is the base model's (PEFT's
    semantics)."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    activated, invoking = ("alora-attn-r4", "alora-all-r8"), ("mid", "twice", "at-end")
    changed = {(name, prompt) for name in activated for prompt in invoking
               if case.reference[(name, prompt)] != case.reference[(BASE, prompt)]}
    assert {name for name, _ in changed} == set(activated), changed
    assert {prompt for _, prompt in changed} == set(invoking), changed
    for name in activated:
        assert case.reference[(name, "absent")] == case.reference[(BASE, "absent")]
        plain = LoraConfig.from_pretrained(case.adapters[name])
        plain.alora_invocation_tokens = None  # the same weights as a plain LoRA
        whole = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(case.checkpoint, dtype=torch.float32,
                                                 attn_implementation="eager"),
            case.adapters[name], config=plain,
        ).eval()
        assert any(_greedy(whole, PROMPTS[p]) != case.reference[(name, p)]
                   for p in ("mid", "twice", "at-end")), name


def test_blocks_before_the_activation_point_are_shared_with_the_base_and_other_alora(
    case: Case, engines: dict[bool, Engine]
) -> None:
    """``mid`` invokes at token 40: blocks 0 and 1 (tokens 0-31) are the base model's, block 2
    on the adapter's. ``cached_tokens`` shows which were taken, one request at a time."""
    engine = engines[True]
    two_blocks, three_blocks = 2 * BLOCK_SIZE, 3 * BLOCK_SIZE
    steps = [
        (BASE, 0),  # nothing cached yet
        ("alora-attn-r4", two_blocks),  # the base model's blocks 0, 1
        ("alora-all-r8", two_blocks),  # the same blocks, for another activated adapter
        ("alora-attn-r4", three_blocks),  # and its own block 2 (usable: (63 - 1) // 16 = 3)
        ("lora-r8", 0),  # a plain LoRA's rows all take its delta: nothing is the base's
        (BASE, three_blocks),  # the base model's own
    ]
    for model, cached in steps:
        [(tokens, got)] = run_batch(engine, [(model, "mid")])
        assert got == cached, model
        assert tokens == case.reference[(model, "mid")], model
    # a prompt that never invokes the adapter is the base model's, blocks and all
    run_batch(engine, [(BASE, "absent")])
    [(tokens, got)] = run_batch(engine, [("alora-attn-r4", "absent")])
    assert got == (len(PROMPTS["absent"]) - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert tokens == case.reference[(BASE, "absent")]


def test_invocation_tokens_outside_the_vocabulary_are_refused(case: Case) -> None:
    config = ModelConfig.from_dir(case.checkpoint)
    manifest = validate_adapter_dir(case.adapters["alora-attn-r4"]).manifest(
        adapter_id="x", name="a", source_uri="")
    check_fits(manifest, config, 16)
    wrong = manifest.replace(alora_invocation_tokens=(17, config.vocab_size))
    with pytest.raises(InvalidAdapter, match=rf"alora_invocation_tokens \[{config.vocab_size}\]"
                                             " lie outside"):
        check_fits(wrong, config, 16)
