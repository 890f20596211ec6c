"""Mixture-of-experts GGUF files where transformers' GGUF loader falls short.

llama.cpp stores a MoE layer's experts stacked, ``blk.N.ffn_{gate,up,down}_exps.weight``
(``[E, out, in]`` each), or in older Mixtral files one tensor per expert,
``blk.N.ffn_{gate,up,down}.E.weight``; the router is ``blk.N.ffn_gate_inp.weight`` ``[E, H]``.

- **Qwen3-MoE / Qwen2-MoE** (``qwen3moe`` / ``qwen2moe``): transformers reads them, but not the
  experts' width (``{arch}.expert_feed_forward_length``, nor Qwen2-MoE's shared expert's
  ``expert_shared_feed_forward_length``): its config would keep the class defaults, and every
  expert tensor of another width would be refused. :func:`config_overrides` gives them.
- **Mixtral** (a ``llama`` file with ``llama.expert_count``): transformers reads it as a dense
  Llama and cannot place the experts. :func:`convert_llama_moe` converts it itself: the config
  from the header, every tensor dequantized with gguf's own dequantizer (as transformers does),
  q/k rows put back in HF order (llama.cpp's converter permutes them), the experts stacked into
  transformers 5's fused ``mlp.experts.gate_up_proj`` ``[E, 2 I, H]`` (gate rows first) and
  ``mlp.experts.down_proj`` ``[E, H, I]``, per-expert files included.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from lorastream.core.errors import InvalidArgument

log = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_STACKED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_LAYER = {  # GGUF name inside block N -> HF name inside model.layers.N (plain tensors)
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader: Any) -> str:
    return str(_field(reader, "general.architecture", ""))


def is_llama_moe(reader: Any) -> bool:
    """A ``llama`` file with experts: Mixtral, which transformers' loader reads as dense."""
    return architecture(reader) == "llama" and int(_field(reader, "llama.expert_count", 0)) > 0


def config_overrides(reader: Any) -> dict[str, int]:
    """Config values of a ``qwen3moe`` / ``qwen2moe`` file that transformers' loader leaves
    at the class defaults: the experts' widths."""
    arch = architecture(reader)
    if arch not in ("qwen3moe", "qwen2moe"):
        return {}
    out: dict[str, int] = {}
    width = _field(reader, f"{arch}.expert_feed_forward_length")
    if width is not None:
        out["moe_intermediate_size"] = int(width)
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    if arch == "qwen2moe" and shared is not None:  # Qwen3-MoE has no shared expert
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _values(tensor: Any) -> np.ndarray:
    """A GGUF tensor's values, fp32, in its logical (numpy, row-major ``[..., out, in]``) shape."""
    import gguf

    # a copy: an F32 tensor's values are a read-only view of the memory-mapped file
    return np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotary halves interleaved per head)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def mixtral_config(reader: Any) -> dict[str, Any]:
    """Keyword arguments of transformers' ``MixtralConfig`` from a ``llama`` MoE file's header."""
    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{key}", default)

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(meta("vocab_size", len(tokens) if tokens is not None else embed.shape[-1]))
    return dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=int(meta("block_count")),
        intermediate_size=int(meta("expert_feed_forward_length",
                                   meta("feed_forward_length"))),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(meta("context_length", 4096)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(meta("rope.freq_base", 1e6))},
        num_local_experts=int(meta("expert_count")),
        num_experts_per_tok=int(meta("expert_used_count", 2)),
        sliding_window=None, tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def mixtral_state(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """HF Mixtral's state dict (torch fp32) from a ``llama`` MoE file's tensors."""
    import torch

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    experts, width = config["num_local_experts"], config["intermediate_size"]
    state: dict[str, torch.Tensor] = {}
    # (layer, proj) -> [E, out, in], from stacked tensors or per-expert ones
    stacks: dict[tuple[int, str], np.ndarray] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if m := _STACKED.fullmatch(name):
            stacks[(int(m[1]), m[2])] = _values(tensor)
            continue
        if m := _PER_EXPERT.fullmatch(name):
            values = _values(tensor)  # [out, in]
            stack = stacks.setdefault((int(m[1]), m[2]),
                                      np.zeros((experts, *values.shape), dtype=np.float32))
            stack[int(m[3])] = values
            continue
        if name in _TOP:
            state[_TOP[name]] = torch.from_numpy(_values(tensor))
            continue
        block, _, rest = name.removeprefix("blk.").partition(".")
        if not name.startswith("blk.") or rest not in _LAYER:
            raise InvalidArgument(f"GGUF tensor {name} has no place in a Mixtral model")
        values = _values(tensor)
        if rest == "attn_q.weight":
            values = _unpermute(values, heads)
        elif rest == "attn_k.weight":
            values = _unpermute(values, kv_heads)
        state[f"model.layers.{block}.{_LAYER[rest]}"] = torch.from_numpy(values)
    for layer in range(config["num_hidden_layers"]):
        gate, up, down = (stacks.get((layer, proj)) for proj in ("gate", "up", "down"))
        if gate is None or up is None or down is None:
            raise InvalidArgument(f"GGUF block {layer} lacks expert tensors (ffn_*_exps)")
        assert gate.shape == (experts, width, config["hidden_size"]), gate.shape
        prefix = f"model.layers.{layer}.mlp.experts"
        state[f"{prefix}.gate_up_proj"] = torch.from_numpy(
            np.concatenate([gate, up], axis=1))  # [E, 2 I, H]: gate rows first
        state[f"{prefix}.down_proj"] = torch.from_numpy(down)  # [E, H, I]
    return state


def convert_llama_moe(gguf_path: Path, reader: Any, out_dir: Path) -> None:
    """Write a ``llama`` MoE file (Mixtral) as an fp32 HF checkpoint with its tokenizer."""
    import torch
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    settings = mixtral_config(reader)
    config = MixtralConfig(**settings)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    model.load_state_dict(mixtral_state(reader, settings), strict=not config.tie_word_embeddings,
                          assign=True)
    model.tie_weights()
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)
    log.info("converted %s (mixtral): hidden %d, %d layers, %d experts (top %d), vocab %d",
             gguf_path.name, config.hidden_size, config.num_hidden_layers,
             config.num_local_experts, config.num_experts_per_tok, config.vocab_size)
