"""The PEFT adapter format, as both services read it.

A PEFT LoRA directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose keys
look like ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``. A is ``[r, in]``,
B is ``[out, r]``. A DoRA adapter (``use_dora``) adds one magnitude vector per adapted module,
``...q_proj.lora_magnitude_vector`` of shape ``[out]`` (its key has no ``.weight``).

The vocabulary modules (``embed_tokens``, ``lm_head``) sit outside the layers and come in four
kinds of tensor (:func:`parse_vocab_key`), V the vocabulary, H the hidden size::

    model.embed_tokens.token_adapter.trainable_tokens_delta   [n, H]  TrainableTokens' new rows
    model.embed_tokens.lora_embedding_A / _B                  [r, V] / [H, r]
    lm_head.lora_A.weight / lora_B.weight                     [r, H] / [V, r]
    model.embed_tokens.weight, lm_head.weight                 [V, H]  modules_to_save
    model.embed_tokens.base_layer.weight (lm_head's alike)    [V, H]  what PEFT saves beside a
                                                                      LoRA on that module
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
# A mixture-of-experts block's plain weights: its router (``mlp.gate``, ``[E, H]``; PEFT trains
# it as the raw parameter ``gate.weight``) and Qwen2-MoE's shared-expert gate (``[1, H]``).
MOE_BLOCK_MODULES = ("gate", "shared_expert_gate")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES + FUSED_MODULES + MOE_BLOCK_MODULES
# The raw parameters ``target_parameters`` may name besides the fused experts: the router's.
ROUTER_PARAMETER = "gate.weight"

# LoRA on a MoE layer's experts comes in two forms (docs/worker.md):
#   PEFT's target_parameters on the fused expert parameters, one A/B pair per parameter for all
#   experts, ``mlp.experts[.base_layer].lora_A.weight`` [E * r, in] and ``lora_B`` [out, E * r]:
#   each targeted parameter wraps the module once more, in the order the module registers them
#   (gate_up_proj, then down_proj), so the innermost (most ``base_layer``) is gate_up_proj;
#   per-expert target_modules, ``mlp.experts.{e}.{gate,up,down}_proj.lora_A.weight`` [r, in]
#   (Mixtral's older ``block_sparse_moe.experts.{e}.{w1,w3,w2}``).
# Module names of expert keys: ``experts.{e}.gate_proj`` (per expert, Mixtral's names mapped),
# ``experts`` / ``experts.base_layer`` (fused, resolved by ``resolve_fused_experts``), and
# ``shared_expert.gate_proj`` (Qwen2-MoE's shared expert, a plain MLP).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FUSED_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # the order experts register them
_MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\."
    r"(?:experts\.(?:(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.|"
    r"(?P<wrap>(?:base_layer\.)*))|shared_expert\.(?P<shared>gate_proj|up_proj|down_proj)\.)"
    r"lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
FUSED_EXPERTS = "experts"  # module of a fused-parameter key, wrapped "experts.base_layer"...

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\."
    r"(?:self_attn|mlp)\.(?P<module>[a-z_]+)\."
    r"(?:lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight|(?P<m>lora_magnitude_vector)(?:\.[^.]+)?)$"
)
MAGNITUDE = "M"  # LoraKey.ab of a DoRA magnitude vector


VOCAB_MODULES = ("embed_tokens", "lm_head")
TOKENS = "T"  # VocabKey.kind of TrainableTokens' rows
FULL = "F"  # VocabKey.kind of a whole saved module (modules_to_save, or a saved base_layer)
_VOCAB_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>embed_tokens|lm_head)\."
    r"(?:(?P<tokens>token_adapter\.trainable_tokens_delta)(?:\.[^.]+)?"
    r"|lora_embedding_(?P<eab>[AB])(?:\.[^.]+)?"
    r"|lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight"
    r"|(?:base_layer\.)?weight)$"
)


@dataclass(frozen=True)
class VocabKey:
    """A parsed key of a vocabulary module's tensor (module docstring)."""

    module: str  # "embed_tokens" | "lm_head"
    kind: str  # "A", "B" (LoRA), TOKENS ("T") or FULL ("F")


@lru_cache(maxsize=1024)
def parse_vocab_key(key: str) -> VocabKey | None:
    """Parse a key of ``embed_tokens`` or ``lm_head``; None for any other key."""
    m = _VOCAB_KEY.match(key)
    if m is None:
        return None
    kind = TOKENS if m.group("tokens") else m.group("eab") or m.group("ab") or FULL
    return VocabKey(m.group("module"), kind)


def vocab_shape(module: str, kind: str, rank: int, vocab: int, hidden: int,
                tokens: int) -> tuple[int, ...]:
    """The shape a vocabulary tensor must have over a base of ``vocab`` x ``hidden``
    (``tokens``: the adapter's count of trainable token indices)."""
    if kind == TOKENS:
        return (tokens, hidden)
    if kind == FULL:
        return (vocab, hidden)
    fan_in, fan_out = (vocab, hidden) if module == "embed_tokens" else (hidden, vocab)
    return (rank, fan_in) if kind == "A" else (fan_out, rank)


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
    tensors' keys a few times (placement, layer progress), and the regex showed in a fetch
    process's profile (measured: docs/notes/loading.md, "Costs moved from the load path's
    comments")."""
    m = _KEY.match(key)
    if m is not None:
        ab = MAGNITUDE if m.group("m") else m.group("ab")
        return LoraKey(layer=int(m.group("layer")), module=m.group("module"), ab=ab)
    m = _EXPERT_KEY.match(key)
    if m is None:
        return None
    if m.group("shared") is not None:
        module = f"shared_expert.{m.group('shared')}"
    elif m.group("expert") is not None:
        proj = _MIXTRAL_EXPERTS.get(m.group("proj"), m.group("proj"))
        module = f"experts.{int(m.group('expert'))}.{proj}"
    else:
        module = FUSED_EXPERTS + ".base_layer" * (len(m.group("wrap")) // len("base_layer."))
    return LoraKey(layer=int(m.group("layer")), module=module, ab=m.group("ab"))


def per_expert(module: str) -> tuple[int, str] | None:
    """``experts.3.gate_proj`` -> (3, "gate_proj"); None for any other module."""
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "experts" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None


def fused_depth(module: str) -> int | None:
    """``experts`` -> 0, ``experts.base_layer`` -> 1 (PEFT's ParamWrapper nesting); else None."""
    parts = module.split(".")
    if parts[0] == FUSED_EXPERTS and all(p == "base_layer" for p in parts[1:]):
        return len(parts) - 1
    return None


def is_expert_module(module: str) -> bool:
    """A routed expert's module (either form); the shared expert is a plain MLP."""
    return per_expert(module) is not None or fused_depth(module) is not None


def resolve_fused_experts(
    found: dict[str, tuple[tuple[int, ...], tuple[int, ...]]], hidden: int, inter: int
) -> dict[str, str]:
    """Fused-parameter module -> ``experts.gate_up_proj`` | ``experts.down_proj``.

    ``found``: module -> (lora_A shape, lora_B shape) of an adapter's fused expert keys (one
    layer's). With both parameters targeted the innermost wrapper (``experts.base_layer``) is
    gate_up_proj; one alone is told by its sizes: gate_up maps H -> 2 I, down I -> H (never
    both, as 2 I = H and I = H cannot hold together).
    """
    depths = sorted((fused_depth(m) or 0, m) for m in found)
    if len(depths) == len(FUSED_EXPERT_PARAMETERS):
        return {m: f"experts.{p}" for (_, m), p in zip(reversed(depths), FUSED_EXPERT_PARAMETERS,
                                                        strict=True)}
    resolved = {}
    for module, (a, b) in found.items():
        gate_up = len(a) == 2 and len(b) == 2 and a[1] == hidden and b[0] == 2 * inter
        resolved[module] = "experts.gate_up_proj" if gate_up else "experts.down_proj"
    return resolved


def lora_parameter(module: str, fused: dict[str, str]) -> str | None:
    """The raw parameter a LoRA of ``module`` (a :class:`LoraKey`'s) adapts, which PEFT names
    it by (``core/module_patterns.py``): the router's ``weight``, a fused expert module's
    ``gate_up_proj`` / ``down_proj`` (``fused``: :func:`resolve_fused_experts`'s answer);
    None for a module."""
    if module == ROUTER_PARAMETER.split(".")[0]:
        return ROUTER_PARAMETER.split(".")[1]
    if fused_depth(module) is not None:
        return fused[module].split(".")[-1]
    return None


def short_module_name(target: str) -> str:
    """``model.layers.1.self_attn.o_proj`` -> ``o_proj``; ``q_proj`` -> ``q_proj``."""
    return target.rsplit(".", 1)[-1]
