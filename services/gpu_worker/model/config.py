"""The shape of a Llama-family base model, read from an HF ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorastream.core.errors import InvalidArgument

LLAMA_MODEL_TYPES = ("llama",)
# Projections that read the same input: the model runs each group as one fused matmul, and the
# LoRA slots keep the group's A side by side so that one matmul shrinks that input for all.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama decoder; derived sizes in properties."""

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
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """Adaptable projection -> (in_features, out_features)."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "") -> "LlamaConfig":
        from lorastream.worker.model.rope import rope_settings_from_config

        model_type = raw.get("model_type")
        if model_type not in LLAMA_MODEL_TYPES:
            raise InvalidArgument(
                f"{name or 'model'}: model_type {model_type!r} is not supported; lorastream "
                f"serves Llama-family checkpoints (model_type {', '.join(LLAMA_MODEL_TYPES)})"
            )
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise InvalidArgument(f"{name}: attention_bias/mlp_bias checkpoints are not supported")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_theta, rope_scaling = rope_settings_from_config(raw)
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def from_dir(cls, checkpoint: Path, name: str = "") -> "LlamaConfig":
        raw = json.loads((checkpoint / "config.json").read_text())
        generation = checkpoint / "generation_config.json"
        if generation.is_file():  # generation_config's eos list wins, as in transformers
            eos = json.loads(generation.read_text()).get("eos_token_id")
            if eos is not None:
                raw = {**raw, "eos_token_id": eos}
        return cls.from_dict(raw, name or checkpoint.name)

