"""Mistral = Llama + a sliding window on every layer (when ``sliding_window`` is set); no biases."""

from __future__ import annotations

from typing import Any

from lorastream.worker.model.families.llama import Llama, uniform_windows


class Mistral(Llama):
    model_type = "mistral"
    architectures = ("MistralForCausalLM",)
    differs = "sliding window on every layer when sliding_window is set"

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().read(raw),
            "qkv_bias": False, "o_bias": False, "mlp_bias": False,
            "layer_windows": uniform_windows(raw),
        }
