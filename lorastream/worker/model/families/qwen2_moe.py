"""Qwen2-MoE = Qwen2 + a routed block of experts in place of the MLP: a router picks the top
``num_experts_per_tok`` of ``num_experts`` experts per token (their softmax probabilities,
renormalised with ``norm_topk_prob``), and a shared expert, scaled by ``sigmoid(h @ gateᵀ)``, is
added to their sum. Layers in ``mlp_only_layers``, or off the ``decoder_sparse_step``, keep a
dense MLP of ``intermediate_size``. Sliding windows as ``layer_types`` says."""

from __future__ import annotations

from typing import Any

from lorastream.worker.model.families.llama import windows_of_layer_types
from lorastream.worker.model.families.qwen2 import Qwen2


def expert_count(raw: dict[str, Any]) -> int:
    """``num_experts``, or ``num_local_experts`` as transformers 5 saves it (attribute_map)."""
    count = raw.get("num_experts")
    return int(raw["num_local_experts"] if count is None else count)


def routed_experts(raw: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a Qwen-style config: experts, top-k, widths, its dense layers."""
    layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step") or 1)
    only = set(raw.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    return {
        "num_experts": expert_count(raw),
        "experts_per_token": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }


def qwen2_moe_windows(raw: dict[str, Any]) -> tuple[int | None, ...]:
    """``layer_types`` (or Qwen2MoeConfig's default: every other layer below
    ``max_window_layers`` slides) with ``sliding_window`` when ``use_sliding_window``."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    first = int(raw.get("max_window_layers", 28))
    default = [
        "sliding_attention" if window is not None and (i + 1) % 2 and i < first
        else "full_attention"
        for i in range(int(raw["num_hidden_layers"]))
    ]
    return windows_of_layer_types(raw, None if window is None else int(window), default)


class Qwen2Moe(Qwen2):
    model_type = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    differs = (
        "routed experts (top-k of the router's softmax) plus a shared expert behind a sigmoid "
        "gate in place of the MLP; q/k/v bias as qkv_bias says; LoRA on attention only"
    )

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        bias = bool(raw.get("qkv_bias", True))
        return {
            **super().read(raw),
            **routed_experts(raw),
            "shared_expert_intermediate_size": int(raw["shared_expert_intermediate_size"]),
            "qkv_bias": bias,
            "layer_windows": qwen2_moe_windows(raw),
        }
