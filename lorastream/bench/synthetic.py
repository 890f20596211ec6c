"""Synthetic PEFT adapters of real shapes, for benchmarks (no training, no hub)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE


@dataclass(frozen=True)
class BaseShape:
    """The projection sizes of a Llama-family base model."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """module -> (in_features, out_features)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, q),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }


# SmolLM2-135M-Instruct, the embedded default model.
SMOLLM2_135M = BaseShape(576, 1536, 30, 9, 3, 64)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def adapter_nbytes(shape: BaseShape, rank: int, targets: tuple[str, ...], itemsize: int = 4) -> int:
    per_layer = sum(rank * (i + o) for m, (i, o) in shape.module_shapes().items() if m in targets)
    return per_layer * shape.num_layers * itemsize


def make_synthetic_adapter(
    out_dir: Path,
    shape: BaseShape = SMOLLM2_135M,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    targets: tuple[str, ...] = ALL_LINEAR,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = 0.02,
    base_model: str | None = None,
) -> Path:
    """Write a PEFT LoRA directory with random A and B (B non-zero) of the base's real shapes."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape.num_layers):
        for module, (fan_in, fan_out) in shape.module_shapes().items():
            if module not in targets:
                continue
            group = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            a = torch.randn(rank, fan_in, generator=gen) * std  # [r, in]
            b = torch.randn(fan_out, rank, generator=gen) * std  # [out, r]
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": False,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out_dir


def resolve_model_checkpoint(model: str) -> Path:
    """The local checkpoint directory of a worker ``--model`` (resolved as the worker does)."""
    from lorastream.worker.model.checkpoint import resolve_checkpoint
    from lorastream.worker.service.config import WorkerSettings

    settings = WorkerSettings(model=model)
    return resolve_checkpoint(
        model, cache_dir=settings.model_cache_dir, hf_endpoint=settings.hf_endpoint,
        hf_token=settings.hf_token,
    )


def checkpoint_shape(model: str) -> BaseShape:
    """The projection sizes of a worker ``--model`` (resolved as the worker does)."""
    from lorastream.worker.model.config import LlamaConfig

    c = LlamaConfig.from_dir(resolve_model_checkpoint(model))
    return BaseShape(
        c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim
    )
