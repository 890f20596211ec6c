"""The PEFT adapter format, as both services read it.

A PEFT LoRA directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose keys
look like ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``. A is ``[r, in]``,
B is ``[out, r]``. A DoRA adapter (``use_dora``) adds one magnitude vector per adapted module,
``...q_proj.lora_magnitude_vector`` of shape ``[out]`` (its key has no ``.weight``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "pytorch_model.bin")

# Short names of the projections lorastream can adapt in some supported model family (the
# worker checks an adapter against its own base model's family): Phi-3 fuses q/k/v into
# qkv_proj and gate/up into gate_up_proj.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
FUSED_MODULES = ("qkv_proj", "gate_up_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES + FUSED_MODULES

# A mixture-of-experts block's routed or shared experts, or its router, in a module path or a
# tensor key: ``mlp.experts.3.gate_proj``, ``mlp.experts.gate_up_proj``, ``mlp.experts.lora_A``,
# ``block_sparse_moe.experts.0.w1``, ``mlp.shared_expert.up_proj``, ``mlp.shared_expert_gate``.
_MOE_PART = re.compile(r"(^|\.)(experts|shared_expert|shared_expert_gate|block_sparse_moe)(\.|$)")
MOE_NOT_YET = (
    "LoRA on mixture-of-experts experts (routed or shared) is not supported yet; train the "
    "adapter on the attention projections only (q_proj, k_proj, v_proj, o_proj)"
)

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\."
    r"(?:self_attn|mlp)\.(?P<module>[a-z_]+)\."
    r"(?:lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight|(?P<m>lora_magnitude_vector)(?:\.[^.]+)?)$"
)
MAGNITUDE = "M"  # LoraKey.ab of a DoRA magnitude vector


@dataclass(frozen=True)
class LoraKey:
    """A parsed PEFT tensor key."""

    layer: int
    module: str  # short name, e.g. "q_proj"
    ab: str  # "A", "B", or MAGNITUDE ("M": DoRA's lora_magnitude_vector)


@lru_cache(maxsize=16384)
def parse_lora_key(key: str) -> LoraKey | None:
    """Parse a PEFT LoRA tensor key; ``None`` when the key is not a LoRA A/B weight or a DoRA
    magnitude vector of a layer.

    Cached: adapters of one base model share their keys, and a fetch parses each of its
    tensors' keys a few times (placement, layer progress); the regex was 15% of a fetch
    process's CPU for a rank-16 adapter of 420 tensors."""
    m = _KEY.match(key)
    if m is None:
        return None
    ab = MAGNITUDE if m.group("m") else m.group("ab")
    return LoraKey(layer=int(m.group("layer")), module=m.group("module"), ab=ab)


def targets_moe_experts(name: str) -> bool:
    """True when a target module, target parameter or tensor key lies in a MoE block's experts
    (see ``MOE_NOT_YET``), e.g. ``model.layers.0.mlp.experts.3.gate_proj``."""
    return _MOE_PART.search(name) is not None


def short_module_name(target: str) -> str:
    """``model.layers.1.self_attn.o_proj`` -> ``o_proj``; ``q_proj`` -> ``q_proj``."""
    return target.rsplit(".", 1)[-1]
