"""Qwen3 = Qwen2 + an RMSNorm over each head of q and k before RoPE; biases only with
``attention_bias`` (on q/k/v/o, as Llama)."""

from __future__ import annotations

from typing import Any

from lorastream.worker.model.families.qwen2 import Qwen2


class Qwen3(Qwen2):
    model_type = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    differs = "per-head RMSNorm on q and k before RoPE; no q/k/v bias"

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        bias = bool(raw.get("attention_bias", False))
        return {**super().read(raw), "qk_norm": True, "qkv_bias": bias, "o_bias": bias}
