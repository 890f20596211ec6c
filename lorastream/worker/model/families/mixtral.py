"""Mixtral = Mistral + routed experts in place of every layer's MLP: the top
``num_experts_per_tok`` of ``num_local_experts`` experts of width ``intermediate_size`` per token,
their softmax probabilities always renormalised and kept in fp32 (not cast to the model's dtype).
Older checkpoints name the block ``block_sparse_moe`` and one expert's gate, down and up
projections ``w1``, ``w2``, ``w3`` (transformers' conversion mapping for mixtral)."""

from __future__ import annotations

from typing import Any

from lorastream.worker.model.families.mistral import Mistral
from lorastream.worker.model.families.qwen2_moe import expert_count


class Mixtral(Mistral):
    model_type = "mixtral"
    architectures = ("MixtralForCausalLM",)
    differs = (
        "routed experts (top-k of the router's softmax, renormalised, fp32 weights) in place of "
        "the MLP; sliding window on every layer when set; LoRA on attention only"
    )

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().read(raw),
            "num_experts": expert_count(raw),
            "experts_per_token": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["intermediate_size"]),
            "norm_topk_prob": True,
            "routing_weights_fp32": True,
            "moe_prefixes": ("mlp", "block_sparse_moe"),
            "expert_modules": ("w1", "w3", "w2"),
        }
