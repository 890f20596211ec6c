"""LoRA on a MoE layer's routed experts (lorastream.worker.lora.experts, slots' expert storage).

Per MoE family: both adapter forms (PEFT's fused ``target_parameters`` and the per-expert
``target_modules``) load into the same slot storage; the routed block with a mixed batch (two
expert adapters in two slots, base rows) equals a per-token reference written from PEFT's
merged-weight formula, on the grouped GEMMs and on the C++ row op of decode-like steps; and
perturbing one expert's LoRA B of one adapter changes exactly the rows of that adapter routed
to that expert (a dropped delta, or one added to an expert the token did not visit, fails).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import adapter_weights
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.backend import LoraStep, TorchLoraBackend
from lorastream.worker.lora.experts import build_expert_meta, few_per_group
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import ACTIVATIONS, LayerLora
from lorastream.worker.model.moe import MoeBlock
from lorastream.worker.model.weights import load_weights
from tests.support.models import (
    EXPERT_PARAMETERS,
    MOE_CONFIGS,
    make_expert_adapter,
    make_tiny_family,
    per_expert_adapter,
)

CPU = torch.device("cpu")
LAYER = 0


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    """"base", and adapters: "fused" (rank 4, both parameters), its "per-expert" rewrite, and
    "down" (rank 8, rsLoRA, down_proj alone)."""
    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_family(request.param, root / "base")
    fused = make_expert_adapter(base, root / "fused", rank=4, targets=["q_proj"],
                                parameters=EXPERT_PARAMETERS, seed=3)
    down = make_expert_adapter(base, root / "down", rank=8, targets=["v_proj"],
                               parameters=["mlp.experts.down_proj"], use_rslora=True, seed=4)
    per_expert = per_expert_adapter(fused, root / "per-expert", request.param == "mixtral")
    return {"base": base, "fused": fused, "per-expert": per_expert, "down": down}


def _slots(family: dict[str, Path], adapters: list[str]) -> tuple[ModelConfig, LoraSlots]:
    config = ModelConfig.from_dir(family["base"])
    slots = LoraSlots(config, len(adapters) + 1, 8, torch.float32, CPU)
    for slot, name in enumerate(adapters):
        buffer = AdapterFetcher(Device("cpu"), None).read_local(name, family[name])
        w = adapter_weights(buffer, config, 16)
        slots.write(slot, name, w.rank, w.scaling, list(w.blocks))
    return config, slots


def test_both_adapter_forms_fill_the_same_expert_slots(family: dict[str, Path]) -> None:
    _, fused = _slots(family, ["fused"])
    _, per_expert = _slots(family, ["per-expert"])
    for storage in ("expert_a_gate_up", "expert_b_gate_up", "expert_a_down", "expert_b_down"):
        torch.testing.assert_close(getattr(fused, storage), getattr(per_expert, storage),
                                   rtol=0, atol=0, msg=storage)
    assert fused.expert_b_down[LAYER, 0].abs().sum() > 0


def _peft_reference(
    block: MoeBlock, slots: LoraSlots, h: torch.Tensor, row_slots: list[int]
) -> torch.Tensor:
    """Token by token, with each expert's weight merged as PEFT merges it:
    W_e + scaling * B_e @ A_e, for the token's adapter only."""
    weights, experts = block.route(h)
    inter, out = block.inter, torch.zeros_like(h)
    a_gu, b_gu = slots.expert_a_gate_up[LAYER], slots.expert_b_gate_up[LAYER]
    a_d, b_d = slots.expert_a_down[LAYER], slots.expert_b_down[LAYER]
    r = slots.storage_rank
    for t in range(h.shape[0]):
        s = row_slots[t]
        for w, e in zip(weights[t], experts[t].tolist(), strict=True):
            gate_up = block.gate_up[e].clone()  # [2 I, H]
            down = block.down[e].clone()  # [H, I]
            if s >= 0:
                scale = slots.table[s].scaling
                gate_up[:inter] += scale * b_gu[s, e, :inter] @ a_gu[s, e, :r]
                gate_up[inter:] += scale * b_gu[s, e, inter:] @ a_gu[s, e, r:]
                down += scale * b_d[s, e] @ a_d[s, e]
            x = gate_up @ h[t]
            act = block.activation(x[:inter]) * x[inter:]
            out[t] += (w * (down @ act)).to(h.dtype)
    return out


@pytest.mark.parametrize("path", ["grouped", "rows"])  # grouped GEMMs | the C++ row op
def test_expert_deltas_match_peft_per_token_and_touch_only_visited_experts(
    family: dict[str, Path], path: str
) -> None:
    native = path == "rows"
    if native:
        assert cpu_ops.load() is None
    config, slots = _slots(family, ["fused", "down"])
    weights = load_weights(family["base"], config, torch.float32, CPU)
    moe = weights.layers[LAYER].moe
    assert moe is not None
    block = MoeBlock(moe, config, ACTIVATIONS[config.activation])
    torch.manual_seed(0)
    row_slots = [0, -1, 1, 0, 2, 1, 0, -1, 1, 0, 0, 1, -1, 1, 0, 1] * 2  # slot 2: empty
    h = torch.randn(len(row_slots), config.hidden_size)  # [T, H]

    def run() -> torch.Tensor:
        step = LoraStep.for_step(slots, TorchLoraBackend(torch.float32, CPU, native=native),
                                 row_slots, torch.float32, CPU)
        assert step is not None
        return block(h, LayerLora(step, LAYER))

    meta = build_expert_meta(row_slots, slots, torch.float32, CPU)
    assert meta is not None  # the step takes the path under test
    assert few_per_group(meta, config.experts_per_token, config.num_experts)

    out = run()
    torch.testing.assert_close(out, _peft_reference(block, slots, h, row_slots),
                               rtol=1e-5, atol=1e-5)
    base = block(h)
    assert torch.equal(out[[1, 7, 12]], base[[1, 7, 12]])  # base rows: no delta at all
    _, experts = block.route(h)  # [T, k]
    rows = torch.tensor(row_slots)
    for slot, storage in ((0, slots.expert_b_gate_up), (1, slots.expert_b_down)):
        for e in range(config.num_experts):
            visited = (experts == e).any(dim=1) & (rows == slot)  # [T]
            assert int(visited.sum()) > 0, f"slot {slot} expert {e} visited by none"
            saved = storage[LAYER, slot, e].clone()
            storage[LAYER, slot, e] += 0.5
            changed = (run() != out).any(dim=1)  # [T]: bitwise, the others untouched
            storage[LAYER, slot, e] = saved
            assert torch.equal(changed, visited), f"slot {slot} expert {e}"


def test_expert_storage_holds_the_sparse_layers_only_and_counts_in_the_slot_bytes(
    family: dict[str, Path],
) -> None:
    """A dense layer (Qwen3-MoE's ``mlp_only_layers``) gets no expert storage; the bytes the
    slots report include the experts', and only theirs are the difference to the projections'."""
    config, slots = _slots(family, ["fused"])
    sparse = [layer for layer in range(config.num_layers) if config.is_moe_layer(layer)]
    assert slots.expert_rows == {layer: row for row, layer in enumerate(sparse)}
    if config.family == "qwen3_moe":
        assert len(sparse) < config.num_layers  # the tiny config has a dense layer
    e, h, i, r = (config.num_experts, config.hidden_size, config.moe_intermediate_size,
                  slots.storage_rank)
    per_layer_slot = e * r * (2 * h + 2 * i + i + h) * 4  # fp32
    assert slots.expert_nbytes == len(sparse) * slots.num_slots * per_layer_slot
    projections = sum(t.numel() * t.element_size() for t in (
        *slots.a.values(), *slots.b.values(), *slots.dora_scale.values(),
        *slots.dora_shift.values()))
    assert slots.nbytes == projections + slots.expert_nbytes
