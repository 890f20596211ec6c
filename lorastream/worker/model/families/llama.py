"""Llama: the family every other one is written against (its reading is the shared part).

Pre-norm decoder: RMSNorm (``w * x̂`` with x̂ in fp32, cast back), attention with GQA and
rotate-half RoPE, SiLU-gated MLP, residual adds; untied or tied embeddings; optional
``attention_bias`` (q/k/v/o) and ``mlp_bias``.
"""

from __future__ import annotations

from typing import Any

from lorastream.core.errors import InvalidArgument
from lorastream.worker.model.rope import rope_settings_from_config

# hidden_act values the decoder implements (transformers' ACT2FN names).
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")


class Llama:
    model_type = "llama"
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    differs = "the reference decoder"

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` -> :class:`ModelConfig` fields (the family's differences included)."""
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_theta, rope_scaling = rope_settings_from_config(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        return dict(
            family=self.model_type,
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
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            activation=self.activation(raw, "hidden_act", "silu"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def activation(self, raw: dict[str, Any], key: str, default: str) -> str:
        name = raw.get(key) or default
        if name not in ACTIVATIONS:
            raise InvalidArgument(
                f"config.json: {key} {name!r} is not supported for {self.model_type}; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        return str(name)


def uniform_windows(raw: dict[str, Any]) -> tuple[int | None, ...]:
    """Every layer slides over ``sliding_window`` when it is set (Mistral, Phi-3)."""
    window = raw.get("sliding_window")
    return () if window is None else (int(window),) * int(raw["num_hidden_layers"])


def windows_of_layer_types(
    raw: dict[str, Any], window: int | None, default_types: list[str]
) -> tuple[int | None, ...]:
    """Per-layer windows from ``layer_types`` (or ``default_types`` when the config has none):
    ``window`` on 'sliding_attention' layers, None on 'full_attention' ones."""
    types = raw.get("layer_types") or default_types
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise InvalidArgument(
            f"config.json: layer_types {unknown} are not supported; use sliding_attention or "
            "full_attention"
        )
    if window is None or "sliding_attention" not in types:
        return ()
    return tuple(window if t == "sliding_attention" else None for t in types)
