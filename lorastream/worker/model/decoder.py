"""One decoder for every family, over a flat batch of tokens, with a paged KV cache and a LoRA hook.

As in gpt-fast, q/k/v and gate/up are fused into one matmul each; the LoRA hook adds each
adapted projection's delta into its slice of the fused output, for every token of the batch at
once (``lora.add``), so the base model and all adapters of a mixed batch run in one pass.
What a family changes is in :class:`ModelConfig` (see ``families/``); numerics follow HF
transformers op for op: RMSNorm in fp32 (Llama ``w * x̂``, Gemma ``x̂ * (1 + w)``), rotate-half
RoPE, the configured gated activation, soft-capping as ``c * tanh(x / c)``. A mixture-of-experts
layer runs its routed block (moe.py) where a dense layer runs gate/up and down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from lorastream.kernels.cpu.norm_rope import rms_norm
from lorastream.worker.device.cpu.kernel_choice import CpuKernels, use_cpu_kernels
from lorastream.worker.device.cpu.native_env import release_freed_memory
from lorastream.worker.model.attention import paged_attention, write_kv
from lorastream.worker.model.config import SHARED_DOWN, SHARED_GATE_UP, SITES, ModelConfig
from lorastream.worker.model.forward_batch import ForwardBatch
from lorastream.worker.model.kv_cache import KVCache
from lorastream.worker.model.linear import Linear
from lorastream.worker.model.moe import MoeBlock, MoeWeights
from lorastream.worker.model.quant_linear import Quantization, QuantLinear
from lorastream.worker.model.rope import RotaryEmbedding, apply_rotary

MOE_GATES = ("gate", "shared_expert_gate")  # a MoE block's plain gate weights (moe.py)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


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

    def add_experts(
        self, layer: int, part: str, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """A MoE layer's expert deltas (``lora/experts.py``): ``part`` "gate_up" or "down",
        x [P, K] the expert-sorted assignments' inputs, token/expert [P], out [P, N]."""

    def embed(self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None
              ) -> torch.Tensor:
        """x [T, H], the base embeddings of ``ids`` [T] (times ``scale``), with each row's
        adapter's new rows, embedding LoRA or saved embedding (``lora/vocab.py``)."""

    def head(self, h: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits [n, V] of batch rows ``rows`` [n] (final hidden states h [n, H]) with each
        row's adapter's lm_head LoRA, saved lm_head or tied new rows."""


@dataclass(frozen=True)
class LayerLora:
    """A step's LoRA hook bound to one layer, as its routed block calls it (``moe.MoeLora``)."""

    lora: LoraHook
    layer: int

    def add_experts(self, part: str, x: torch.Tensor, token: torch.Tensor,
                    expert: torch.Tensor, out: torch.Tensor) -> None:
        self.lora.add_experts(self.layer, part, x, token, expert, out)

    def add(self, modules: tuple[str, ...], x: torch.Tensor, out: torch.Tensor,
            cols: tuple[int, ...]) -> None:
        if len(modules) == 1:
            self.lora.add(self.layer, modules[0], x, out, cols[0])
        else:
            self.lora.add_group(self.layer, modules, x, out, cols)


@dataclass
class LayerWeights:
    """One layer's weights as loaded; :class:`DecoderModel` takes the projections over (as
    :class:`Linear`) and sets them to None here, so no second copy stays in memory. Optional
    tensors are None when the config has no such part."""

    attn_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor | None  # [q + 2 kv, H]
    wo: torch.Tensor | None  # [H, q]
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor | None  # [2 I, H] (None in a MoE layer)
    w_down: torch.Tensor | None  # [H, I]
    b_qkv: torch.Tensor | None = None  # [q + 2 kv]
    b_o: torch.Tensor | None = None  # [H]
    b_gate_up: torch.Tensor | None = None  # [2 I]
    b_down: torch.Tensor | None = None  # [H]
    q_norm: torch.Tensor | None = None  # [d]
    k_norm: torch.Tensor | None = None  # [d]
    post_attn_norm: torch.Tensor | None = None  # [H] (Gemma: on the attention output)
    post_mlp_norm: torch.Tensor | None = None  # [H] (Gemma: on the MLP output)
    moe: MoeWeights | None = None  # a MoE layer's router and experts, in place of the MLP


@dataclass
class DecoderWeights:
    embed: torch.Tensor | None  # [V, H] (None: a quantized tied lm_head serves the lookup)
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor | None  # [V, H] (the embedding itself when tied); None once taken over


Projection = Linear | QuantLinear


def projection(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: Quantization,
    keep_rows: bool = False, native: bool = False,
) -> Projection:
    """The base model's ``x @ weight.T (+ bias)``: fp32/bf16 (linear.py) or int8/fp8
    (quant_linear.py), as ``--quantization`` says (``keep_rows``: the lm_head, whose rows
    ``exact_top`` reads and, tied, the embedding lookup; ``native``: the C++ CPU ops run)."""
    if quantization == "none":
        return Linear(weight, bias)
    return QuantLinear(weight, bias, quantization, keep_rows=keep_rows, native=native)


class RMSNorm:
    """HF's RMSNorm over the last dim, x̂ = x / rms(x) in fp32: ``w * x̂.to(dtype)`` (Llama,
    Qwen) or, with ``plus_one``, ``(x̂ * (1 + w)).to(dtype)`` in fp32 (Gemma)."""

    def __init__(self, weight: torch.Tensor, eps: float, plus_one: bool, native: bool = False
                 ) -> None:
        self.eps = eps
        self.plus_one = plus_one
        self.weight = 1.0 + weight.float() if plus_one else weight  # [D]
        # the C++ op (lorastream/kernels/cpu/norm_rope.py) for fp32 [T, D] hidden states
        self.native = native and self.weight.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        if self.native and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (x32 * self.weight).to(dtype)
        return self.weight * x32.to(dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


@dataclass
class _Layer:
    """What one layer runs besides its projections: norms and attention options."""

    attn_norm: RMSNorm
    mlp_norm: RMSNorm
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    post_attn_norm: RMSNorm | None
    post_mlp_norm: RMSNorm | None
    local_rope: bool  # the sliding layers' RoPE (Gemma 3)
    window: int | None  # sliding window, None: global attention
    moe: MoeBlock | None  # the routed block in place of gate_up/down (a MoE layer)


class DecoderModel:
    """Inference-only decoder; ``forward`` returns logits of ``batch.logit_rows``.

    ``quantization`` (``--quantization``): every projection and the lm_head as loaded ("none")
    or quantized to int8 once, here (quant_linear.py); norms, embeddings (but a tied lm_head's,
    which is the quantized lm_head), attention and the KV cache keep the model's dtype.
    ``cpu_kernels`` (``--cpu-kernels``): decode attention on the C++ CPU kernel or torch's
    SDPA path (attention.py; ``device/cpu/kernel_choice.py``).
    """

    def __init__(
        self, config: ModelConfig, weights: DecoderWeights, device: torch.device,
        quantization: Quantization = "none", cpu_kernels: CpuKernels = "auto",
    ) -> None:
        self.config = config
        self.weights = weights
        self.device = device
        self.quantization = quantization
        assert weights.embed is not None and weights.lm_head is not None
        self.dtype = weights.embed.dtype
        # decode attention on the C++ kernel (attention.py); may be switched between steps
        self.native_attention = use_cpu_kernels(cpu_kernels, device, self.dtype)
        # the other C++ ops are loaded: RMSNorm, the rotary embedding, int8's products
        self.native_ops = self.native_attention
        self.rope = self._rope(config.rope_theta, config.rope_scaling)
        self.local_rope = (
            self._rope(config.local_rope_theta, config.local_rope_scaling)
            if config.local_rope_theta is not None else None
        )
        self.scale = config.attn_scale
        self.activation = ACTIVATIONS[config.activation]
        self.embed_scale = (
            torch.tensor(config.hidden_size**0.5, dtype=self.dtype, device=device)
            if config.scale_embeddings else None
        )
        targets = config.lora_targets()
        self.lora_sites = {  # site -> (modules, their first columns in the site's output)
            site: (
                tuple(t.module for t in targets if t.site == site),
                tuple(t.col for t in targets if t.site == site),
            )
            for site in SITES
        }
        # The projections, each prepared once for fast products (see linear.py): qkv, o, and
        # gate_up, down in a dense layer (a MoE layer's experts are in its _Layer.moe).
        self.proj: list[tuple[Projection, ...]] = []
        self.layers: list[_Layer] = []
        native = self.native_ops
        for i, lw in enumerate(weights.layers):
            assert lw.wqkv is not None and lw.wo is not None
            proj = [projection(lw.wqkv, lw.b_qkv, quantization, native=native),
                    projection(lw.wo, lw.b_o, quantization, native=native)]
            if lw.moe is None:
                assert lw.w_gate_up is not None and lw.w_down is not None
                proj += [projection(lw.w_gate_up, lw.b_gate_up, quantization, native=native),
                         projection(lw.w_down, lw.b_down, quantization, native=native)]
            self.proj.append(tuple(proj))
            lw.wqkv = lw.wo = lw.w_gate_up = lw.w_down = None  # held by the Linears, if needed
            self.layers.append(self._layer(i, lw))
        self.final_norm = self._norm(weights.norm)
        self.lm_head = projection(weights.lm_head, None, quantization, keep_rows=True,
                                  native=native)
        self._embed_rows: QuantLinear | None = None  # the lookup from a quantized tied lm_head
        if isinstance(self.lm_head, QuantLinear) and config.tie_word_embeddings:
            self._embed_rows = self.lm_head  # as tied HF models do: one (quantized) matrix
            weights.embed = None
        weights.lm_head = None  # held by the lm_head (tied, unquantized: the embedding stays)
        release_freed_memory()  # the loaded weights the projections copied are freed now

    def _rope(self, theta: float, scaling: dict[str, Any] | None) -> RotaryEmbedding:
        c = self.config
        return RotaryEmbedding(
            head_dim=c.head_dim, rope_theta=theta,
            max_position_embeddings=c.max_position_embeddings, rope_scaling=scaling,
            device=self.device,
        )

    def _norm(self, weight: torch.Tensor) -> RMSNorm:
        return RMSNorm(weight, self.config.rms_norm_eps, self.config.norm_plus_one,
                       native=self.native_ops)

    def _optional_norm(self, weight: torch.Tensor | None) -> RMSNorm | None:
        return None if weight is None else self._norm(weight)

    def _layer(self, i: int, lw: LayerWeights) -> _Layer:
        c = self.config
        return _Layer(
            attn_norm=self._norm(lw.attn_norm),
            mlp_norm=self._norm(lw.mlp_norm),
            q_norm=self._optional_norm(lw.q_norm),
            k_norm=self._optional_norm(lw.k_norm),
            post_attn_norm=self._optional_norm(lw.post_attn_norm),
            post_mlp_norm=self._optional_norm(lw.post_mlp_norm),
            local_rope=c.is_local(i),
            window=c.window(i),
            moe=None if lw.moe is None else self._moe(lw.moe),
        )

    def _moe(self, mw: MoeWeights) -> MoeBlock:
        """A layer's routed block; its shared expert's projections as the dense ones (the
        experts themselves stay in the model's dtype under ``--quantization``)."""
        shared = None
        if mw.shared_gate_up is not None and mw.shared_down is not None:
            q, native = self.quantization, self.native_ops
            shared = (projection(mw.shared_gate_up, None, q, native=native),
                      projection(mw.shared_down, None, q, native=native))
            mw.shared_gate_up = mw.shared_down = None
        return MoeBlock(mw, self.config, self.activation, shared, native=self.native_ops)

    def _lora(
        self, lora: LoraHook, layer: int, site: str, x: torch.Tensor, out: torch.Tensor
    ) -> None:
        modules, cols = self.lora_sites[site]
        if not modules:  # a site no adapter may target (a MoE model's MLP)
            return
        if len(modules) == 1:
            lora.add(layer, modules[0], x, out, cols[0])
        else:
            lora.add_group(layer, modules, x, out, cols)

    def dora_norms(
        self, layer: int, module: str, b: torch.Tensor, a: torch.Tensor
    ) -> torch.Tensor:  # b [N, r] (scaling in), a [r, K] -> [N] fp32
        """``||W + b @ a||`` per output row of ``module``'s weight in ``layer``, over the weight
        the projection computes with (int8/fp8: dequantized): DoRA's norm, taken once when an
        adapter is placed in its slot (``LoraSlots``)."""
        moe = self.layers[layer].moe
        if moe is not None and module in MOE_GATES:  # a MoE block's router or shared gate
            w = moe.router if module == "gate" else moe.shared_gate  # [N, K]
            assert w is not None
            return (w.float() + b.float() @ a.float()).norm(dim=1)
        proj, col = self._lora_projection(layer, module)
        return proj.delta_row_norms(slice(col, col + b.shape[0]), b, a)

    def lora_bias(self, layer: int, module: str) -> torch.Tensor | None:  # [N] or None
        """The bias of ``module``'s output columns in ``layer`` (Qwen2's q/k/v), None if none."""
        if module in MOE_GATES or module in SHARED_GATE_UP or module == SHARED_DOWN:
            return None  # a MoE block's weights have none
        proj, col = self._lora_projection(layer, module)
        width = self.config.module_shapes()[module][1]
        return None if proj.bias is None else proj.bias[col : col + width]

    def _lora_projection(self, layer: int, module: str) -> tuple[Projection, int]:
        """The projection computing ``module`` in ``layer``, and ``module``'s first column."""
        for index, site in enumerate(SITES):
            modules, cols = self.lora_sites[site]
            if module in modules:
                return self.proj[layer][index], cols[modules.index(module)]
        moe = self.layers[layer].moe
        if moe is not None and moe.shared is not None and (
            module in SHARED_GATE_UP or module == SHARED_DOWN
        ):
            gate_up, down = moe.shared
            width = self.config.shared_expert_intermediate_size
            if module == SHARED_DOWN:
                return down, 0  # type: ignore[return-value]  # the shared expert's Projection
            offset = SHARED_GATE_UP.index(module) * width
            return gate_up, offset  # type: ignore[return-value]  # the shared expert's Projection
        raise KeyError(f"{module} is not an adaptable projection of {self.config.describe()}")

    def _cos_sin(
        self, rope: RotaryEmbedding, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, d] each
        cos, sin = rope.cos_sin(
            batch.positions, batch.seq_lens, max_position=batch.max_position,
            longest=batch.longest,
        )
        return cos.to(self.dtype), sin.to(self.dtype)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVCache, lora: LoraHook | None = None
    ) -> torch.Tensor:  # [n, V] float32
        """Every layer over ``batch``: :meth:`embed`, :meth:`run_layers` over all of them,
        :meth:`head`."""
        x = self.embed(batch, lora)
        x = self.run_layers(x, batch, kv, lora, 0, len(self.layers))
        return self.head(x, batch, lora)

    @torch.inference_mode()
    def embed(self, batch: ForwardBatch, lora: LoraHook | None = None) -> torch.Tensor:  # [T, H]
        """The input embeddings of the batch's tokens (scaled where the family scales them),
        each row's from its adapter's vocabulary modules where it has any."""
        if self._embed_rows is not None:
            x = self._embed_rows.rows(batch.input_ids).to(self.dtype)  # [T, H]
        else:
            assert self.weights.embed is not None
            x = self.weights.embed[batch.input_ids]  # [T, H]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if lora is not None:
            x = lora.embed(batch.input_ids, x, self.embed_scale)
        return x

    @torch.inference_mode()
    def run_layers(
        self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache, lora: LoraHook | None,
        start: int, stop: int,
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        """Layers ``start .. stop - 1`` over the hidden states ``x`` of ``batch``'s tokens,
        writing their keys and values into ``kv``: a forward may run in several such spans,
        ``x`` carried from one to the next (a prefill that starts while its adapter's later
        layers are still landing), with results identical to one pass."""
        c = self.config
        q_size, kv_size, inter = c.q_size, c.kv_size, c.intermediate_size
        t = batch.num_tokens
        rope_tables = {False: self._cos_sin(self.rope, batch)}
        if self.local_rope is not None:
            rope_tables[True] = self._cos_sin(self.local_rope, batch)
        for i in range(start, stop):
            layer = self.layers[i]
            wqkv, wo = self.proj[i][:2]
            h = layer.attn_norm(x)
            qkv = wqkv(h)  # [T, q + 2 kv]
            if lora is not None:
                self._lora(lora, i, "qkv", h, qkv)
            q = qkv[:, :q_size].view(t, c.num_heads, c.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size :].view(t, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            cos, sin = rope_tables[layer.local_rope]
            q, k = apply_rotary(q, k, cos, sin, native=self.native_ops)
            write_kv(kv.k[i], kv.v[i], k, v, batch.slot_mapping)
            attn = paged_attention(
                q, kv.k[i], kv.v[i], k, v, batch, self.scale, window=layer.window,
                softcap=c.attn_softcap, native=self.native_attention,
            )
            attn = attn.reshape(t, q_size)  # [T, q]
            o = wo(attn)  # [T, H]
            if lora is not None:
                self._lora(lora, i, "o", attn, o)
            if layer.post_attn_norm is not None:
                o = layer.post_attn_norm(o)
            x = x + o
            h = layer.mlp_norm(x)
            if layer.moe is not None:
                down = layer.moe(h, None if lora is None else LayerLora(lora, i))
            else:
                w_gate_up, w_down = self.proj[i][2:]
                gate_up = w_gate_up(h)  # [T, 2 I]
                if lora is not None:
                    self._lora(lora, i, "gate_up", h, gate_up)
                act = self.activation(gate_up[:, :inter]) * gate_up[:, inter:]  # [T, I]
                down = w_down(act)  # [T, H]
                if lora is not None:
                    self._lora(lora, i, "down", act, down)
            if layer.post_mlp_norm is not None:
                down = layer.post_mlp_norm(down)
            x = x + down
        return x

    @torch.inference_mode()
    def head(
        self, x: torch.Tensor, batch: ForwardBatch, lora: LoraHook | None = None
    ) -> torch.Tensor:  # [T, H] -> [n, V]
        """The logits (float32) of ``batch.logit_rows`` from the last layer's hidden states,
        each row's from its adapter's lm_head where it changes it."""
        rows = self.final_norm(x[batch.logit_rows])  # [n, H]
        logits = self.lm_head(rows)  # [n, V]
        if isinstance(self.lm_head, QuantLinear):  # int8(-dynamic): the candidates' exact
            logits = self.lm_head.exact_top(rows, logits)
        if lora is not None:
            logits = lora.head(rows, logits, batch.logit_rows)
        if self.config.final_softcap is not None:
            logits = soft_cap(logits, self.config.final_softcap)
        return logits.float()
