"""The adapters the serving benchmarks (``bench serve``, ``serve_cold.py``, ``gpu_serving.py``)
stage for a base model: LoRA on every linear projection of a dense base; on a mixture-of-experts
base, LoRA on q/k/v/o and on every routed expert of every sparse layer, PEFT's fused
``target_parameters`` form (``expert_lora.py``) -- with tens of experts, hundreds of MB at a rank
where a dense model's adapter takes a few MB."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lorastream.bench.expert_lora import write_expert_lora
from lorastream.bench.synthetic import (
    ALL_LINEAR,
    adapter_nbytes,
    base_shape,
    make_synthetic_adapter,
)

if TYPE_CHECKING:
    from lorastream.worker.model.config import ModelConfig


def serving_adapter_nbytes(config: ModelConfig, rank: int) -> int:
    """Bytes (fp32) of the adapter the serving benchmarks stage for a base (its tensors, as the
    store sends them): :func:`make_serving_adapter`."""
    if not config.is_moe:
        return adapter_nbytes(base_shape(config), rank, ALL_LINEAR)
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    q, kv = config.q_size, config.kv_size
    attention = rank * ((h + q) + 2 * (h + kv) + (q + h))  # q, k, v, o: A [r, in] + B [out, r]
    # gate_up: A [E r, H] + B [2 I, E r]; down: A [E r, I] + B [H, E r]
    experts = e * rank * ((h + 2 * i) + (i + h))
    sparse = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    return 4 * (config.num_layers * attention + sparse * experts)


def make_serving_adapter(out_dir: Path, config: ModelConfig, rank: int, seed: int,
                         dtype: torch.dtype = torch.float32) -> Path:
    """The serving benchmarks' adapter for a base (module docstring), written as a PEFT LoRA
    directory of ``dtype`` tensors."""
    if config.is_moe:
        return write_expert_lora(out_dir, config, rank, seed, dtype=dtype)
    return make_synthetic_adapter(out_dir, base_shape(config), rank=rank, targets=ALL_LINEAR,
                                  dtype=dtype, seed=seed)
