"""Phi-3 = Mistral with q/k/v fused in one ``qkv_proj`` and gate/up in one ``gate_up_proj``
(as the checkpoint stores them and PEFT adapts them), partial RoPE and LongRoPE as configured."""

from __future__ import annotations

from typing import Any

from lorastream.worker.model.families.mistral import Mistral


class Phi3(Mistral):
    model_type = "phi3"
    architectures = ("Phi3ForCausalLM",)
    differs = "fused qkv_proj and gate_up_proj (LoRA on the fused modules); sliding window if set"

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        fused = {"qkv_modules": ("qkv_proj",), "gate_up_modules": ("gate_up_proj",)}
        return {**super().read(raw), **fused}
