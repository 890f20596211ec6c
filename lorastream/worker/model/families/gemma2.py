"""Gemma 2 = Llama + Gemma's numerics: RMSNorm as ``x̂ * (1 + w)`` in fp32, embeddings times
sqrt(hidden), GeGLU (``hidden_activation``, gelu_pytorch_tanh), norms after attention and around
the MLP, attention scale ``query_pre_attn_scalar ** -0.5``, attention-logit and final-logit
soft-capping, and sliding layers alternating with global ones (``layer_types``)."""

from __future__ import annotations

from typing import Any

from lorastream.core.errors import InvalidArgument
from lorastream.worker.model.families.llama import Llama, windows_of_layer_types


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class Gemma2(Llama):
    model_type = "gemma2"
    architectures = ("Gemma2ForCausalLM",)
    differs = (
        "RMSNorm x*(1+w); embeddings x sqrt(hidden); GeGLU; pre/post norms around attention and "
        "MLP; query_pre_attn_scalar; attention and final logit soft-capping; sliding layers "
        "alternating with global ones"
    )
    default_pattern = 2  # every 2nd layer is global (Gemma2Config's default layer_types)

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        if raw.get("use_bidirectional_attention"):
            raise InvalidArgument(
                f"config.json: use_bidirectional_attention is not supported for "
                f"{self.model_type} (an encoder, not a causal LM)"
            )
        bias = bool(raw.get("attention_bias", False))
        window = raw.get("sliding_window", 4096)
        default = [
            "sliding_attention" if (i + 1) % self.pattern(raw) else "full_attention"
            for i in range(int(raw["num_hidden_layers"]))
        ]
        return {
            **super().read(raw),
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
            "qkv_bias": bias, "o_bias": bias, "mlp_bias": False,
            "norm_plus_one": True,
            "sandwich_norms": True,
            "scale_embeddings": True,
            "activation": self.activation(raw, "hidden_activation", "gelu_pytorch_tanh"),
            "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
            "attn_softcap": optional_float(raw.get("attn_logit_softcapping", 50.0)),
            "final_softcap": optional_float(raw.get("final_logit_softcapping", 30.0)),
            "layer_windows": windows_of_layer_types(
                raw, None if window is None else int(window), default
            ),
        }

    def pattern(self, raw: dict[str, Any]) -> int:
        return self.default_pattern
