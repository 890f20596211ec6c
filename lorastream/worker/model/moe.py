"""The routed block of a mixture-of-experts layer, over a flat batch of tokens.

As transformers computes it (``Qwen2MoeTopKRouter``, ``MixtralTopKRouter``, ``*Experts``)::

    logits  = h @ routerᵀ                                  [T, E]  (model dtype)
    probs   = softmax(logits, fp32)                        [T, E]
    w, e    = topk(probs, k)                               [T, k]  (ties: torch.topk's order)
    w       = w / w.sum(-1)          if norm_topk_prob
    w       = w.to(dtype)            unless routing_weights_fp32 (Mixtral)
    out[t]  = Σ_j w[t, j] * down_e(act(gate_e(h[t])) * up_e(h[t]))   for e = e[t, j]
    out    += sigmoid(h @ shared_gateᵀ) * shared_mlp(h)    (Qwen2-MoE's shared expert)

The experts run batched: the T * k (token, expert) assignments are sorted by expert id (stably,
so each expert's tokens stay in batch order), the tokens' rows gathered once, and two
``grouped_mm`` calls with per-expert segment ends compute every expert's gate/up and down
products; one ``index_add_`` puts the weighted results back at their tokens, in expert order as
transformers adds them. Example, T = 3, k = 2, E = 4, experts [[2, 0], [0, 3], [2, 1]]::

    flat   = [2, 0, 0, 3, 2, 1]      order = [1, 2, 5, 0, 4, 3]   (argsort, stable)
    token  = order // k = [0, 1, 2, 0, 2, 1]   ends = [2, 3, 5, 6]   (cumsum of bincount)
    expert 0: rows 0-1 (tokens 0, 1)   expert 1: row 2 (token 2)   expert 2: rows 3-4   ...

With an expert-LoRA hook (``lora/experts.py``), the hook adds each adapter's delta to the
sorted rows after the gate_up and after the down products, before the activation and the
routing weights, as PEFT's merged expert weights give it. The block's plain weights take LoRA
like any projection (``MoeLora.add``): the router's delta is added to its logits before the
softmax (so an adapter may route a token elsewhere, as PEFT's ``gate.weight`` LoRA does), the
shared expert's to its gate_up and down outputs, the shared-expert gate's before its sigmoid.

With ``native`` (``--cpu-kernels``, fp32 on the CPU), steps whose assignments average a few per
expert (decode) run both products in ``kernels/cpu/moe.py``'s ``expert_segments_mm`` instead:
``grouped_mm`` runs a GEMM of a few rows per expert there, which costs far more than reading the
expert's weight; the C++ op streams each visited expert's weight once, in its loaded layout.

Where ``grouped_mm`` cannot take the weights' strides (a width not a multiple of 16 bytes), the
same segments run one matmul per expert (a loop over the E experts, each over its gathered
tokens; it reads the segment ends on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from lorastream.kernels.cpu.moe import expert_segments_mm
from lorastream.worker.model.config import SHARED_DOWN, SHARED_GATE_UP, ModelConfig

NATIVE_ROWS_PER_EXPERT = 8  # the C++ product while the assignments average at most this many


@dataclass
class MoeWeights:
    """One sparse layer's MoE weights as loaded (fused layout, whatever the checkpoint's)."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2 I, H]: gate rows, then up rows, of each expert
    down: torch.Tensor  # [E, H, I]
    shared_gate_up: torch.Tensor | None = None  # [2 Is, H] (Qwen2-MoE)
    shared_down: torch.Tensor | None = None  # [H, Is]
    shared_gate: torch.Tensor | None = None  # [1, H]


Project = Callable[[torch.Tensor], torch.Tensor]  # x [T, K] -> [T, N] (a base projection)
# (part "gate_up" | "down", x [P, K], token [P], expert [P], out [P, N]): adds expert LoRA deltas
ExpertHook = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class MoeLora(Protocol):
    """One layer's LoRA hook inside its routed block (the decoder binds the layer)."""

    def add_experts(self, part: str, x: torch.Tensor, token: torch.Tensor,
                    expert: torch.Tensor, out: torch.Tensor) -> None:
        """Expert deltas: ``part`` "gate_up" | "down", x [P, K], token/expert [P], out [P, N]."""

    def add(self, modules: tuple[str, ...], x: torch.Tensor, out: torch.Tensor,
            cols: tuple[int, ...]) -> None:
        """Deltas of plain weights that read ``x`` [T, K] (router, shared expert) into their
        columns of ``out`` [T, N]."""


def _grouped_ok(t: torch.Tensor) -> bool:
    """grouped_mm needs every non-unit stride to be a multiple of 16 bytes."""
    size = t.element_size()
    return all(st * size % 16 == 0 for st, n in zip(t.stride(), t.shape, strict=True)
               if st != 1 and n > 1)


class MoeBlock:
    """``block(h)``: the routed experts (and shared expert) of one layer for h [T, H]."""

    def __init__(
        self, weights: MoeWeights, config: ModelConfig,
        activation: Callable[[torch.Tensor], torch.Tensor],
        shared: tuple[Project, Project] | None = None, native: bool = False,
    ) -> None:
        """``shared``: the shared expert's gate_up and down projections (Qwen2-MoE);
        ``native``: decode-like steps run the C++ expert product (fp32 on the CPU, the ops
        loaded; module docstring)."""
        self.router = weights.router  # [E, H]
        self.gate_up = weights.gate_up  # [E, 2 I, H]
        self.down = weights.down  # [E, H, I]
        self.num_experts, self.top_k = config.num_experts, config.experts_per_token
        self.inter = config.moe_intermediate_size
        self.norm_topk_prob = config.norm_topk_prob
        self.weights_fp32 = config.routing_weights_fp32
        self.activation = activation
        self.grouped = (_grouped_ok(self.gate_up.transpose(1, 2))
                        and _grouped_ok(self.down.transpose(1, 2)))
        self.native = native
        self.shared = shared
        self.shared_gate = weights.shared_gate  # [1, H] or None
        self.shared_inter = config.shared_expert_intermediate_size

    def route(
        self, h: torch.Tensor, lora: MoeLora | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k routing weights [T, k] (fp32 or h's dtype) and expert ids [T, k]."""
        logits = F.linear(h, self.router)  # [T, E]
        if lora is not None:  # the router's LoRA moves the logits (and so the routing)
            lora.add(("gate",), h, logits, (0,))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_fp32:
            weights = weights.to(h.dtype)
        return weights, experts

    def __call__(
        self, h: torch.Tensor, lora: MoeLora | None = None
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = self.route(h, lora)
        out = self.experts(h, weights, experts, None if lora is None else lora.add_experts)
        if self.shared is not None:
            assert self.shared_gate is not None
            gate_up, down = self.shared
            inter = self.shared_inter
            s = gate_up(h)  # [T, 2 Is]
            if lora is not None:
                lora.add(SHARED_GATE_UP, h, s, (0, inter))
            act = self.activation(s[:, :inter]) * s[:, inter:]  # [T, Is]
            s = down(act)  # [T, H]
            gate = F.linear(h, self.shared_gate)  # [T, 1]
            if lora is not None:
                lora.add((SHARED_DOWN,), act, s, (0,))
                lora.add(("shared_expert_gate",), h, gate, (0,))
            out = out + torch.sigmoid(gate) * s  # [T, H]
        return out

    def experts(
        self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
        lora: ExpertHook | None = None,
    ) -> torch.Tensor:  # [T, H], [T, k], [T, k] -> [T, H]
        """Σ_j weights[t, j] * expert_{experts[t, j]}(h[t]), grouped by expert (module doc)."""
        flat = experts.reshape(-1)  # [P], P = T * k
        order = torch.argsort(flat, stable=True)  # [P] assignments grouped by expert
        token = order // self.top_k  # [P] the token of each sorted assignment
        ends = torch.bincount(flat, minlength=self.num_experts).cumsum(0)  # [E]
        x = h.index_select(0, token)  # [P, H]
        sorted_experts = flat.index_select(0, order) if lora is not None else flat  # [P]
        gate_up = self._segments(x, self.gate_up, ends)  # [P, 2 I]
        if lora is not None:
            lora("gate_up", x, token, sorted_experts, gate_up)
        act = self.activation(gate_up[:, : self.inter]) * gate_up[:, self.inter :]  # [P, I]
        y = self._segments(act, self.down, ends)  # [P, H]
        if lora is not None:
            lora("down", act, token, sorted_experts, y)
        y = y * weights.reshape(-1)[order, None]  # [P, H] (fp32 with Mixtral's weights)
        out = torch.zeros_like(h)  # [T, H]
        out.index_add_(0, token, y.to(h.dtype))
        return out

    def _segments(self, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [P, K] in per-expert segments (``ends`` [E]) times w [E, N, K] (each expert's
        weight as loaded) -> [P, N]."""
        if self.native and x.shape[0] <= NATIVE_ROWS_PER_EXPERT * self.num_experts:
            return expert_segments_mm(x, w, ends)
        w_t = w.transpose(1, 2)  # [E, K, N] (a view)
        if self.grouped:
            return F.grouped_mm(x, w_t, offs=ends.to(torch.int32))
        y = x.new_empty((x.shape[0], w.shape[1]))
        start = 0
        for e, end in enumerate(ends.tolist()):  # host sync: the fallback path only
            if end > start:
                y[start:end] = x[start:end] @ w_t[e]
            start = end
        return y
