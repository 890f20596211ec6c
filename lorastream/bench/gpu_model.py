"""Random-weight base models of real shapes, built where they run, for the GPU benchmarks.

The GPU machine reaches no registry and carries 64 MiB, so no checkpoint travels there: the
benchmarks build the default model's shapes (SmolLM2-135M-Instruct), a Llama-3.1-8B-shaped model
(bf16, 16 GB) and a Qwen3-30B-A3B-shaped mixture of experts (bf16, 61 GB: 48 sparse layers of
128 experts) from random weights on the device, and their adapters on the host there: synthetic
all-linear PEFT LoRAs for a dense shape, expert LoRAs (q/k/v/o and every expert's gate_up/down
through ``target_parameters``) for a MoE one (``serve_adapters.py``). Speed
does not depend on what the weights are; the figures measured on these models are about the
engine's time, never its text (greedy-token checks against PEFT run on small real checkpoints,
in tests/gpu).

The engine is assembled from the worker's own parts as ``service/bootstrap.build_engine`` does,
with the weights made in memory instead of read from a checkpoint directory (writing and reading
16 GB of random safetensors would take most of the GPU check's minutes), and a tokenizer that
only names token ids: prompts are token ids and every request ignores EOS.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lorastream.bench.serve_adapters import make_serving_adapter
from lorastream.worker.device.device import Device
from lorastream.worker.engine.engine import Engine
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.loading.manager import AdapterManager
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderModel, DecoderWeights, LayerWeights
from lorastream.worker.model.kv_cache import KVCache
from lorastream.worker.model.moe import MoeWeights
from lorastream.worker.service.bootstrap import make_backend
from lorastream.worker.service.config import WorkerSettings

log = logging.getLogger(__name__)

_TOKENIZER_CACHE = WorkerSettings.model_fields["adapter_tokenizer_cache"].default

# config.json of each shape, as transformers saves it (the weights are what is made up).
SHAPES: dict[str, dict[str, Any]] = {
    # the embedded default model (NOTES.md: SmolLM2-135M-Instruct from its GGUF)
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    # every layer sparse (decoder_sparse_step 1, no mlp_only_layers); intermediate_size is the
    # dense MLP's width, which no layer of it has
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    # a few MB each: the benchmarks' code path on the CPU (tests), never a figure
    "tiny": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
    },
    "tiny-moe": {
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    },
}


def model_config(shape: str) -> ModelConfig:
    return ModelConfig.from_dict(SHAPES[shape], shape)


def _buildable(config: ModelConfig) -> str | None:
    """Why :func:`random_weights` cannot build ``config`` (None: it can). Llama's layout, and
    Qwen3-MoE's: Llama's plus q/k norms and a routed block of experts on every layer."""
    if config.family not in ("llama", "qwen3_moe"):
        return f"model_type {config.family!r}"
    if config.qkv_bias or config.o_bias or config.mlp_bias:
        return "projection biases"
    if config.qk_norm and config.family != "qwen3_moe":
        return "q/k norms outside Qwen3-MoE"
    if config.is_moe and (config.dense_layers or config.shared_expert_intermediate_size):
        return "dense layers or a shared expert among the experts"
    if config.layer_windows:
        return "sliding windows"
    return None


def random_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                   seed: int = 0) -> DecoderWeights:
    """Weights of ``config``'s shapes drawn on ``device``: projections, the router and every
    expert ~ N(0, 1/fan_in) (the activations keep their scale through the layers, and the
    router's logits spread the tokens over the experts), norms at one. Llama's layout and
    Qwen3-MoE's (q/k norms, a router and fused experts on every layer); ValueError for any
    other. Each tensor is drawn in ``dtype`` where it lies, an expert stack one expert at a
    time, so no fp32 temporary of a whole stack is made (61 GB of bf16 for Qwen3-30B-A3B)."""
    why = _buildable(config)
    if why is not None:
        raise ValueError(f"{config.describe()}: random weights are made for Llama's layout and "
                         f"Qwen3-MoE's only, not for {why}")
    gen = torch.Generator(device=device).manual_seed(seed)
    h, q, kv, inter, d = (config.hidden_size, config.num_heads * config.head_dim,
                          config.num_kv_heads * config.head_dim, config.intermediate_size,
                          config.head_dim)

    def proj(out_features: int, in_features: int) -> torch.Tensor:  # [out, in]
        w = torch.randn(out_features, in_features, generator=gen, device=device, dtype=dtype)
        return w.mul_(in_features ** -0.5)

    def stack(experts: int, out_features: int, in_features: int) -> torch.Tensor:  # [E, out, in]
        w = torch.empty(experts, out_features, in_features, device=device, dtype=dtype)
        for expert in w:  # [out, in], drawn in place
            expert.normal_(0.0, in_features ** -0.5, generator=gen)
        return w

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    def moe() -> MoeWeights:
        e, i = config.num_experts, config.moe_intermediate_size
        return MoeWeights(router=proj(e, h), gate_up=stack(e, 2 * i, h), down=stack(e, h, i))

    layers = [
        LayerWeights(attn_norm=ones(h), wqkv=proj(q + 2 * kv, h), wo=proj(h, q),
                     mlp_norm=ones(h),
                     w_gate_up=None if config.is_moe else proj(2 * inter, h),
                     w_down=None if config.is_moe else proj(h, inter),
                     q_norm=ones(d) if config.qk_norm else None,
                     k_norm=ones(d) if config.qk_norm else None,
                     moe=moe() if config.is_moe else None)
        for _ in range(config.num_layers)
    ]
    embed = torch.randn(config.vocab_size, h, generator=gen, device=device, dtype=dtype)  # [V, H]
    lm_head = embed if config.tie_word_embeddings else proj(config.vocab_size, h)  # [V, H]
    return DecoderWeights(embed=embed, layers=layers, norm=ones(h), lm_head=lm_head)


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> DecoderModel:
    """The decoder over :func:`random_weights`; engines built one after another share it
    (:func:`random_engine`), so a 61-GB model is made once."""
    return DecoderModel(config, random_weights(config, dtype, device, seed), device)


class IdTokenizer:
    """Names token ids (``<17>``): what the engine's detokenizer asks of a tokenizer, for a
    model whose prompts are token ids and whose text nobody reads."""

    eos_token_id = None
    chat_template = None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False,
               **kwargs: Any) -> str:
        return "".join(f"<{int(t)}>" for t in token_ids)


def random_engine(
    model: DecoderModel,
    *,
    max_loras: int,
    max_lora_rank: int,
    host_cache_bytes: int,
    kv_cache_bytes: int,
    max_batch_size: int,
    overlap: bool = True,
    lora_backend: str = "triton",
    max_num_tokens: int = 4096,
    max_seq_len: int = 2048,
) -> Engine:
    """A ready (not started) engine over ``model`` (:func:`random_model`), with the worker's
    parts as ``build_engine`` wires them: the device layer, the paged KV cache, the LoRA slots,
    the adapter tiers (no store: adapters are registered from local directories) and the
    loop."""
    config, device, dtype = model.config, model.device, model.dtype
    worker_device = Device(device)
    kv = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, kv_cache_bytes, dtype,
                 device)
    slots = LoraSlots(config, max_loras, max_lora_rank, dtype, device)
    adapters = AdapterManager(config, slots, worker_device, AdapterFetcher(worker_device, None),
                              host_cache_bytes, overlap=overlap,
                              tokenizers=_TOKENIZER_CACHE)
    log.info("random %s engine on %s (%s): KV %d tokens, %d slots of rank <= %d, overlap %s",
             config.name, device, str(dtype).removeprefix("torch."), kv.capacity_tokens,
             max_loras, max_lora_rank, "on" if overlap else "off")
    return Engine(
        model, IdTokenizer(), kv, slots, adapters,
        make_backend(lora_backend, dtype, device, model.native_ops), worker_device,
        base_model_name="base", max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len, default_max_tokens=16,
    )


def make_adapters(root: Path, config: ModelConfig, count: int, rank: int,
                  dtype: torch.dtype, first_seed: int = 0) -> list[Path]:
    """``count`` PEFT LoRAs of ``config``'s shapes (random A and non-zero B) under ``root``,
    made on the host of the machine that runs the benchmark, as the serving benchmarks make
    theirs (``serve_adapters.py``): all-linear for a dense model; for a MoE model, q/k/v/o and
    every expert's gate_up and down (``target_parameters``). A few at a time on threads (the
    draws and writes leave the GIL): a rank-16 expert LoRA of Qwen3-30B-A3B is 1.29 GB of
    bf16."""

    def make(i: int) -> Path:
        return make_serving_adapter(root / f"a{first_seed + i}", config, rank,
                                    seed=first_seed + i, dtype=dtype)

    workers = max(1, min(count, 8, (os.cpu_count() or 1) // 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(make, range(count)))
