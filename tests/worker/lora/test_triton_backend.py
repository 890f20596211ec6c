"""The engine with the Triton SGMV backend (run in Triton's interpreter on the CPU) gives the same
greedy tokens as with the torch backend, and as HF transformers + PEFT."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first launched

from pathlib import Path

import pytest

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.service.operations import WorkerOperations
from tests.support.families import peft_mix_model
from tests.worker.conftest import (
    ADAPTERS,
    PROMPTS,
    EngineFactory,
    reference_greedy,
)

NEW_TOKENS = 6


def _run(engine_factory: EngineFactory, backend: str, adapters: dict[str, Path]) -> dict:
    engine = engine_factory(start=False, lora_backend=backend)
    ops = WorkerOperations(engine)
    for name, path in adapters.items():
        ops.load_adapter(name, str(path))
    streams = {
        (name, i): engine.submit(name, PromptInput(token_ids=tuple(p)),
                                 SamplingParams(max_tokens=NEW_TOKENS))
        for name in ["tiny", *ADAPTERS] for i, p in enumerate(PROMPTS[:2])
    }
    engine.start()
    return {key: [t for e in s for t in e.token_ids] for key, s in streams.items()}


def test_triton_backend_gives_the_torch_backends_greedy_tokens(
    engine_factory: EngineFactory,
    tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
) -> None:
    pytest.importorskip("triton")
    torch_tokens = _run(engine_factory, "torch", tiny_adapters)
    triton_tokens = _run(engine_factory, "triton", tiny_adapters)
    assert triton_tokens == torch_tokens
    for (name, i), tokens in triton_tokens.items():
        assert tokens == reference[("base" if name == "tiny" else name, i)][:NEW_TOKENS]


def test_triton_backend_routes_mix_steps_to_the_torch_layout_with_peft_cat_tokens(
    engine_factory: EngineFactory,
    tiny_model: Path,
    tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
) -> None:
    """A step with a weighted-mix row beside a single adapter and the base model: the SGMV
    kernels take one slot per row, so the backend hands the step to the entry layout."""
    pytest.importorskip("triton")
    mix = (("attn-r4", 0.7), ("mlp-r8", 0.6))
    expected = reference_greedy(peft_mix_model(tiny_model, tiny_adapters, mix), PROMPTS[1],
                                NEW_TOKENS)
    engine = engine_factory(start=False, lora_backend="triton")
    ops = WorkerOperations(engine)
    for name in ("attn-r4", "mlp-r8"):
        ops.load_adapter(name, str(tiny_adapters[name]))
    prompt, params = PromptInput(token_ids=tuple(PROMPTS[1])), SamplingParams(max_tokens=NEW_TOKENS)
    streams = {name: engine.submit(name, prompt, params) for name in ("tiny", "attn-r4")}
    streams["mix"] = engine.submit("", prompt, params, mix=mix)
    engine.start()
    tokens = {name: [t for e in s for t in e.token_ids] for name, s in streams.items()}
    assert tokens["mix"] == expected
    assert tokens["attn-r4"] == reference[("attn-r4", 1)][:NEW_TOKENS]
    assert tokens["tiny"] == reference[("base", 1)][:NEW_TOKENS]


def test_triton_backend_serves_phi3s_fused_targets_as_peft_does(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """qkv_proj and gate_up_proj: one LoRA over a fused projection's whole output."""
    pytest.importorskip("triton")
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from tests.support import families

    case = families.make_family_case("phi3", tmp_path_factory.mktemp("phi3"))
    engine = build_engine(WorkerSettings(
        model=str(case.checkpoint), served_model_name=families.BASE, max_loras=3,
        max_lora_rank=16, kv_cache_bytes=1 << 20, lora_backend="triton",
        model_cache_dir=tmp_path_factory.mktemp("models"),
    ), checkpoint=case.checkpoint)
    ops = WorkerOperations(engine)
    for name, path in case.adapters.items():
        ops.load_adapter(name, str(path))
    streams = {
        (name, i): engine.submit(name, PromptInput(token_ids=tuple(p)),
                                 SamplingParams(max_tokens=NEW_TOKENS))
        for name in [families.BASE, *case.adapters] for i, p in enumerate(families.PROMPTS[:2])
    }
    engine.start()
    try:
        for (name, i), stream in streams.items():
            tokens = [t for e in stream for t in e.token_ids]
            assert tokens == case.reference[(name, i)][:NEW_TOKENS], (name, i)
    finally:
        engine.stop()


def test_triton_backend_on_a_cpu_without_the_interpreter_is_refused_at_startup() -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from lorastream.core.errors import InvalidArgument\n"
        "from lorastream.worker.lora.triton_backend import TritonLoraBackend\n"
        "try:\n"
        "    TritonLoraBackend(torch.float32, torch.device('cpu'))\n"
        "except InvalidArgument as err:\n"
        "    print('refused:', err)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert "refused: --lora-backend triton cannot run here" in result.stdout, result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout


def test_triton_backend_serves_expert_loras_on_a_moe_base_as_peft_does(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Qwen3-MoE (a dense layer among the sparse ones): two expert LoRAs (PEFT's fused form,
    gate_up and down; down alone, rsLoRA), an attention-only LoRA and the base in one batch,
    the expert deltas on the expert kernel (``kernels/moe_lora.py``), give PEFT's tokens."""
    pytest.importorskip("triton")
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from tests.support import families
    from tests.support.models import (
        EXPERT_PARAMETERS,
        make_expert_adapter,
        make_family_adapter,
        make_tiny_family,
    )

    root = tmp_path_factory.mktemp("qwen3_moe")
    base = make_tiny_family("qwen3_moe", root / "base")
    adapters = {
        "experts-r4": make_expert_adapter(base, root / "experts", rank=4, targets=["q_proj"],
                                          parameters=EXPERT_PARAMETERS, seed=21),
        "down-r8": make_expert_adapter(base, root / "down", rank=8, targets=["v_proj"],
                                       parameters=["mlp.experts.down_proj"], use_rslora=True,
                                       seed=22),
        "qkvo-r4": make_family_adapter(base, root / "qkvo", rank=4,
                                       targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=11),
    }
    engine = build_engine(WorkerSettings(
        model=str(base), served_model_name=families.BASE, max_loras=4, max_lora_rank=16,
        kv_cache_bytes=1 << 20, lora_backend="triton", model_cache_dir=root / "models",
    ), checkpoint=base)
    ops = WorkerOperations(engine)
    for name, path in adapters.items():
        ops.load_adapter(name, str(path))
    prompts = families.PROMPTS[:2]
    streams = {
        (name, i): engine.submit(name, PromptInput(token_ids=tuple(p)),
                                 SamplingParams(max_tokens=NEW_TOKENS))
        for name in [families.BASE, *adapters] for i, p in enumerate(prompts)
    }
    engine.start()
    try:
        for (name, i), stream in streams.items():
            tokens = [t for e in stream for t in e.token_ids]
            expected = families.reference_tokens(base, adapters.get(name))[i][:NEW_TOKENS]
            assert tokens == expected, (name, i)
    finally:
        engine.stop()


@pytest.mark.parametrize("part", ["gate_up", "down"])
def test_triton_expert_deltas_equal_the_torch_paths_for_each_routed_row(
    tmp_path_factory: pytest.TempPathFactory, part: str
) -> None:
    """``LoraStep.add_experts`` with each backend over the same expert-sorted assignments of a
    mixed batch (two slots of different scalings, base rows): the same deltas, and none on the
    base rows' assignments."""
    pytest.importorskip("triton")
    import torch

    from lorastream.worker.lora.backend import LoraStep, TorchLoraBackend
    from lorastream.worker.lora.slots import LoraSlots, SlotInfo
    from lorastream.worker.lora.triton_backend import TritonLoraBackend
    from lorastream.worker.model.config import ModelConfig
    from tests.support.models import make_tiny_family

    cpu = torch.device("cpu")
    config = ModelConfig.from_dir(make_tiny_family("qwen3_moe", tmp_path_factory.mktemp("m")))
    slots = LoraSlots(config, 3, 8, torch.float32, cpu)
    torch.manual_seed(0)
    for t in (slots.expert_a_gate_up, slots.expert_b_gate_up, slots.expert_a_down,
              slots.expert_b_down):
        t.normal_(0.0, 0.3)
    for slot, scaling in enumerate([2.0, 0.5]):  # slot 2 stays empty
        slots.table[slot] = SlotInfo(f"a{slot}", 8, scaling, frozenset({"experts.down_proj"}))
    token_slots = [1, -1, 0, 1, -1]
    k, experts = config.experts_per_token, config.num_experts
    routed = torch.randint(0, experts, (len(token_slots), k))  # [T, k]
    flat = routed.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token, expert = order // k, flat.index_select(0, order)  # [P] each
    width = 2 * config.moe_intermediate_size if part == "gate_up" else config.hidden_size
    fan_in = config.hidden_size if part == "gate_up" else config.moe_intermediate_size
    x = torch.randn(token.shape[0], fan_in)  # [P, K]
    outs = {}
    for backend in (TorchLoraBackend(torch.float32, cpu), TritonLoraBackend(torch.float32, cpu)):
        step = LoraStep.for_step(slots, backend, token_slots, torch.float32, cpu)
        assert step is not None
        out = torch.zeros(token.shape[0], width)
        step.add_experts(0, part, x, token, expert, out)
        outs[backend.name] = out
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-4, atol=1e-4)
    base_rows = torch.tensor([token_slots[t] < 0 for t in token.tolist()])
    assert torch.all(outs["triton"][base_rows] == 0)
    assert torch.all(outs["triton"][~base_rows].abs().sum(1) > 0)
