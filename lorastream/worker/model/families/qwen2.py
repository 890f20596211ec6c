"""Qwen2 / Qwen2.5 = Llama + a bias on q, k and v; sliding windows only with
``use_sliding_window`` (on the layers from ``max_window_layers`` on, or as ``layer_types`` says)."""

from __future__ import annotations

from typing import Any

from lorastream.worker.model.families.llama import Llama, windows_of_layer_types


def qwen_windows(raw: dict[str, Any]) -> tuple[int | None, ...]:
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    first = int(raw.get("max_window_layers", 28))
    default = [
        "sliding_attention" if window is not None and i >= first else "full_attention"
        for i in range(int(raw["num_hidden_layers"]))
    ]
    return windows_of_layer_types(raw, None if window is None else int(window), default)


class Qwen2(Llama):
    model_type = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    differs = "q/k/v bias; sliding window only with use_sliding_window"

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().read(raw),
            "qkv_bias": True, "o_bias": False, "mlp_bias": False,
            "layer_windows": qwen_windows(raw),
        }
