"""The mixture-of-experts families (lorastream.worker.model.moe and families/) against
transformers, on tiny random checkpoints in both expert layouts.

The routed block is checked three ways, on torch's grouped_mm and on the C++ product of decode
steps: against a per-token reference written from transformers' formula; by zeroing one expert,
which must change exactly the tokens routed to it (a dropped contribution, or one added to a
token that did not visit the expert, fails); and, whole model, by its logits against
transformers' for the fused and the per-expert checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import ACTIVATIONS, DecoderModel
from lorastream.worker.model.forward_batch import ForwardBatch, PrefillSpan
from lorastream.worker.model.kv_cache import KVCache, slot_mapping
from lorastream.worker.model.moe import NATIVE_ROWS_PER_EXPERT, MoeBlock, MoeWeights
from lorastream.worker.model.weights import load_weights
from tests.support.families import PROMPTS, reference_model
from tests.support.models import MOE_CONFIGS, WINDOW, make_tiny_family, split_experts

MOE_FAMILIES = list(MOE_CONFIGS)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def checkpoints(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, Path]:
    """layout ("fused", "per-expert") -> the same tiny model of the family."""
    root = tmp_path_factory.mktemp(request.param)
    fused = make_tiny_family(request.param, root / "fused")
    return {"fused": fused, "per-expert": split_experts(fused, root / "per-expert")}


def _moe_block(checkpoint: Path, layer: int = 0) -> tuple[ModelConfig, MoeWeights]:
    config = ModelConfig.from_dir(checkpoint)
    weights = load_weights(checkpoint, config, torch.float32, CPU)
    moe = weights.layers[layer].moe
    assert moe is not None
    return config, moe


def _per_token_reference(block: MoeBlock, mw: MoeWeights, h: torch.Tensor) -> torch.Tensor:
    """transformers' formula token by token: Σ_j w_j * down_e(act(gate_e(x)) * up_e(x))."""
    weights, experts = block.route(h)  # [T, k]
    inter = block.inter
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for w, e in zip(weights[t], experts[t].tolist(), strict=True):
            gate_up = mw.gate_up[e] @ h[t]  # [2 I]
            act = block.activation(gate_up[:inter]) * gate_up[inter:]  # [I]
            out[t] += (w * (mw.down[e] @ act)).to(h.dtype)  # [H]
    return out


@pytest.mark.parametrize("native", [False, True], ids=["grouped_mm", "native"])
def test_the_routed_block_adds_each_visited_expert_and_no_other(
    checkpoints: dict[str, Path], native: bool
) -> None:
    """grouped_mm (and the loop over experts, for strides it cannot take) or the C++ product
    (``native``, decode-like steps: 16 tokens' assignments are a few per expert)."""
    if native:
        assert cpu_ops.load() is None
    config, mw = _moe_block(checkpoints["fused"])
    block = MoeBlock(mw, config, ACTIVATIONS[config.activation], native=native)
    torch.manual_seed(0)
    h = torch.randn(16, config.hidden_size)  # [T, H]
    assert (16 * config.experts_per_token
            <= NATIVE_ROWS_PER_EXPERT * config.num_experts)  # native: the C++ product runs
    out = block.experts(h, *block.route(h))  # [T, H]
    torch.testing.assert_close(out, _per_token_reference(block, mw, h), rtol=1e-5, atol=1e-5)
    if not native:
        assert block.grouped
        block.grouped = False
        torch.testing.assert_close(block.experts(h, *block.route(h)), out, rtol=1e-5,
                                   atol=1e-5)
        block.grouped = True
    _, experts = block.route(h)  # [T, k]
    for e in range(config.num_experts):
        visited = (experts == e).any(dim=1)  # [T]
        assert 0 < int(visited.sum()) < h.shape[0], "every expert visited by some tokens only"
        zeroed = MoeWeights(mw.router, mw.gate_up.clone(), mw.down.clone())
        zeroed.down[e] = 0
        dropped = MoeBlock(zeroed, config, block.activation, native=native).experts(
            h, *block.route(h))
        changed = (dropped != out).any(dim=1)  # [T]: bitwise, the others untouched
        assert torch.equal(changed, visited), f"expert {e}"


def test_routing_ties_break_as_torch_topk_breaks_them(checkpoints: dict[str, Path]) -> None:
    """A zero router gives every expert the same probability: the top-k are topk's choice
    (transformers calls the same topk on the same fp32 softmax), weights 1/k or 1/E."""
    config, mw = _moe_block(checkpoints["fused"])
    tied = MoeWeights(torch.zeros_like(mw.router), mw.gate_up, mw.down)
    block = MoeBlock(tied, config, ACTIVATIONS[config.activation])
    h = torch.randn(5, config.hidden_size)
    weights, experts = block.route(h)
    probs = torch.full((5, config.num_experts), 1 / config.num_experts)
    expected = torch.topk(probs, config.experts_per_token, dim=-1).indices
    assert torch.equal(experts, expected)
    k = config.experts_per_token
    share = 1 / k if config.norm_topk_prob else 1 / config.num_experts
    torch.testing.assert_close(weights.float(), torch.full((5, k), share))


def test_both_expert_layouts_load_the_same_weights(checkpoints: dict[str, Path]) -> None:
    fused, per_expert = (_moe_block(checkpoints[layout])[1] for layout in checkpoints)
    for name in ("router", "gate_up", "down", "shared_gate_up", "shared_down", "shared_gate"):
        a, b = getattr(fused, name), getattr(per_expert, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert fused.gate_up.shape[0] == 4 and fused.down.shape[0] == 4


def test_transformers_reads_the_per_expert_layout_as_the_fused_one(
    checkpoints: dict[str, Path],
) -> None:
    """The rewritten checkpoint is the older layout transformers converts on load."""
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits = [reference_model(checkpoints[layout], None)(prompt).logits
                  for layout in checkpoints]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["whole-prompt", "chunked-prefill"])
def test_logits_agree_with_transformers(
    checkpoints: dict[str, Path], layout: str, chunk: int | None
) -> None:
    checkpoint = checkpoints[layout]
    config = ModelConfig.from_dir(checkpoint)
    model = DecoderModel(config, load_weights(checkpoint, config, torch.float32, CPU), CPU)
    kv = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 1 << 20,
                 torch.float32, CPU)
    prompt = PROMPTS[1]
    assert len(prompt) > WINDOW
    table = kv.allocator.allocate(len(prompt))
    step = chunk or len(prompt)
    for done in range(0, len(prompt), step):  # a chunk attends over the cached past
        length = min(step, len(prompt) - done)
        positions = torch.arange(done, done + length)
        batch = ForwardBatch(
            torch.tensor(prompt[done : done + length]), positions, positions + 1,
            torch.tensor(slot_mapping(table, done, length)), 0,
            torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
            (PrefillSpan(0, length, done + length, torch.tensor(table)),),
            torch.tensor([length - 1]),
        )
        logits = model.forward(batch, kv)[0]  # [V]
    with torch.no_grad():
        expected = reference_model(checkpoint, None)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


EXPECTED = {  # family -> (dense layers, windows, norm_topk_prob, fp32 weights, shared width)
    "qwen3_moe": ((1,), (WINDOW,) * 3, True, False, 0),
    "mixtral": ((), (WINDOW, WINDOW), True, True, 0),
    "qwen2_moe": ((), (WINDOW, None), False, False, 48),
}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_family_reads_its_routing_and_adapts_attention_and_the_block_weights(
    tmp_path: Path, family: str
) -> None:
    config = ModelConfig.from_dir(make_tiny_family(family, tmp_path / "model"))
    dense, windows, norm, fp32, shared = EXPECTED[family]
    assert (config.family, config.num_experts, config.experts_per_token) == (family, 4, 2)
    assert config.dense_layers == dense and config.layer_windows == windows
    assert (config.norm_topk_prob, config.routing_weights_fp32) == (norm, fp32)
    assert config.shared_expert_intermediate_size == shared
    shared_expert = {"shared_expert.gate_proj", "shared_expert.up_proj",
                     "shared_expert.down_proj", "shared_expert_gate"}
    assert set(config.module_shapes()) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate",
                                           *(shared_expert if shared else ())}
