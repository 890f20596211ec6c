"""Synthetic expert LoRAs for the benchmarks on mixture-of-experts bases: PEFT's fused form as
transformers 5 trains it, ``target_parameters`` on ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj`` of every sparse layer plus LoRA on q/k/v/o, random A and B (B
non-zero, so every adapter changes its rows). The CPU MoE benchmarks (``engine_moe.py``,
``serve_adapters.py``) and the GPU serving benchmark on a Qwen3-30B-A3B-shaped model
(``gpu_model.py``) make their adapters here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def expert_lora(
    config: Any, rank: int, seed: int, std: float = 0.02, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """A PEFT LoRA (fused expert form + attention) for the ``ModelConfig`` ``config``: its
    state dict in PEFT's saved key form, drawn in ``dtype``, and its ``adapter_config.json``.
    Keys of layer ``l``: ``mlp.experts.base_layer.lora_A [E r, H]`` / ``lora_B [2 I, E r]``
    (gate_up_proj, the inner wrapper) and ``mlp.experts.lora_A [E r, I]`` / ``lora_B [H, E r]``
    (down_proj)."""
    gen = torch.Generator().manual_seed(seed)
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    q, kv = config.q_size, config.kv_size
    attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    tensors: dict[str, torch.Tensor] = {}

    def pair(prefix: str, a: tuple[int, int], b: tuple[int, int]) -> None:
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(*a, generator=gen, dtype=dtype).mul_(std)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(*b, generator=gen, dtype=dtype).mul_(std)

    for layer in range(config.num_layers):
        base = f"base_model.model.model.layers.{layer}"
        for module, (fan_in, fan_out) in attention.items():
            pair(f"{base}.self_attn.{module}", (rank, fan_in), (fan_out, rank))
        if config.is_moe_layer(layer):
            pair(f"{base}.mlp.experts.base_layer", (e * rank, h), (2 * i, e * rank))
            pair(f"{base}.mlp.experts", (e * rank, i), (h, e * rank))
    adapter_config: dict[str, object] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": rank, "lora_alpha": 2 * rank, "use_rslora": False,
        "target_modules": list(ATTENTION), "target_parameters": list(EXPERT_PARAMETERS),
        "lora_dropout": 0.0, "bias": "none", "use_dora": False,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    return tensors, adapter_config


def write_expert_lora(out_dir: Path, config: Any, rank: int, seed: int,
                      dtype: torch.dtype = torch.float32) -> Path:
    tensors, adapter_config = expert_lora(config, rank, seed, dtype=dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2))
    return out_dir
