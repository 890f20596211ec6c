"""Synthetic PEFT adapters of real shapes, for benchmarks (no training, no hub)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE

if TYPE_CHECKING:
    from lorastream.worker.model.config import ModelConfig


@dataclass(frozen=True)
class BaseShape:
    """The projection sizes of a base model, and the names of its adaptable projections."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # The modules at the q/k/v and gate/up inputs (Phi-3 fuses each into one).
    qkv_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    gate_up_modules: tuple[str, ...] = ("gate_proj", "up_proj")

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """module -> (in_features, out_features)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = {"q_proj": q, "k_proj": kv, "v_proj": kv, "qkv_proj": q + 2 * kv,
                 "gate_proj": self.intermediate, "up_proj": self.intermediate,
                 "gate_up_proj": 2 * self.intermediate}
        return {
            **{m: (self.hidden, parts[m]) for m in self.qkv_modules},
            "o_proj": (q, self.hidden),
            **{m: (self.hidden, parts[m]) for m in self.gate_up_modules},
            "down_proj": (self.intermediate, self.hidden),
        }

    @property
    def modules(self) -> tuple[str, ...]:
        """Every adaptable projection (what ``target_modules="all-linear"`` adapts)."""
        return tuple(self.module_shapes())

    @property
    def attention_modules(self) -> tuple[str, ...]:
        return (*self.qkv_modules, "o_proj")


# SmolLM2-135M-Instruct, the embedded default model.
SMOLLM2_135M = BaseShape(576, 1536, 30, 9, 3, 64)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
# What ``vocab=`` adds to a synthetic LoRA: kind -> (module, how PEFT trains it).
VOCAB_KINDS = {
    "embed-lora": ("embed_tokens", "target_modules"),  # lora_embedding_A [r, V], _B [H, r]
    "head-lora": ("lm_head", "target_modules"),  # lora_A [r, H], lora_B [V, r]
    "saved-embed": ("embed_tokens", "modules_to_save"),  # the whole [V, H]
    "saved-head": ("lm_head", "modules_to_save"),  # the whole [V, H]
}


def adapter_nbytes(shape: BaseShape, rank: int, targets: tuple[str, ...], itemsize: int = 4) -> int:
    per_layer = sum(rank * (i + o) for m, (i, o) in shape.module_shapes().items() if m in targets)
    return per_layer * shape.num_layers * itemsize


def synthetic_lora(
    shape: BaseShape = SMOLLM2_135M,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    targets: tuple[str, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = 0.02,
    base_model: str | None = None,
    dora: bool = False,
    base_weights: Callable[[str], torch.Tensor] | None = None,
    alora_invocation_tokens: list[int] | None = None,
    token_ids: tuple[int, ...] = (),
    vocab: tuple[str, ...] = (),
    vocab_size: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """A PEFT LoRA in memory: its state dict (PEFT's saved key form) with random A and B (B
    non-zero) of the base's real shapes, and its ``adapter_config.json`` as a dict; ``targets``
    defaults to every adaptable projection of ``shape``. ``dora``: a DoRA adapter, the same A
    and B (same ``seed``) plus a magnitude vector ``[out]`` per module: PEFT's own start,
    ``||W + s B A||`` per row, when ``base_weights`` (checkpoint key -> W ``[out, in]``) is given
    (as trained DoRA magnitudes stay near it), else ones. ``alora_invocation_tokens``: an
    activated LoRA invoked by those token ids. ``token_ids``: TrainableTokens'
    new embedding rows for these ids too (random, ``[k, hidden]``). ``vocab``: ``VOCAB_KINDS``
    keys, each adding that vocabulary module over a base of ``vocab_size`` tokens: a LoRA of
    the same rank (random A and B) or a whole saved matrix (random, ``[vocab_size, hidden]``;
    its values do not matter to a benchmark that ignores EOS)."""
    targets = shape.modules if targets is None else targets
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape.num_layers):
        for module, (fan_in, fan_out) in shape.module_shapes().items():
            if module not in targets:
                continue
            group = "self_attn" if module in shape.attention_modules else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            a = torch.randn(rank, fan_in, generator=gen) * std  # [r, in]
            b = torch.randn(fan_out, rank, generator=gen) * std  # [out, r]
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype)
            if dora:
                m = torch.ones(fan_out)  # [out]
                if base_weights is not None:
                    w = base_weights(f"{prefix.removeprefix('base_model.model.')}.weight")
                    m = (w.float() + (alpha / rank) * (b @ a)).norm(dim=1)
                tensors[f"{prefix}.lora_magnitude_vector"] = m.to(dtype)
    if token_ids:
        rows = torch.randn(len(token_ids), shape.hidden, generator=gen)  # [k, H]
        key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
        tensors[key] = rows.to(dtype)
    if vocab and vocab_size <= 0:
        raise ValueError("vocab modules need the base's vocab_size")
    saved: list[str] = []
    for kind in vocab:
        module, how = VOCAB_KINDS[kind]
        prefix = f"base_model.model.{'model.' if module == 'embed_tokens' else ''}{module}"
        if how == "modules_to_save":
            full = torch.randn(vocab_size, shape.hidden, generator=gen) * std  # [V, H]
            tensors[f"{prefix}.weight"] = full.to(dtype)
            saved.append(module)
        elif module == "embed_tokens":
            a = torch.randn(rank, vocab_size, generator=gen) * std  # [r, V]
            b = torch.randn(shape.hidden, rank, generator=gen) * std  # [H, r]
            tensors[f"{prefix}.lora_embedding_A"] = a.to(dtype)
            tensors[f"{prefix}.lora_embedding_B"] = b.to(dtype)
        else:
            a = torch.randn(rank, shape.hidden, generator=gen) * std  # [r, H]
            b = torch.randn(vocab_size, rank, generator=gen) * std  # [V, r]
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype)
    lora_vocab = [VOCAB_KINDS[k][0] for k in vocab if VOCAB_KINDS[k][1] == "target_modules"]
    config: dict[str, object] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": False,
        "target_modules": [*targets, *lora_vocab],
        "modules_to_save": saved or None,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_dora": dora,
        "trainable_token_indices": list(token_ids) or None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    if alora_invocation_tokens is not None:
        config["alora_invocation_tokens"] = list(alora_invocation_tokens)
    return tensors, config


def make_synthetic_adapter(
    out_dir: Path,
    shape: BaseShape = SMOLLM2_135M,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    targets: tuple[str, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = 0.02,
    base_model: str | None = None,
    dora: bool = False,
    base_weights: Callable[[str], torch.Tensor] | None = None,
    alora_invocation_tokens: list[int] | None = None,
    token_ids: tuple[int, ...] = (),
    vocab: tuple[str, ...] = (),
    vocab_size: int = 0,
) -> Path:
    """Write :func:`synthetic_lora` as a PEFT LoRA directory."""
    tensors, config = synthetic_lora(
        shape, rank=rank, alpha=alpha, targets=targets, dtype=dtype, seed=seed, std=std,
        base_model=base_model, dora=dora, base_weights=base_weights,
        alora_invocation_tokens=alora_invocation_tokens, token_ids=token_ids, vocab=vocab,
        vocab_size=vocab_size,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
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


def model_config(model: str) -> ModelConfig:
    """The :class:`ModelConfig` of a worker ``--model`` (resolved as the worker does)."""
    from lorastream.worker.model.config import ModelConfig

    return ModelConfig.from_dir(resolve_model_checkpoint(model))


def checkpoint_shape(model: str) -> BaseShape:
    """The projection sizes of a worker ``--model`` (resolved as the worker does)."""
    return base_shape(model_config(model))


def base_shape(c: ModelConfig) -> BaseShape:
    """The projection sizes of a base model's :class:`ModelConfig`."""
    return BaseShape(
        c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
        qkv_modules=c.qkv_modules, gate_up_modules=c.gate_up_modules,
    )
