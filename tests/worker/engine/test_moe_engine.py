"""The engine (lorastream.worker.engine) on mixture-of-experts bases against transformers + PEFT.

Per MoE family and expert layout (fused, per expert), with prefix caching on and off: the bare
base model and three attention-only LoRA adapters (ranks 4, 8, 16; one rsLoRA) in ONE batch give
PEFT's greedy tokens, then again in a second wave that reuses the first's cached prefixes. An
adapter on the experts is refused by name and never reaches a slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from lorastream.core import errors
from lorastream.core.generation import PromptInput
from lorastream.worker.engine.engine import Engine
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.operations import WorkerOperations
from tests.support.families import BASE, NEW_TOKENS, PROMPTS, reference_tokens
from tests.support.models import MOE_CONFIGS, make_family_adapter, make_tiny_family, split_experts

ADAPTERS = {  # attention only: the LoRA a MoE base takes today
    "qkvo-r4": dict(rank=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=11),
    "qv-r8-rslora": dict(rank=8, targets=["q_proj", "v_proj"], use_rslora=True, seed=12),
    "ko-r16": dict(rank=16, targets=["k_proj", "o_proj"], seed=13),
}


@dataclass(frozen=True)
class MoeCase:
    family: str
    checkpoints: dict[str, Path]  # layout -> checkpoint
    adapters: dict[str, Path]
    reference: dict[tuple[str, int], list[int]]  # (adapter or BASE, prompt) -> tokens


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MoeCase:
    root = tmp_path_factory.mktemp(request.param)
    fused = make_tiny_family(request.param, root / "fused")
    adapters = {
        name: make_family_adapter(fused, root / name, **spec)  # type: ignore[arg-type]  # spec: the function's own keywords
        for name, spec in ADAPTERS.items()
    }
    reference = {
        (name, i): tokens
        for name in [BASE, *adapters]
        for i, tokens in reference_tokens(fused, adapters.get(name)).items()
    }
    checkpoints = {"fused": fused, "per-expert": split_experts(fused, root / "per-expert")}
    return MoeCase(request.param, checkpoints, adapters, reference)


def _engine(checkpoint: Path, tmp_path: Path, **settings: object) -> Engine:
    return build_engine(WorkerSettings(
        model=str(checkpoint), served_model_name=BASE, max_loras=4, max_lora_rank=16,
        kv_cache_bytes=4 << 20, model_cache_dir=tmp_path / "models", **settings,
    ), checkpoint=checkpoint)


def _run(engine: Engine, keys: list[tuple[str, int]]) -> dict[tuple[str, int], list[int]]:
    streams = {
        (name, i): engine.submit(name, PromptInput(token_ids=tuple(PROMPTS[i])),
                                 SamplingParams(max_tokens=NEW_TOKENS))
        for name, i in keys
    }
    if not engine.started:
        engine.start()  # every request is queued: they run as one batch
    return {key: [t for event in s for t in event.token_ids] for key, s in streams.items()}


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_a_mixed_batch_of_attention_adapters_and_the_base_gives_peft_greedy_tokens(
    case: MoeCase, tmp_path: Path, layout: str, prefix_caching: bool
) -> None:
    engine = _engine(case.checkpoints[layout], tmp_path, prefix_caching=prefix_caching)
    try:
        ops = WorkerOperations(engine)
        for name, path in case.adapters.items():
            ops.load_adapter(name, str(path))
        keys = [(name, i) for name in [BASE, *case.adapters] for i in range(len(PROMPTS))]
        for wave in range(2):  # the second wave hits the first's cached prefixes (when on)
            results = _run(engine, keys)
            for key in keys:
                assert results[key] == case.reference[key], f"{case.family} {layout} {key} {wave}"
            if wave == 0:
                done_at_once = sum(len(case.reference[key]) == 1 for key in keys)
                assert engine.stats.peak_running == len(keys) - done_at_once  # one batch
        assert (engine.prefix.stats.hit_rate > 0) is prefix_caching
    finally:
        engine.stop()
    for name in case.adapters:  # each adapter changes the output: the comparison proves something
        assert any(case.reference[(name, i)] != case.reference[(BASE, i)] for i in range(3))


EXPERT_PARAMETERS = r"LoRA on mixture-of-experts experts .* not supported yet"


def test_lora_on_the_experts_is_refused_by_name_before_a_slot(
    case: MoeCase, tmp_path: Path
) -> None:
    """PEFT's LoRA on the fused experts (``target_parameters``, as transformers 5 trains it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(case.checkpoints["fused"])
    config = LoraConfig(r=4, target_modules=["q_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    path = tmp_path / "adapter"
    get_peft_model(base, config).save_pretrained(path)
    engine = _engine(case.checkpoints["fused"], tmp_path)
    try:
        with pytest.raises(errors.InvalidAdapter,
                           match=EXPERT_PARAMETERS + r".*mlp\.experts\.(gate_up|down)_proj"):
            WorkerOperations(engine).load_adapter("bad", str(path))
        assert engine.adapters.usage().slots_used == 0
    finally:
        engine.stop()


def test_a_local_moe_checkpoint_starts_a_worker_as_up_model_does(
    case: MoeCase, tmp_path: Path
) -> None:
    """``--model <dir>`` (``lorastream up``, ``worker serve``): resolved, checked, served."""
    checkpoint = case.checkpoints["per-expert"]
    engine = build_engine(WorkerSettings(
        model=str(checkpoint), served_model_name=BASE, kv_cache_bytes=1 << 20,
        model_cache_dir=tmp_path / "models",
    ))
    try:
        assert engine.model.config.family == case.family
        assert _run(engine, [(BASE, 0)])[(BASE, 0)] == case.reference[(BASE, 0)]
    finally:
        engine.stop()
