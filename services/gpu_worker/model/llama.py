"""A Llama-family decoder over a flat batch of tokens, with a paged KV cache and a LoRA hook.

As in gpt-fast, q/k/v and gate/up are fused into one matmul each; the LoRA hook adds each
adapted projection's delta into its slice of the fused output, for every token of the batch at
once (``lora.add``), so the base model and all adapters of a mixed batch run in one pass.
Numerics follow HF transformers' LlamaForCausalLM (RMSNorm in fp32, SiLU gate, rotate-half RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from lorastream.worker.model.attention import paged_attention, write_kv
from lorastream.worker.model.config import GATE_UP, QKV, LlamaConfig
from lorastream.worker.model.forward_batch import ForwardBatch
from lorastream.worker.model.kv_cache import KVCache
from lorastream.worker.model.linear import Linear
from lorastream.worker.model.rope import RotaryEmbedding, apply_rotary


class LoraHook(Protocol):
    """Adds LoRA deltas of one step; built per step by the engine (None: base model only)."""

    def add(
        self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor, col: int
    ) -> None:
        """out[:, col:col+N] += delta of ``module`` in ``layer`` for x [T, in] (per token)."""

    def add_group(
        self, layer: int, modules: tuple[str, ...], x: torch.Tensor, out: torch.Tensor,
        cols: tuple[int, ...],
    ) -> None:
        """:meth:`add` for each of ``modules`` (which all read ``x``) at its column."""


@dataclass
class LayerWeights:
    """One layer's weights as loaded; :class:`LlamaModel` takes the projections over (as
    :class:`Linear`) and sets them to None here, so no second copy stays in memory."""

    attn_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor | None  # [q + 2 kv, H]
    wo: torch.Tensor | None  # [H, q]
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor | None  # [2 I, H]
    w_down: torch.Tensor | None  # [H, I]


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class LlamaModel:
    """Inference-only Llama; ``forward`` returns logits of ``batch.logit_rows``."""

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, device: torch.device) -> None:
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = weights.embed.dtype
        self.rope = RotaryEmbedding(
            head_dim=config.head_dim,
            rope_theta=config.rope_theta,
            max_position_embeddings=config.max_position_embeddings,
            rope_scaling=config.rope_scaling,
            device=device,
        )
        self.scale = config.head_dim**-0.5
        # The projections, each prepared once for fast products (see linear.py).
        self.proj: list[tuple[Linear, Linear, Linear, Linear]] = []
        for lw in weights.layers:
            assert lw.wqkv is not None and lw.wo is not None
            assert lw.w_gate_up is not None and lw.w_down is not None
            self.proj.append(
                (Linear(lw.wqkv), Linear(lw.wo), Linear(lw.w_gate_up), Linear(lw.w_down))
            )
            lw.wqkv = lw.wo = lw.w_gate_up = lw.w_down = None  # held by the Linears, if needed
        self.lm_head = Linear(weights.lm_head)  # tied: the embedding stays for the lookup

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVCache, lora: LoraHook | None = None
    ) -> torch.Tensor:  # [n, V] float32
        c, w = self.config, self.weights
        q_size, kv_size, inter = c.q_size, c.kv_size, c.intermediate_size
        t = batch.num_tokens
        x = w.embed[batch.input_ids]  # [T, H]
        cos, sin = self.rope.cos_sin(
            batch.positions, batch.seq_lens, max_position=batch.max_position,
            longest=batch.longest,
        )  # [T, d]
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        for i, layer in enumerate(w.layers):
            wqkv, wo, w_gate_up, w_down = self.proj[i]
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            qkv = wqkv(h)  # [T, q + 2 kv]
            if lora is not None:
                lora.add_group(i, QKV, h, qkv, (0, q_size, q_size + kv_size))
            q = qkv[:, :q_size].view(t, c.num_heads, c.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size :].view(t, c.num_kv_heads, c.head_dim)
            q, k = apply_rotary(q, k, cos, sin)
            write_kv(kv.k[i], kv.v[i], k, v, batch.slot_mapping)
            attn = paged_attention(q, kv.k[i], kv.v[i], k, v, batch, self.scale)
            attn = attn.reshape(t, q_size)  # [T, q]
            o = wo(attn)  # [T, H]
            if lora is not None:
                lora.add(i, "o_proj", attn, o, 0)
            x = x + o
            h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
            gate_up = w_gate_up(h)  # [T, 2 I]
            if lora is not None:
                lora.add_group(i, GATE_UP, h, gate_up, (0, inter))
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [T, I]
            down = w_down(act)  # [T, H]
            if lora is not None:
                lora.add(i, "down_proj", act, down, 0)
            x = x + down
        rows = x[batch.logit_rows]  # [n, H]
        rows = rms_norm(rows, w.norm, c.rms_norm_eps)
        return self.lm_head(rows).float()  # [n, V]
