"""Qwen3-MoE = Qwen3's attention (q/k RMSNorm) + Qwen2-MoE's routed experts without the shared
expert (as transformers composes it); a sliding window on every layer with
``use_sliding_window``."""

from __future__ import annotations

from typing import Any

from lorastream.worker.model.families.llama import uniform_windows
from lorastream.worker.model.families.qwen2_moe import routed_experts
from lorastream.worker.model.families.qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    model_type = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    differs = (
        "as Qwen3, with routed experts (top-k of the router's softmax, renormalised with "
        "norm_topk_prob) in place of the MLP; LoRA on attention only"
    )

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        windows = uniform_windows(raw) if raw.get("use_sliding_window") else ()
        return {**super().read(raw), **routed_experts(raw), "layer_windows": windows}
