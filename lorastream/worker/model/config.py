"""The shape and numerics of a decoder-only base model, read from an HF ``config.json``.

One :class:`ModelConfig` describes every supported family: its fields default to Llama, and a
family (``model/families/``) sets only the knobs in which it differs (biases, q/k norms, Gemma's
norms and soft-capping, sliding windows, fused projections). The decoder, the KV cache, the LoRA
slots and adapter checks read this dataclass alone, never the family.

Adaptable projections sit at four *sites* of a layer, each one fused matmul of the base model::

    qkv:     h [T, H]      -> [T, q + 2 kv]   q_proj | k_proj | v_proj   (Phi-3: qkv_proj)
    o:       attn [T, q]   -> [T, H]          o_proj
    gate_up: h [T, H]      -> [T, 2 I]        gate_proj | up_proj        (Phi-3: gate_up_proj)
    down:    act [T, I]    -> [T, H]          down_proj

A LoRA target is a checkpoint module name at a site, with the column its output starts at.
Modules that share a site read the same input, so the slots keep their A side by side.

A mixture-of-experts model (``num_experts > 0``) replaces the gate_up and down sites of its
sparse layers by a routed block (``model/moe.py``): a router ``[E, H]``, E experts of width
``moe_intermediate_size`` of which each token visits ``experts_per_token``, and (Qwen2-MoE) a
shared expert with a sigmoid gate. Its LoRA targets are the attention sites and the block's
plain weights (router, shared expert, shared-expert gate); LoRA on the routed experts has slots
of its own (``lora/slots.py``, ``lora/experts.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorastream.core.adapter_fit import ExpertShape
from lorastream.core.errors import InvalidArgument

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
SITES = ("qkv", "o", "gate_up", "down")
# Qwen2-MoE's shared expert, as adapter keys name its projections (``mlp.shared_expert.*``).
SHARED_GATE_UP = ("shared_expert.gate_proj", "shared_expert.up_proj")
SHARED_DOWN = "shared_expert.down_proj"


@dataclass(frozen=True)
class LoraTarget:
    """An adaptable projection: checkpoint module name, site, first output column, sizes."""

    module: str
    site: str
    col: int
    fan_in: int
    fan_out: int


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder; derived sizes in properties. Defaults are Llama's."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    family: str = "llama"  # the model_type it was read as
    # Checkpoint module names fused at the qkv and gate_up sites (also their LoRA targets).
    qkv_modules: tuple[str, ...] = QKV
    gate_up_modules: tuple[str, ...] = GATE_UP
    qkv_bias: bool = False  # q/k/v projections carry a bias
    o_bias: bool = False
    mlp_bias: bool = False  # gate/up/down carry a bias
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    norm_plus_one: bool = False  # Gemma's RMSNorm: (x̂ * (1 + w)) in fp32, then cast
    sandwich_norms: bool = False  # Gemma: norms after attention and around the MLP too
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    activation: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale ** -2 (None: head_dim)
    attn_softcap: float | None = None  # scores = c * tanh(scores / c)
    final_softcap: float | None = None  # logits = c * tanh(logits / c)
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window, None = global
    # RoPE of the sliding layers when it differs from the global one (Gemma 3).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # Mixture of experts (num_experts 0: a dense model).
    num_experts: int = 0  # routed experts of each sparse layer
    experts_per_token: int = 0  # top-k of the router
    moe_intermediate_size: int = 0  # width of one routed expert
    norm_topk_prob: bool = False  # top-k probabilities renormalised to sum to 1
    routing_weights_fp32: bool = False  # Mixtral: top-k weights stay fp32 (not cast to dtype)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared expert of this width (0: none)
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model with a dense MLP
    # Checkpoint names: the MoE block's prefixes in a layer, newest first, and one expert's
    # gate, up and down projections when stored one by one (Mixtral's older w1, w3, w2).
    moe_prefixes: tuple[str, ...] = ("mlp",)
    expert_modules: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys at p - j < window), None for global attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    def is_local(self, layer: int) -> bool:
        """True when ``layer`` uses the sliding layers' RoPE (it has a window and one is set)."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """True when ``layer``'s MLP is a routed block of experts (not a dense MLP)."""
        return self.is_moe and layer not in self.dense_layers

    def expert_shape(self) -> ExpertShape | None:
        """What an expert LoRA must match (None: a dense model)."""
        if not self.is_moe:
            return None
        layers = frozenset(i for i in range(self.num_layers) if self.is_moe_layer(i))
        return ExpertShape(self.num_experts, self.hidden_size, self.moe_intermediate_size, layers)

    def site_width(self, site: str) -> int:
        """Output features of a site's fused matmul."""
        h, i = self.hidden_size, self.intermediate_size
        return {"qkv": self.q_size + 2 * self.kv_size, "o": h, "gate_up": 2 * i, "down": h}[site]

    def lora_targets(self) -> tuple[LoraTarget, ...]:
        """Every adaptable projection, in site order: :meth:`projections`, but in a MoE model
        the attention's and the MoE block's plain weights (:meth:`moe_block_targets`; expert
        LoRA has storage of its own, ``lora/slots.py``)."""
        if self.is_moe:
            attention = tuple(t for t in self.projections() if t.site in ("qkv", "o"))
            return attention + self.moe_block_targets()
        return self.projections()

    def moe_block_targets(self) -> tuple[LoraTarget, ...]:
        """A MoE block's plain weights, adapted on its sparse layers (``model/moe.py``): the
        router ``gate`` (its logits) and, in Qwen2-MoE, the shared expert's projections (its
        gate and up fused as ``shared_gate_up``) and its gate ``shared_expert_gate``."""
        h, s = self.hidden_size, self.shared_expert_intermediate_size
        targets = [LoraTarget("gate", "router", 0, h, self.num_experts)]
        if s:
            targets += [
                LoraTarget(SHARED_GATE_UP[0], "shared_gate_up", 0, h, s),
                LoraTarget(SHARED_GATE_UP[1], "shared_gate_up", s, h, s),
                LoraTarget(SHARED_DOWN, "shared_down", 0, s, h),
                LoraTarget("shared_expert_gate", "shared_gate", 0, h, 1),
            ]
        return tuple(targets)

    def projections(self) -> tuple[LoraTarget, ...]:
        """Every projection of a dense layer, in site order, as its checkpoint names it."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        parts = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": i, "up_proj": i}
        targets: list[LoraTarget] = []
        for site, modules, fan_in in (
            ("qkv", self.qkv_modules, h), ("gate_up", self.gate_up_modules, h)
        ):
            widths = [self.site_width(site)] if len(modules) == 1 else [parts[m] for m in modules]
            col = 0
            for module, width in zip(modules, widths, strict=True):
                targets.append(LoraTarget(module, site, col, fan_in, width))
                col += width
        targets.insert(len(self.qkv_modules), LoraTarget("o_proj", "o", 0, q, h))
        targets.append(LoraTarget("down_proj", "down", 0, i, h))
        return tuple(targets)

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """Adaptable projection -> (in_features, out_features)."""
        return {t.module: (t.fan_in, t.fan_out) for t in self.lora_targets()}

    def vocab_shapes(self) -> dict[str, tuple[int, int]]:
        """The vocabulary modules an adapter may change -> (in, out): ``embed_tokens`` maps a
        token id of V to H features, ``lm_head`` H features to V logits."""
        return {"embed_tokens": (self.vocab_size, self.hidden_size),
                "lm_head": (self.hidden_size, self.vocab_size)}

    def shared_input_groups(self) -> tuple[tuple[str, ...], ...]:
        """Projections that read the same input (sites with more than one module)."""
        groups = (self.qkv_modules, self.gate_up_modules, SHARED_GATE_UP)
        targets = {t.module for t in self.lora_targets()}
        return tuple(g for g in groups if len(g) > 1 and set(g) <= targets)

    def describe(self) -> str:
        """``tiny (model_type 'qwen3')``: the base model and its family, for error messages."""
        return f"{self.name or 'the base model'} (model_type {self.family!r})"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "") -> ModelConfig:
        """Read ``config.json`` through its family; InvalidArgument for what is not supported."""
        from lorastream.worker.model.families import family_of

        family = family_of(raw, name or "config.json")
        try:
            fields = family.read(raw)
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidArgument(
                f"{name or 'config.json'}: not a usable {family.model_type} config ({err!r}); "
                "save the checkpoint with transformers' save_pretrained"
            ) from err
        config = cls(**fields, name=name)
        if config.layer_windows and len(config.layer_windows) != config.num_layers:
            raise InvalidArgument(
                f"{name or 'config.json'}: layer_types has {len(config.layer_windows)} entries "
                f"for {config.num_layers} layers"
            )
        return config

    @classmethod
    def from_dir(cls, checkpoint: Path, name: str = "") -> ModelConfig:
        raw = json.loads((checkpoint / "config.json").read_text())
        generation = checkpoint / "generation_config.json"
        if generation.is_file():  # generation_config's eos list wins, as in transformers
            eos = json.loads(generation.read_text()).get("eos_token_id")
            if eos is not None:
                raw = {**raw, "eos_token_id": eos}
        return cls.from_dict(raw, name or checkpoint.name)
