"""The engine (lorastream.worker.engine) on mixture-of-experts bases against transformers + PEFT.

Per MoE family and expert layout (fused, per expert), with prefix caching on and off: the bare
base model and three attention-only LoRA adapters (ranks 4, 8, 16; one rsLoRA) in ONE batch give
PEFT's greedy tokens, then again in a second wave that reuses the first's cached prefixes.

LoRA on the experts, per adapter form (PEFT's fused ``target_parameters``; the older per-expert
``target_modules``, the same LoRA rewritten, whose reference is PEFT on the fused form), with
prefix caching on and off and with chunked prefill: two expert adapters, an attention-only one
and the base in one batch give PEFT's greedy tokens. PEFT's "all-linear" (experts, router,
attention; per-module ranks and alphas by its rank_pattern / alpha_pattern), as PEFT writes it
and with patterns of its own, beside an attention adapter and the base, with prefix caching on
and off, gives PEFT's greedy tokens too. An expert LoRA of the wrong expert count,
width or rank is refused at registration and never reaches a slot.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lorastream.core import errors
from lorastream.core.generation import PromptInput
from lorastream.worker.engine.engine import Engine
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.operations import WorkerOperations
from tests.support.engine_rounds import two_rounds_match
from tests.support.families import BASE, NEW_TOKENS, PROMPTS, reference_tokens
from tests.support.hub_server import HubServer
from tests.support.models import (
    EXPERT_PARAMETERS,
    MOE_CONFIGS,
    make_expert_adapter,
    make_family_adapter,
    make_tiny_family,
    per_expert_adapter,
    split_experts,
)

ADAPTERS = {  # attention only: the LoRA a MoE base takes today
    "qkvo-r4": dict(rank=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=11),
    "qv-r8-rslora": dict(rank=8, targets=["q_proj", "v_proj"], use_rslora=True, seed=12),
    "ko-r16": dict(rank=16, targets=["k_proj", "o_proj"], seed=13),
}
EXPERT_ADAPTERS = {  # name -> LoRA on the experts (and attention), PEFT's fused form
    "experts-q-r4": dict(rank=4, targets=["q_proj"], parameters=EXPERT_PARAMETERS, seed=21),
    "down-v-r8-rslora": dict(rank=8, targets=["v_proj"], parameters=["mlp.experts.down_proj"],
                             use_rslora=True, seed=22),
}


@dataclass(frozen=True)
class MoeCase:
    family: str
    checkpoints: dict[str, Path]  # layout -> checkpoint
    adapters: dict[str, Path]
    reference: dict[tuple[str, int], list[int]]  # (adapter or BASE, prompt) -> tokens
    expert_adapters: dict[str, dict[str, Path]]  # form -> name -> adapter


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MoeCase:
    root = tmp_path_factory.mktemp(request.param)
    fused = make_tiny_family(request.param, root / "fused")
    adapters = {
        name: make_family_adapter(fused, root / name, **spec)  # type: ignore[arg-type]  # spec: the function's own keywords
        for name, spec in ADAPTERS.items()
    }
    parameters = {
        name: make_expert_adapter(fused, root / name, **spec)  # type: ignore[arg-type]  # spec: the function's own keywords
        for name, spec in EXPERT_ADAPTERS.items()
    }
    reference = {
        (name, i): tokens
        for name, path in [(BASE, None), *adapters.items(), *parameters.items()]
        for i, tokens in reference_tokens(fused, path).items()
    }
    mixtral = request.param == "mixtral"
    per_expert = {  # the same LoRA (down_proj alone is the fused form only: PEFT's own form)
        "experts-q-r4": per_expert_adapter(parameters["experts-q-r4"], root / "per-expert-q",
                                           mixtral),
        "down-v-r8-rslora": parameters["down-v-r8-rslora"],
    }
    checkpoints = {"fused": fused, "per-expert": split_experts(fused, root / "per-expert")}
    return MoeCase(request.param, checkpoints, adapters, reference,
                   {"target_parameters": parameters, "per-expert": per_expert})


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


@pytest.mark.parametrize("form", ["target_parameters", "per-expert"])
@pytest.mark.parametrize(  # --cpu-kernels: native decode takes the C++ expert row op
    ("prefix_caching", "chunk", "kernels"),
    [(True, None, "native"), (False, None, "native"), (False, 5, "native"),
     (False, None, "torch")],
    ids=["prefix-cache", "no-prefix-cache", "chunked-prefill", "torch-kernels"])
def test_a_mixed_batch_of_expert_adapters_and_the_base_gives_peft_greedy_tokens(
    case: MoeCase, tmp_path: Path, form: str, prefix_caching: bool, chunk: int | None,
    kernels: str,
) -> None:
    settings: dict[str, object] = {"prefix_caching": prefix_caching, "cpu_kernels": kernels}
    if chunk is not None:  # a step's token budget below a prompt: prefill runs in chunks
        settings["max_num_tokens"] = chunk
    engine = _engine(case.checkpoints["fused"], tmp_path, **settings)
    adapters = {**case.expert_adapters[form], "qkvo-r4": case.adapters["qkvo-r4"]}
    try:
        ops = WorkerOperations(engine)
        for name, path in adapters.items():
            ops.load_adapter(name, str(path))
        # the second round hits the first's cached prefixes (when on)
        two_rounds_match(engine, [BASE, *adapters], PROMPTS, NEW_TOKENS, case.reference,
                         f"{case.family} {form}")
        assert (engine.prefix.stats.hit_rate > 0) is prefix_caching
    finally:
        engine.stop()
    for name in EXPERT_ADAPTERS:  # each expert adapter changes the output
        assert any(case.reference[(name, i)] != case.reference[(BASE, i)] for i in range(3))


ALL_LINEAR = {  # name -> PEFT's all-linear on a MoE base (gate_up_proj at twice r and alpha)
    "all-linear-r4": dict(rank=4, targets="all-linear", seed=41),
    "all-linear-own": dict(rank=4, targets="all-linear", seed=42, rank_pattern={"q_proj": 2},
                           alpha_pattern={"gate_up_proj": 5.0, "o_proj": 3.0}),
}


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_peft_all_linear_adapters_in_a_mixed_batch_give_peft_greedy_tokens(
    case: MoeCase, tmp_path: Path, prefix_caching: bool
) -> None:
    checkpoint = case.checkpoints["fused"]
    adapters = {name: make_family_adapter(checkpoint, tmp_path / name, **spec)  # type: ignore[arg-type]  # spec: the function's own keywords
                for name, spec in ALL_LINEAR.items()}
    reference = {(name, i): t for name, path in adapters.items()
                 for i, t in reference_tokens(checkpoint, path).items()}
    for name in adapters:  # each adapter changes the output: the comparison proves something
        assert any(reference[(name, i)] != case.reference[(BASE, i)] for i in range(3)), name
    adapters["qkvo-r4"] = case.adapters["qkvo-r4"]
    engine = _engine(checkpoint, tmp_path, prefix_caching=prefix_caching)
    try:
        ops = WorkerOperations(engine)
        for name, path in adapters.items():
            ops.load_adapter(name, str(path))
        # the second round hits the first's cached prefixes (when on)
        two_rounds_match(engine, [BASE, *adapters], PROMPTS, NEW_TOKENS,
                         {**case.reference, **reference}, case.family)
        assert (engine.prefix.stats.hit_rate > 0) is prefix_caching
    finally:
        engine.stop()


BLOCK_ADAPTERS = {  # family -> LoRA on the MoE block's plain weights, as PEFT 0.21 trains it
    # the router: target_modules "gate" becomes target_parameters "gate.weight" (Qwen3-MoE;
    # PEFT refuses Qwen2-MoE's and Mixtral's router modules)
    "qwen3_moe": dict(rank=4, targets=["q_proj", "gate"], parameters=EXPERT_PARAMETERS, seed=31),
    "qwen2_moe": dict(rank=8, targets=["v_proj", "shared_expert.gate_proj",
                                       "shared_expert.up_proj", "shared_expert.down_proj",
                                       "shared_expert_gate"],
                      parameters=["mlp.experts.down_proj"], seed=32),
}


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_lora_on_the_router_or_shared_expert_in_a_mixed_batch_gives_peft_greedy_tokens(
    case: MoeCase, tmp_path: Path, prefix_caching: bool
) -> None:
    """Qwen3-MoE's router (its delta moves the routing) and Qwen2-MoE's shared expert and its
    gate, beside an expert adapter, an attention adapter and the base, in one batch."""
    spec = BLOCK_ADAPTERS.get(case.family)
    if spec is None:
        pytest.skip(f"PEFT 0.21 trains no LoRA on {case.family}'s router or shared expert")
    block = make_expert_adapter(case.checkpoints["fused"], tmp_path / "block", **spec)  # type: ignore[arg-type]  # spec: the function's own keywords
    reference = {(BASE + "-block", i): t for i, t in reference_tokens(
        case.checkpoints["fused"], block).items()}
    assert any(reference[(BASE + "-block", i)] != case.reference[(BASE, i)] for i in range(3))
    engine = _engine(case.checkpoints["fused"], tmp_path, prefix_caching=prefix_caching)
    adapters = {BASE + "-block": block, "qkvo-r4": case.adapters["qkvo-r4"],
                "experts-q-r4": case.expert_adapters["target_parameters"]["experts-q-r4"]}
    try:
        ops = WorkerOperations(engine)
        for name, path in adapters.items():
            ops.load_adapter(name, str(path))
        keys = [(name, i) for name in [BASE, *adapters] for i in range(len(PROMPTS))]
        results = _run(engine, keys)
        for key in keys:
            assert results[key] == {**case.reference, **reference}[key], f"{case.family} {key}"
    finally:
        engine.stop()


def _rewrite(adapter: Path, out: Path, edit: Callable[[str, torch.Tensor], torch.Tensor]) -> Path:
    """A copy of ``adapter`` with every tensor passed through ``edit(key, tensor)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, out)
    state = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({k: edit(k, v).contiguous() for k, v in state.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def _fewer_experts(key: str, t: torch.Tensor) -> torch.Tensor:
    """PEFT's fused form for 3 experts of the base's 4 (rank 4)."""
    if ".experts." not in key:
        return t
    return t[:12] if ".lora_A." in key else t.view(t.shape[0], 4, 4)[:, :, :3].reshape(
        t.shape[0], 12)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("fewer-experts", r"3 experts of rank 4, but the base model has 4 experts per layer"),
        ("expert-out-of-range", r"adapts expert 7, but the base model has 4 experts"),
        ("narrow-expert", r"expert 0 (gate_proj|up_proj|down_proj) lora_A is \[4, 63\]"),
    ],
)
def test_an_expert_lora_that_does_not_fit_is_refused_before_a_slot(
    case: MoeCase, tmp_path: Path, bad: str, message: str
) -> None:
    fused = case.expert_adapters["target_parameters"]["experts-q-r4"]
    per_expert = case.expert_adapters["per-expert"]["experts-q-r4"]
    if bad == "fewer-experts":
        path = _rewrite(fused, tmp_path / bad, _fewer_experts)
    elif bad == "expert-out-of-range":
        path = _rewrite(per_expert, tmp_path / bad, lambda k, t: t)
        weights = path / "adapter_model.safetensors"
        from safetensors.torch import load_file, save_file

        state = load_file(str(weights))
        save_file({k.replace(".experts.3.", ".experts.7."): v for k, v in state.items()},
                  str(weights), metadata={"format": "pt"})
    else:
        path = _rewrite(per_expert, tmp_path / bad,
                        lambda k, t: t[:, :63] if ".experts.0." in k and ".lora_A." in k else t)
    engine = _engine(case.checkpoints["fused"], tmp_path)
    try:
        with pytest.raises(errors.InvalidAdapter, match=message):
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


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
def test_a_moe_repo_on_the_hub_starts_a_worker_as_up_model_hf_does(
    case: MoeCase, tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model hf://org/name`` of a MoE repo: downloaded from the Hub (the test Hub on port
    0), checked and served, giving transformers' greedy tokens."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # nothing from the machine's Hub
    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    checkpoint = case.checkpoints[layout]
    with HubServer() as hub:
        repo = f"org/{case.family}-{layout}"
        sha = hub.publish(repo, {p.name: p.read_bytes() for p in checkpoint.iterdir()})
        engine = build_engine(WorkerSettings(
            model=f"hf://{repo}", served_model_name=BASE, kv_cache_bytes=1 << 20,
            model_cache_dir=tmp_path / "models", hf_endpoint=hub.url,
        ))
        assert hub.requests_for(f"/{repo}/resolve/")  # fetched from the Hub
    try:
        assert engine.model.config.family == case.family and engine.model.config.is_moe
        # the snapshot of the published commit, in the worker's model cache
        assert [d for d in (tmp_path / "models").rglob(sha) if d.is_dir()]
        keys = [(BASE, i) for i in range(len(PROMPTS))]
        results = _run(engine, keys)
        for key in keys:
            assert results[key] == case.reference[key], f"{case.family} {layout} {key}"
    finally:
        engine.stop()
