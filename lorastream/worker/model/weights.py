"""Load an HF checkpoint's safetensors into :class:`DecoderWeights` (fused q/k/v, gate/up).

Which tensors a layer has follows from the :class:`ModelConfig` alone (module names, biases,
q/k norms, Gemma's extra norms). The checkpoint must hold exactly those, of the config's shapes:
a missing tensor, a wrong shape, or a tensor the config does not explain (a bias the family has
not, a q_norm in a model without one) is refused with the tensor named, before the model exists.

A MoE layer's experts load from either layout found in the wild, into the fused one::

    fused (transformers 5):  mlp.experts.gate_up_proj [E, 2 I, H], mlp.experts.down_proj [E, H, I]
    per expert (older):      mlp.experts.{e}.{gate,up,down}_proj.weight  [I, H], [I, H], [H, I]
                             (Mixtral: block_sparse_moe.experts.{e}.{w1,w3,w2}.weight)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from lorastream.core.errors import InvalidArgument
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderWeights, LayerWeights
from lorastream.worker.model.moe import MoeWeights

log = logging.getLogger(__name__)

_SITE_PREFIX = {"qkv": "self_attn", "o": "self_attn", "gate_up": "mlp", "down": "mlp"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved


def _shards(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [checkpoint / f for f in files]
    shards = sorted(checkpoint.glob("*.safetensors"))
    if not shards:
        raise InvalidArgument(f"{checkpoint}: no *.safetensors weights found")
    return shards


def load_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by HF name (memory-mapped reads, no pickle)."""
    state: dict[str, torch.Tensor] = {}
    for shard in _shards(checkpoint):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle is no mapping: not iterable
                state[key] = f.get_tensor(key)
    return state


class _Reader:
    """Takes tensors out of a checkpoint's state, checking names and shapes."""

    def __init__(
        self, checkpoint: Path, state: dict[str, torch.Tensor], config: ModelConfig,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.checkpoint, self.state, self.config = checkpoint, state, config
        self.dtype, self.device = dtype, device
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.state.get(name)
        if tensor is None:
            raise InvalidArgument(
                f"{self.checkpoint}: weight {name} is missing from the checkpoint, but "
                f"config.json ({self._family()}) implies it {list(shape)}"
            )
        if tuple(tensor.shape) != shape:
            raise InvalidArgument(
                f"{self.checkpoint}: {name} is {list(tensor.shape)}, config.json "
                f"({self._family()}) implies {list(shape)}"
            )
        self.used.add(name)
        owned = tensor.to(device=self.device, dtype=self.dtype)
        # A tensor of the memory-mapped file keeps the whole mapping resident (as file pages,
        # ~the checkpoint's size): a copy of our own lets it go once loading is done.
        return owned.clone() if owned.data_ptr() == tensor.data_ptr() else owned

    def maybe(self, present: bool, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.take(name, shape) if present else None

    def site(self, layer: int, site: str, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A site's projections fused in column order: weight [N, K], bias [N] or None."""
        prefix = f"model.layers.{layer}.{_SITE_PREFIX[site]}."
        weights, biases = [], []
        for t in self.config.projections():
            if t.site != site:
                continue
            weights.append(self.take(f"{prefix}{t.module}.weight", (t.fan_out, t.fan_in)))
            if bias:
                biases.append(self.take(f"{prefix}{t.module}.bias", (t.fan_out,)))
        weight = weights[0] if len(weights) == 1 else torch.cat(weights).contiguous()
        return weight, (torch.cat(biases) if biases else None)

    def experts(self, layer: int) -> MoeWeights:
        """A MoE layer's router, experts (fused or one by one, see the module docstring) and
        shared expert, under the first of the family's prefixes that holds a router."""
        c = self.config
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        base = f"model.layers.{layer}."
        prefixes = [f"{base}{p}." for p in c.moe_prefixes]
        p = next((p for p in prefixes if f"{p}gate.weight" in self.state), prefixes[0])
        router = self.take(f"{p}gate.weight", (e, h))
        if f"{p}experts.gate_up_proj" in self.state:
            gate_up = self.take(f"{p}experts.gate_up_proj", (e, 2 * i, h))
            down = self.take(f"{p}experts.down_proj", (e, h, i))
        else:
            gate, up, down_name = (f"{m}.weight" for m in c.expert_modules)
            gate_up = torch.stack([
                torch.cat([self.take(f"{p}experts.{n}.{gate}", (i, h)),
                           self.take(f"{p}experts.{n}.{up}", (i, h))])
                for n in range(e)
            ])
            down = torch.stack([self.take(f"{p}experts.{n}.{down_name}", (h, i)) for n in range(e)])
        weights = MoeWeights(router=router, gate_up=gate_up, down=down)
        s = c.shared_expert_intermediate_size
        if s:
            weights.shared_gate_up = torch.cat([
                self.take(f"{p}shared_expert.gate_proj.weight", (s, h)),
                self.take(f"{p}shared_expert.up_proj.weight", (s, h)),
            ])
            weights.shared_down = self.take(f"{p}shared_expert.down_proj.weight", (h, s))
            weights.shared_gate = self.take(f"{p}shared_expert_gate.weight", (1, h))
        return weights

    def refuse_unexpected(self) -> None:
        unexpected = sorted(
            k for k in set(self.state) - self.used if not k.endswith(_IGNORED_SUFFIXES)
        )
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise InvalidArgument(
                f"{self.checkpoint}: tensor {unexpected[0]}{more} is in the checkpoint but "
                f"config.json ({self._family()}) has no such weight; the checkpoint and its "
                "config.json disagree (save both with the same save_pretrained)"
            )

    def _family(self) -> str:
        return f"model_type {self.config.family}"


def load_weights(
    checkpoint: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> DecoderWeights:
    reader = _Reader(checkpoint, load_state(checkpoint), config, dtype, device)
    c, take, maybe = config, reader.take, reader.maybe
    h, d = (c.hidden_size,), (c.head_dim,)
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        wqkv, b_qkv = reader.site(i, "qkv", c.qkv_bias)
        wo, b_o = reader.site(i, "o", c.o_bias)
        moe = reader.experts(i) if c.is_moe_layer(i) else None
        w_gate_up = b_gate_up = w_down = b_down = None
        if moe is None:
            w_gate_up, b_gate_up = reader.site(i, "gate_up", c.mlp_bias)
            w_down, b_down = reader.site(i, "down", c.mlp_bias)
        # Llama's post_attention_layernorm is the MLP's pre-norm; Gemma's is on attention's output.
        sandwich = c.sandwich_norms
        mlp_norm = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
        layers.append(LayerWeights(
            attn_norm=take(p + "input_layernorm.weight", h),
            wqkv=wqkv, wo=wo, w_gate_up=w_gate_up, w_down=w_down,
            b_qkv=b_qkv, b_o=b_o, b_gate_up=b_gate_up, b_down=b_down,
            mlp_norm=take(f"{p}{mlp_norm}.weight", h),
            q_norm=maybe(c.qk_norm, p + "self_attn.q_norm.weight", d),
            k_norm=maybe(c.qk_norm, p + "self_attn.k_norm.weight", d),
            post_attn_norm=maybe(sandwich, p + "post_attention_layernorm.weight", h),
            post_mlp_norm=maybe(sandwich, p + "post_feedforward_layernorm.weight", h),
            moe=moe,
        ))
    embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    if c.tie_word_embeddings:
        lm_head = embed
        reader.used.add("lm_head.weight")  # a tied checkpoint may store the copy too
    else:
        lm_head = take("lm_head.weight", (c.vocab_size, c.hidden_size))
    norm = take("model.norm.weight", h)
    reader.refuse_unexpected()
    log.info("%s: %s weights loaded (%d layers)", checkpoint, c.family, c.num_layers)
    return DecoderWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
