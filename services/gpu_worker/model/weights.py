"""Load an HF Llama checkpoint's safetensors into :class:`LlamaWeights` (fused q/k/v, gate/up)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from lorastream.core.errors import InvalidArgument
from lorastream.worker.model.config import LlamaConfig
from lorastream.worker.model.llama import LayerWeights, LlamaWeights

log = logging.getLogger(__name__)


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
            for key in f.keys():
                state[key] = f.get_tensor(key)
    return state


def load_weights(
    checkpoint: Path, config: LlamaConfig, dtype: torch.dtype, device: torch.device
) -> LlamaWeights:
    state = load_state(checkpoint)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        tensor = state.get(name)
        if tensor is None:
            raise InvalidArgument(f"{checkpoint}: weight {name} is missing from the checkpoint")
        used.add(name)
        return tensor.to(device=device, dtype=dtype)

    def expect(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
        if tuple(tensor.shape) != shape:
            raise InvalidArgument(
                f"{checkpoint}: {name} is {list(tensor.shape)}, config.json implies {list(shape)}"
            )
        return tensor

    c = config
    h, q, kv, inter = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        wq = expect(take(p + "self_attn.q_proj.weight"), (q, h), p + "q_proj")
        wk = expect(take(p + "self_attn.k_proj.weight"), (kv, h), p + "k_proj")
        wv = expect(take(p + "self_attn.v_proj.weight"), (kv, h), p + "v_proj")
        gate = expect(take(p + "mlp.gate_proj.weight"), (inter, h), p + "gate_proj")
        up = expect(take(p + "mlp.up_proj.weight"), (inter, h), p + "up_proj")
        layers.append(
            LayerWeights(
                attn_norm=take(p + "input_layernorm.weight"),
                wqkv=torch.cat([wq, wk, wv]).contiguous(),
                wo=expect(take(p + "self_attn.o_proj.weight"), (h, q), p + "o_proj"),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                w_gate_up=torch.cat([gate, up]).contiguous(),
                w_down=expect(take(p + "mlp.down_proj.weight"), (h, inter), p + "down_proj"),
            )
        )
    embed = expect(take("model.embed_tokens.weight"), (c.vocab_size, h), "embed_tokens")
    if c.tie_word_embeddings or "lm_head.weight" not in state:
        lm_head = embed
        used.add("lm_head.weight")
    else:
        lm_head = expect(take("lm_head.weight"), (c.vocab_size, h), "lm_head")
    norm = take("model.norm.weight")
    unused = sorted(set(state) - used - {"lm_head.weight"})
    unused = [k for k in unused if not k.endswith("rotary_emb.inv_freq")]
    if unused:
        log.warning("%s: %d checkpoint tensors unused, e.g. %s", checkpoint, len(unused), unused[:3])
    return LlamaWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
